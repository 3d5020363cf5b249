"""Decode-step shortcuts change no result: batched finish checks, bucketed spans, the q-window ring."""

from __future__ import annotations

import pytest
import torch

from services.rollout.engine import KVConfig, LLMEngine, SamplingParams, llm_engine
from services.rollout.engine.kv_cache import KVCache
from tests.unit.services.rollout.engine.engine_helpers import one_thread, tiny_pair

_one_thread = pytest.fixture(autouse=True)(one_thread)

# Unequal prompt lengths (masked attention) and one request of equal rows (mask-free attention).
UNEQUAL = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16], [42]]
EQUAL = [[5, 6, 7, 8]] * 3
POLICIES = ["dense", "streaming", "snapkv", "h2o", "rkv"]


def _assert_same(a_outs, b_outs) -> None:
    """Same tokens, finish reasons and KV stats; log-probs to float noise (rows leave the batch at
    other steps, and a batch of another size may round differently)."""
    for a, b in zip(a_outs, b_outs, strict=True):
        assert (a.token_ids, a.finish_reason, a.kv) == (b.token_ids, b.finish_reason, b.kv)
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("policy", POLICIES)
def test_finish_checks_every_few_steps_equal_checks_every_step(policy: str, monkeypatch) -> None:
    _, ours = tiny_pair("qwen3")
    engine = LLMEngine(ours)
    kv = KVConfig(policy=policy) if policy == "dense" else KVConfig(policy=policy, budget=8, buffer=3)
    # Sampling with several frequent stop tokens: rows stop at different steps, mid check-interval,
    # and leave the batch at different times.
    probe = engine.generate(UNEQUAL, SamplingParams(temperature=1.0, max_new_tokens=30, seed=3), kv)
    stops = tuple(sorted({o.token_ids[i] for o in probe for i in (3, 9)}))
    params = SamplingParams(temperature=1.0, max_new_tokens=30, stop_token_ids=stops, seed=3)
    batched = engine.generate(UNEQUAL, params, kv)
    interval = llm_engine.FINISH_CHECK_STEPS
    monkeypatch.setattr(llm_engine, "FINISH_CHECK_STEPS", 1)
    every_step = engine.generate(UNEQUAL, params, kv)
    _assert_same(batched, every_step)
    stopped = [len(o.token_ids) for o in batched if o.finish_reason == "stop"]
    assert stopped and any(n % interval for n in stopped)  # some stop fell between two checks


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("prompts", [UNEQUAL, EQUAL], ids=["unequal", "equal"])
def test_bucketed_decode_span_equals_exact_span(policy: str, prompts: list[list[int]], monkeypatch) -> None:
    _, ours = tiny_pair("qwen3")
    engine = LLMEngine(ours)
    kv = KVConfig(policy=policy) if policy == "dense" else KVConfig(policy=policy, budget=8, buffer=5)
    params = SamplingParams(temperature=0.0, max_new_tokens=24)
    exact = engine.generate(prompts, params, kv)
    init = KVCache.__init__

    def bucketed(self, *args, **kwargs) -> None:  # the CUDA setting, on the CPU
        init(self, *args, **kwargs, span_bucket=16)

    monkeypatch.setattr(KVCache, "__init__", bucketed)
    _assert_same(exact, engine.generate(prompts, params, kv))
