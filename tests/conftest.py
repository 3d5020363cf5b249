"""Fixtures shared by the whole suite: real Redis, real HTTP servers on loopback."""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from shared.ports import free_port
from tests.paths import REPO_ROOT

# Tests run beside other work on small machines: keep torch from oversubscribing the cores.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


@contextmanager
def serve_app(app, port: int | None = None, **options) -> Iterator[str]:
    """Run an ASGI app under a real uvicorn server on loopback in a thread; yield its base URL
    (`options`: more uvicorn.Config settings)."""
    import uvicorn

    port = port or free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on", **options)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)


@pytest.fixture
def clean_settings_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Settings tests: no SPARSECAST_* variable of the caller's environment, and every deprecated
    flat name warned about afresh (shared.settings warns once per process)."""
    for name in list(os.environ):
        if name.upper().startswith("SPARSECAST_"):
            monkeypatch.delenv(name)
    monkeypatch.setattr("shared.settings._warned_aliases", set())


@pytest.fixture
def redis_url() -> str:
    return REDIS_URL


@pytest.fixture
def redis_prefix(redis_url: str) -> Iterator[str]:
    """A key prefix of this test's own; every key under it is deleted afterwards."""
    import redis

    prefix = f"test:{uuid.uuid4().hex[:12]}"
    yield prefix
    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


def build_tiny_model_dir(path, seed: int = 0, **overrides) -> str:
    """A tiny Qwen3 HF model directory (bf16 safetensors + the char tokenizer), no download."""
    from transformers import GenerationConfig, Qwen3ForCausalLM

    from shared.modeling import qwen3_config
    from shared.tokenizer import save_tokenizer

    tokenizer = save_tokenizer(path)
    config = qwen3_config("tiny")
    config.vocab_size = len(tokenizer)
    config.bos_token_id, config.eos_token_id, config.pad_token_id = (
        tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    shape = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, **overrides}
    config.layer_types = ["full_attention"] * shape["num_hidden_layers"]
    for key, value in shape.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id,
                                               eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny-model"))


def _warmstart_cache() -> Path:
    return Path(os.environ.get("SPARSECAST_WARMSTART_CACHE", REPO_ROOT / ".cache" / "warmstart"))


@pytest.fixture(scope="session")
def warmstart_dir() -> Path:
    """The demo's warm-start model (eviction-aware SFT, ~7 minutes on 2 cores), built once per
    checkout and cached: for `make test-slow`, which checks what the demo does with it."""
    from services.trainer.warmstart import ensure_warmstart_model

    return ensure_warmstart_model(_warmstart_cache())


@pytest.fixture(scope="session")
def partial_model_dir() -> Path:
    """A partly trained model of the demo's shape for the default suite: the warm-start recipe
    with dense SFT (~1.5 minutes on 2 cores instead of ~7), built once per checkout and cached."""
    from services.trainer.warmstart import WarmstartRecipe, ensure_warmstart_model

    return ensure_warmstart_model(_warmstart_cache(), WarmstartRecipe(evict_share=0.0, level_check=None))
