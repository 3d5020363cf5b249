"""The eviction a worker records while generating is the eviction the trainer's replay computes."""

from __future__ import annotations

import pytest
import torch

from services.rollout.engine import KVConfig, LLMEngine, SamplingParams
from services.rollout.engine.eviction_log import NEVER, visibility
from services.rollout.engine.replay import visible_positions

PROMPTS = [[1, 10, 11, 12, 13, 14, 15], [1, 20, 21, 22], [1, 30, 31, 32, 33, 34, 35, 36, 37], [1, 5, 6]]


@pytest.mark.parametrize("kv", [
    KVConfig(policy="rkv", budget=6, buffer=2, window=2, keep_prompt=False),  # the prompt cut at prefill
    KVConfig(policy="snapkv", budget=4, buffer=3, window=2, keep_prompt=True),
])
def test_recorded_evictions_equal_the_replayed_ones(tiny_model_dir: str, kv: KVConfig) -> None:
    engine = LLMEngine.from_pretrained(tiny_model_dir)
    engine.record_evictions = True
    # Stop tokens end rows at different steps, so finished rows leave the cache mid-batch.
    params = SamplingParams(temperature=1.0, max_new_tokens=24, seed=5, stop_token_ids=(2, 3, 4, 7, 8))
    outs = engine.generate(PROMPTS, params, kv)
    assert len({len(o.token_ids) for o in outs}) > 1
    assert sum(o.kv.evicted > 0 for o in outs) >= 2
    completions = [list(o.token_ids) for o in outs]
    replayed = visible_positions(engine, PROMPTS, completions, kv)
    layers, heads = engine.runner.num_layers, engine.runner.num_kv_heads
    for i, (prompt, out) in enumerate(zip(PROMPTS, outs, strict=True)):
        length = len(prompt) + len(out.token_ids)
        assert out.evicted_at is not None and len(out.evicted_at) == layers * heads * length
        seen = visibility(out.evicted_at, layers, heads, length)
        assert torch.equal(seen, replayed[i, :, :, :length, :length]), i
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        hidden = bool((causal & ~seen).any())
        assert hidden == (out.kv.evicted > 0)  # hidden positions exactly where the cache evicted


def test_nothing_is_recorded_unless_asked_or_dense(tiny_model_dir: str) -> None:
    engine = LLMEngine.from_pretrained(tiny_model_dir)
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=1)
    sparse = KVConfig(policy="rkv", budget=6, buffer=2, window=2, keep_prompt=False)
    assert all(o.evicted_at is None for o in engine.generate(PROMPTS, params, sparse))
    engine.record_evictions = True
    assert all(o.evicted_at is None for o in engine.generate(PROMPTS, params, KVConfig()))


def test_visibility_refuses_a_record_that_does_not_fit() -> None:
    with pytest.raises(ValueError, match="entries"):
        visibility([NEVER] * 5, 1, 2, 3)
    with pytest.raises(ValueError, match="own query"):
        visibility([NEVER, 1, NEVER], 1, 1, 3)  # position 1 hidden from query 1
    seen = visibility([2, NEVER, NEVER], 1, 1, 3)  # position 0 hidden from query 2 on
    assert seen[0, 0].tolist() == [[True, False, False], [True, True, False], [False, True, True]]
