"""Generation against transformers: greedy tokens, recorded log-probs, seeds, stops, bad input."""

from __future__ import annotations

import pytest
import torch

from services.rollout.engine import KVConfig, LLMEngine, SamplingParams
from tests.unit.services.rollout.engine.engine_helpers import VOCAB, one_thread, tiny_pair

_one_thread = pytest.fixture(autouse=True)(one_thread)

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16], [42]]
POLICIES = ["dense", "streaming", "snapkv", "h2o", "rkv"]


def _recompute_logprobs(hf, prompt: list[int], tokens: list[int], temperature: float) -> torch.Tensor:
    """Dense recomputation the trainer does: log_softmax(logits / T) of each sampled token."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = hf(ids).logits[0, len(prompt) - 1 : -1].float()
    logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    return logp.gather(-1, torch.tensor(tokens)[:, None])[:, 0]


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_dense_greedy_equals_transformers_generate(family: str) -> None:
    hf, ours = tiny_pair(family, tied=family == "qwen3")
    outs = LLMEngine(ours).generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=24), KVConfig())
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
        assert out.token_ids == ref[0, len(prompt):].tolist()
        assert out.finish_reason == "length"


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(0.0, 0, 1.0), (0.7, 20, 0.9), (1.3, 0, 1.0)])
def test_recorded_logprobs_equal_dense_recomputation(temperature: float, top_k: int, top_p: float) -> None:
    hf, ours = tiny_pair("qwen3")
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=20, seed=5)
    for prompt, out in zip(PROMPTS, LLMEngine(ours).generate(PROMPTS, params, KVConfig()), strict=True):
        expected = _recompute_logprobs(hf, prompt, out.token_ids, temperature)
        torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=1e-4, rtol=1e-4)


def test_top_k_one_is_greedy_and_top_p_keeps_the_nucleus() -> None:
    _, ours = tiny_pair("qwen3")
    engine = LLMEngine(ours)
    greedy = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=12), KVConfig())
    top1 = engine.generate(
        PROMPTS, SamplingParams(temperature=1.0, top_k=1, max_new_tokens=12, seed=1), KVConfig()
    )
    tiny_p = engine.generate(
        PROMPTS, SamplingParams(temperature=1.0, top_p=1e-6, max_new_tokens=12, seed=2), KVConfig()
    )
    assert [o.token_ids for o in top1] == [o.token_ids for o in greedy] == [o.token_ids for o in tiny_p]


def test_same_seed_same_samples_and_rows_independent_of_batch_position() -> None:
    _, ours = tiny_pair("qwen3")
    engine = LLMEngine(ours)
    params = SamplingParams(temperature=1.0, max_new_tokens=16, seed=123)
    first = engine.generate(PROMPTS, params, KVConfig())
    second = engine.generate(PROMPTS, params, KVConfig())
    other = engine.generate(PROMPTS, params.model_copy(update={"seed": 124}), KVConfig())
    assert [o.token_ids for o in first] == [o.token_ids for o in second]
    assert [o.token_ids for o in first] != [o.token_ids for o in other]
    # Copies of one prompt in one request draw different samples.
    twins = engine.generate([[3, 4]] * 4, params, KVConfig())
    assert len({tuple(o.token_ids) for o in twins}) > 1


def test_stop_tokens_end_each_sequence_and_are_recorded() -> None:
    hf, ours = tiny_pair("qwen3")
    engine = LLMEngine(ours)
    probe = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=16), KVConfig())
    stop = probe[0].token_ids[5]
    outs = engine.generate(
        PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=16, stop_token_ids=(stop,)), KVConfig()
    )
    for full, out in zip(probe, outs, strict=True):
        if stop in full.token_ids:
            cut = full.token_ids.index(stop) + 1
            assert out.token_ids == full.token_ids[:cut] and out.finish_reason == "stop"
            assert out.logprobs == pytest.approx(full.logprobs[:cut], abs=1e-5)
        else:
            assert out.token_ids == full.token_ids and out.finish_reason == "length"
    assert outs[0].finish_reason == "stop" and len(outs[0].token_ids) <= 6


@pytest.mark.parametrize("policy", POLICIES[1:])
def test_budget_covering_the_sequence_equals_dense(policy: str) -> None:
    _, ours = tiny_pair("qwen3")
    engine = LLMEngine(ours)
    params = SamplingParams(temperature=0.9, max_new_tokens=30, seed=9)
    dense = engine.generate(PROMPTS, params, KVConfig())
    for kv in (
        KVConfig(policy=policy, budget=30, buffer=4),
        KVConfig(policy=policy, budget=40, keep_prompt=False),
        # Per-layer budgets of 90 and 30 (2 layers): even the top layer holds the whole sequence.
        KVConfig(policy=policy, budget=60, buffer=4, layer_budgets="pyramid", pyramid_beta=2),
    ):
        sparse = engine.generate(PROMPTS, params, kv)
        for d, s in zip(dense, sparse, strict=True):
            assert s.token_ids == d.token_ids
            assert s.logprobs == pytest.approx(d.logprobs, abs=1e-5)
            assert s.kv.evicted == 0 and s.kv.peak_tokens == d.kv.peak_tokens


@pytest.mark.parametrize("policy", POLICIES[1:])
def test_sparse_logprobs_come_from_the_compressed_cache(policy: str) -> None:
    """Once tokens are evicted the recorded log-probs differ from dense recomputation (π_sparse ≠ π_dense)."""
    hf, ours = tiny_pair("qwen3")
    params = SamplingParams(temperature=1.0, max_new_tokens=48, seed=4)
    out = LLMEngine(ours).generate([PROMPTS[2]], params, KVConfig(policy=policy, budget=8, buffer=4))[0]
    assert out.kv.evicted > 0
    dense = _recompute_logprobs(hf, PROMPTS[2], out.token_ids, 1.0)
    first_compression = 8 + 4  # generated tokens stored when the buffer first fills
    head = slice(0, first_compression)
    torch.testing.assert_close(torch.tensor(out.logprobs[head]), dense[head], atol=1e-4, rtol=1e-4)
    assert (torch.tensor(out.logprobs[first_compression:]) - dense[first_compression:]).abs().max() > 1e-3


def test_bad_input_is_refused_with_a_message() -> None:
    _, ours = tiny_pair("qwen3")
    engine = LLMEngine(ours)
    params = SamplingParams(max_new_tokens=2)
    with pytest.raises(ValueError, match="no prompts"):
        engine.generate([], params)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[1], []], params)
    with pytest.raises(ValueError, match="outside"):
        engine.generate([[1, VOCAB]], params)
    with pytest.raises(ValueError, match="stop_token_ids"):
        engine.generate([[1]], SamplingParams(stop_token_ids=(VOCAB,)))
    with pytest.raises(ValueError, match="window"):
        KVConfig(policy="rkv", budget=4)
    with pytest.raises(ValueError):
        SamplingParams(top_p=0.0)


@pytest.mark.gpu
@pytest.mark.parametrize("policy", POLICIES)
def test_cuda_matches_cpu(policy: str) -> None:
    _, ours = tiny_pair("qwen3")
    params = SamplingParams(temperature=0.0, max_new_tokens=32)
    kv = KVConfig(policy=policy, budget=16, buffer=8)
    cpu = LLMEngine(ours).generate(PROMPTS, params, kv)
    _, ours = tiny_pair("qwen3")
    gpu = LLMEngine(ours, device="cuda").generate(PROMPTS, params, kv)
    for c, g in zip(cpu, gpu, strict=True):
        assert g.token_ids == c.token_ids  # every token of the 32, greedy in fp32
        assert g.logprobs == pytest.approx(c.logprobs, abs=1e-3)
        assert g.kv == c.kv  # stats depend only on lengths and the budget


@pytest.mark.parametrize("policy", ["dense", "rkv", "h2o"])
def test_batched_rows_equal_their_solo_runs_across_stops_and_evictions(policy: str) -> None:
    """Padding, per-row lengths, row removal after stops and compression leave each sequence as if alone."""
    _, ours = tiny_pair("qwen3")
    engine = LLMEngine(ours)
    kv = KVConfig(policy=policy, budget=8, buffer=4)
    probe = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=40), kv)
    stop = probe[1].token_ids[3]
    params = SamplingParams(temperature=0.0, max_new_tokens=40, stop_token_ids=(stop,))
    batched = engine.generate(PROMPTS, params, kv)
    assert any(o.finish_reason == "stop" for o in batched)
    assert any(o.kv.evicted for o in batched) == (policy != "dense")
    for prompt, out in zip(PROMPTS, batched, strict=True):
        solo = engine.generate([prompt], params, kv)[0]
        assert out.token_ids == solo.token_ids and out.finish_reason == solo.finish_reason
        assert out.logprobs == pytest.approx(solo.logprobs, abs=1e-4)
        assert out.kv == solo.kv


@pytest.mark.parametrize("policy", ["snapkv", "h2o", "rkv"])
@pytest.mark.parametrize("keep_prompt", [False, True])
def test_a_sequence_is_evicted_alike_alone_or_in_any_batch(policy: str, keep_prompt: bool) -> None:
    """A row compresses when it reaches its own budget + buffer, never because a batch-mate did: its
    cache, tokens and log-probs do not depend on the batch (what lets the trainer replay it alone)."""
    _, ours = tiny_pair("qwen3")
    engine = LLMEngine(ours)
    kv = KVConfig(policy=policy, budget=8, buffer=3, window=2, keep_prompt=keep_prompt)
    params = SamplingParams(temperature=0.0, max_new_tokens=30)
    together = engine.generate(PROMPTS, params, kv)
    for prompt, out in zip(PROMPTS, together, strict=True):
        alone = engine.generate([prompt], params, kv)[0]
        assert out.token_ids == alone.token_ids
        assert out.kv.evicted == alone.kv.evicted and out.kv.peak_tokens == alone.kv.peak_tokens
        assert torch.allclose(torch.tensor(out.logprobs), torch.tensor(alone.logprobs), atol=1e-4)
