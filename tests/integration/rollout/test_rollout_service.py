"""The rollout service over real HTTP: generation with every KV policy, the OpenAI subset, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch

from services.rollout.app import create_app
from services.rollout.settings import RolloutSettings
from shared.dtypes import compute_dtype
from shared.kv import KVSettings
from tests.conftest import serve_app

POLICIES = ["dense", "streaming", "snapkv", "h2o", "rkv"]


@pytest.fixture(scope="module")
def rollout_url(tiny_model_dir: str):
    settings = RolloutSettings(model=tiny_model_dir, device="cpu",
                               kv=KVSettings(policy="rkv", budget=16, buffer=8), max_batch=8,
                               max_new_tokens_limit=256, redis_url="", registry_url="")
    with serve_app(create_app(settings)) as url:
        yield url


def _kv_stats(prompt_len: int, max_tokens: int, budget: int, buffer: int, sparse: bool) -> tuple[int, int]:
    """(peak tokens stored, tokens evicted) of a sequence run to max_tokens with the prompt kept:
    every sampled token but the last is fed back and stored; a sparse policy compresses the
    generated tokens back to `budget` whenever they reach budget + buffer."""
    stored = peak = evicted = 0
    for _ in range(max_tokens - 1):
        stored += 1
        peak = max(peak, stored)
        if sparse and stored >= budget + buffer:
            evicted, stored = evicted + stored - budget, budget
    return prompt_len + peak, evicted


def _bytes_per_token(model_dir: str) -> int:
    """K and V bytes of one token over all layers and KV heads, in the dtype the engine computes in:
    bf16, or fp32 on a CPU that only emulates bf16 (shared.dtypes)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    width = compute_dtype(torch.device("cpu"), torch.bfloat16).itemsize
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * width


@pytest.mark.parametrize("policy", POLICIES)
def test_generate_with_every_policy(rollout_url: str, tiny_model_dir: str, policy: str) -> None:
    body = {"prompts": ["12+34=", "7+8="], "n": 2, "max_tokens": 40, "temperature": 1.0, "seed": 3,
            "kv_policy": policy, "kv_budget": 12, "kv": {"buffer": 4}, "stop_token_ids": []}
    r = httpx.post(f"{rollout_url}/v1/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["kv_policy"] == policy and out["engine"] == "native"
    assert [c["prompt_index"] for c in out["completions"]] == [0, 0, 1, 1]
    per_token = _bytes_per_token(tiny_model_dir)
    for c in out["completions"]:
        assert len(c["token_ids"]) == 40 == len(c["logprobs"])  # no stop tokens: runs to max_tokens
        assert c["finish_reason"] == "length"
        assert all(lp <= 0 for lp in c["logprobs"])
        # The character tokenizer: one token per character, plus BOS.
        prompt_len = len(body["prompts"][c["prompt_index"]]) + 1
        # Prompt kept; a sparse policy stores at most budget + buffer generated tokens, the rest evicted.
        peak, evicted = _kv_stats(prompt_len, 40, budget=12, buffer=4, sparse=policy != "dense")
        assert c["kv"] == {"peak_tokens": peak, "peak_bytes": peak * per_token, "evicted": evicted}


def test_generate_is_reproducible_with_a_seed(rollout_url: str) -> None:
    body = {"prompt_ids": [[1, 10, 11, 12]], "max_tokens": 16, "seed": 7, "kv_policy": "dense"}
    a = httpx.post(f"{rollout_url}/v1/generate", json=body, timeout=60).json()
    b = httpx.post(f"{rollout_url}/v1/generate", json=body, timeout=60).json()
    assert a["completions"][0]["token_ids"] == b["completions"][0]["token_ids"]
    assert a["weight_version"] == 0 and a["fingerprint"].startswith("fp1-")


def test_openai_client_completion(rollout_url: str) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{rollout_url}/v1", api_key="unused")
    resp = client.completions.create(model="sparsecast", prompt="3+4=", max_tokens=8, temperature=0.0,
                                      n=2, logprobs=1)
    assert len(resp.choices) == 2
    assert resp.choices[0].text == resp.choices[1].text  # greedy
    lp = resp.choices[0].logprobs
    assert lp is not None and len(lp.tokens) == len(lp.token_logprobs)
    assert "".join(lp.tokens) == resp.choices[0].text
    assert all(x <= 0 for x in lp.token_logprobs)
    assert resp.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in resp.choices)
    assert resp.usage.prompt_tokens == 2 * len("3+4=") + 2  # both samples' prompt with its BOS
    for choice in resp.choices:
        assert choice.finish_reason == "stop" or len(choice.logprobs.tokens) == 8


def test_openai_stop_string_truncates(rollout_url: str) -> None:
    full = httpx.post(
        f"{rollout_url}/v1/completions",
        json={"prompt": "5+5=", "max_tokens": 12, "temperature": 0},
        timeout=60,
    ).json()["choices"][0]["text"]
    assert len(full) >= 2
    stop = full[1]
    cut = httpx.post(f"{rollout_url}/v1/completions",
                     json={"prompt": "5+5=", "max_tokens": 12, "temperature": 0, "stop": [stop]},
                     timeout=60).json()["choices"][0]
    assert cut["text"] == full[: full.index(stop)] and cut["finish_reason"] == "stop"


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        ({"prompts": ["1+1="], "kv_policy": "lru"}, 422, "kv_policy"),
        ({"prompts": ["1+1="], "max_tokens": -5}, 422, "max_tokens"),
        ({"prompts": ["1+1="], "max_tokens": 10_000}, 400, "limit"),
        ({"prompts": [""]}, 422, "empty"),
        ({"prompts": []}, 422, "no prompts"),
        ({"prompts": ["1+1="], "n": 9}, 413, "limit"),
        ({"prompts": "1+1="}, 422, "prompts"),
        ({"prompts": ["1+1="], "temperature": "hot"}, 422, "temperature"),
        ({"prompt_ids": [[1, 2, 999999]]}, 422, "vocabulary"),
        ({"prompts": ["1+1="], "prompt_ids": [[1, 2]]}, 422, "exactly one"),
        ({"prompts": ["1+1="], "kv_policy": "rkv", "kv_budget": 2}, 422, "window"),
        ({"prompts": ["1+1="], "kv": {"nonsense": 1}}, 422, "nonsense"),
    ],
)
def test_bad_generate_requests_get_a_clear_4xx(
    rollout_url: str, body: dict, status: int, needle: str
) -> None:
    r = httpx.post(f"{rollout_url}/v1/generate", json=body, timeout=30)
    assert r.status_code == status, r.text
    assert needle in r.text
    assert httpx.get(f"{rollout_url}/healthz").status_code == 200  # still serving


def test_bad_completion_requests(rollout_url: str) -> None:
    url = f"{rollout_url}/v1/completions"
    assert httpx.post(url, json={"prompt": "1+1=", "stream": True}).status_code == 422
    assert httpx.post(url, json={"max_tokens": 3}).status_code == 422
    assert httpx.post(url, json={"prompt": "1", "n": 100}).status_code == 413
    assert (
        httpx.post(url, content=b"{not json", headers={"content-type": "application/json"}).status_code == 422
    )


def test_weights_health_and_metrics(rollout_url: str) -> None:
    w = httpx.get(f"{rollout_url}/v1/weights").json()
    assert w["version"] == 0 and w["sync_state"] == "idle" and w["engine"] == "native"
    assert httpx.get(f"{rollout_url}/readyz").json()["ready"] is True
    metrics = httpx.get(f"{rollout_url}/metrics").text
    assert "rollout_generated_tokens_total" in metrics and "rollout_weight_version 0.0" in metrics
