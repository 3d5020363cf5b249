"""The Triton kernels of the CUDA decode path equal their torch references."""

from __future__ import annotations

import pytest
import torch

from services.rollout.engine import KVConfig, SamplingParams, kernels
from services.rollout.engine.kv_cache import KVCache, layer_capacities
from services.rollout.engine.policies import key_redundancy, layer_scores, window_attention
from services.rollout.engine.sampler import sample_torch


@pytest.mark.gpu
@pytest.mark.skipif(not kernels.available(), reason="needs CUDA and Triton")
def test_decode_attention_equals_sdpa_in_bf16() -> None:
    torch.manual_seed(0)
    b, hq, hkv, cap, d = 5, 16, 8, 1300, 128
    k_cache = torch.randn(b + 3, hkv, cap, d, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16)
    lengths = torch.tensor([0, 1, 255, 256, 1299], device="cuda")
    out = kernels.decode_attention(q, k_cache, v_cache, lengths, d ** -0.5,
                                   kernels.attention_buffers(b, hq, cap, d, torch.device("cuda")))
    for r in range(b):
        n = int(lengths[r]) + 1
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[r:r + 1], k_cache[r:r + 1, :, :n], v_cache[r:r + 1, :, :n], enable_gqa=True)
        torch.testing.assert_close(out[r], ref[0], atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not kernels.available(), reason="needs CUDA and Triton")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("threshold", [0.5, 0.1, 0.0])
def test_redundancy_terms_equal_the_similarity_matrix(dtype: torch.dtype, threshold: float) -> None:
    torch.manual_seed(1)
    b, h, s, d = 3, 4, 300, 128
    keys = torch.randn(b, h, s, d, device="cuda").to(dtype)
    keys[:, :, 200] = keys[:, :, 17] * 2  # exact and near duplicates, latest one wins
    keys[:, :, 250] = keys[:, :, 17] + 0.01
    keys[1, 2, 90] = keys[1, 2, 5]
    keys[0, 1, 7] = 0  # a zero key: unit key 0, as in the reference
    lengths = torch.tensor([300, 211, 64], device="cuda")
    queries = torch.randn(b, 2 * h, 8, d, device="cuda").to(dtype)
    scores = kernels.key_scores(keys, lengths, queries, 0, threshold)
    assert scores.column is not None and scores.latest is not None and scores.value is not None
    valid = torch.arange(s, device="cuda")[None] < lengths[:, None]
    k = keys.float()
    unit = (k / (k.norm(dim=-1, keepdim=True) + 1e-8)).masked_fill(~valid[:, None, :, None], 0.0)
    sim = unit @ unit.transpose(-1, -2)
    sim.diagonal(dim1=-2, dim2=-1).zero_()
    stored = valid[:, None].expand(-1, h, -1)
    torch.testing.assert_close(scores.column[stored], sim.sum(dim=-2)[stored], atol=2e-4, rtol=1e-4)
    if threshold == 0.5:  # far from the threshold: the same pairs as the fp32 reference
        latest = scores.latest
        assert int(latest[0, 0, 17]) == 250 and int(latest[1, 2, 5]) == 90 and int(latest[0, 0, 250]) == 200
        slot = torch.arange(s, device="cuda", dtype=torch.float32)
        want = torch.where(sim > threshold, slot, -1.0).amax(-1)
        assert torch.equal(latest[stored].long(), want[stored].long())
        hit = stored & (latest >= 0)
        cosine = sim.gather(-1, latest.clamp(min=0).long()[..., None])[..., 0]
        torch.testing.assert_close(scores.value[hit], cosine[hit], atol=1e-3, rtol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not kernels.available(), reason="needs CUDA and Triton")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("threshold", [None, 0.5, 0.1])
def test_cuda_layer_scores_equal_the_torch_policies(dtype: torch.dtype, threshold: float | None) -> None:
    # Window attention (SnapKV, R-KV) and R-KV's redundancy of a cache whose rows store different
    # lengths, one shorter than the query window, with the query ring part-way round.
    cache = _full_cuda_cache("rkv", True, dtype)
    lengths = [p + 300 + 64 for p in (16, 9, 16)] + [5]
    cache.set_layer_lengths([lengths] * 2)
    cache.q_next = 3
    cache.k[0][1, 1, 40] = cache.k[0][1, 1, 200]
    span = max(lengths)
    valid = torch.arange(span, device="cuda")[None] < torch.tensor(lengths, device="cuda")[:, None]
    importance, redundancy = layer_scores(cache, 0, span, valid, threshold)
    stored = valid[:, None].expand(-1, 2, -1)
    want = window_attention(cache, 0, span)
    torch.testing.assert_close(importance[stored], want[stored], atol=1e-6, rtol=1e-4)
    if threshold is None:
        assert redundancy is None
    else:
        assert redundancy is not None
        torch.testing.assert_close(redundancy, key_redundancy(cache.k[0][:, :, :span], valid, threshold),
                                   atol=1e-6, rtol=1e-4)


def _full_cuda_cache(policy: str, in_place: bool, dtype: torch.dtype = torch.bfloat16) -> KVCache:
    """Two layers whose rows (prompts of unequal length) hold prompt + budget + buffer random keys."""
    kv = KVConfig(policy=policy, budget=300, buffer=64)
    prompts = [16, 9, 16, 3]
    capacities = layer_capacities(prompts, 2000, kv, 2)
    cache = KVCache(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=128, prompt_lengths=prompts,
                    capacity=capacities, kv=kv, dtype=dtype, device=torch.device("cuda"))
    cache._compact_in_place = in_place
    gen = torch.Generator(device="cuda").manual_seed(0)
    for buf in (*cache.k, *cache.v) + ((cache.q_window,) if cache.q_window is not None else ()):
        buf.copy_(torch.randn(buf.shape, generator=gen, device="cuda"))
    cache.k[0][1, 1, 40] = cache.k[0][1, 1, 200]  # a near-duplicate pair for R-KV
    slots = torch.arange(cache.capacity, dtype=torch.int32, device="cuda")
    cache.positions.copy_(slots.expand_as(cache.positions))
    cache.set_layer_lengths([[p + 300 + 64 for p in prompts]] * 2)
    return cache


@pytest.mark.gpu
@pytest.mark.skipif(not kernels.available(), reason="needs CUDA and Triton")
@pytest.mark.parametrize("policy", ["rkv", "snapkv", "streaming"])
def test_in_place_compaction_equals_the_gather(policy: str) -> None:
    # kernels.compact_ (CUDA's compression) against the torch gather of the same kept slots.
    got, want = _full_cuda_cache(policy, True), _full_cuda_cache(policy, False)
    assert got.compress() == want.compress() == [64] * 4
    for layer in range(2):
        for row, n in enumerate(want.layer_lengths(layer)):
            assert got.layer_lengths(layer)[row] == n
            assert torch.equal(got.k[layer][row, :, :n], want.k[layer][row, :, :n])
            assert torch.equal(got.v[layer][row, :, :n], want.v[layer][row, :, :n])
            assert torch.equal(got.positions[layer, row, :, :n], want.positions[layer, row, :, :n])
    # The kept positions are in order, and differ between the heads (per-head eviction).
    kept = got.positions[0, 0, :, : got.layer_lengths(0)[0]]
    assert bool((kept[:, 1:] > kept[:, :-1]).all())
    assert policy == "streaming" or not torch.equal(kept[0], kept[1])


@pytest.mark.gpu
@pytest.mark.skipif(not kernels.available(), reason="needs CUDA and Triton")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_greedy_equals_argmax_and_log_softmax(dtype: torch.dtype) -> None:
    torch.manual_seed(2)
    logits = (3 * torch.randn(7, 151_936, device="cuda")).to(dtype)
    logits[1, 151_935] = 40.0  # the last slot of a partial tile
    logits[2, 17] = logits[2, 90_000] = 40.0  # a tie: the first index, as torch.argmax
    tokens, logprobs = kernels.greedy(logits)
    want = logits.float().argmax(dim=-1)
    assert torch.equal(tokens, want) and int(tokens[1]) == 151_935 and int(tokens[2]) == 17
    reference = torch.log_softmax(logits.float(), dim=-1).gather(-1, want[:, None])[:, 0]
    torch.testing.assert_close(logprobs, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not kernels.available(), reason="needs CUDA and Triton")
@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.5])
def test_sample_draws_the_inverse_cdf_token(temperature: float) -> None:
    # Each draw is the token whose CDF interval (float64) holds u · total, up to fp32 rounding at the
    # boundaries, with log_softmax(logits / T) at that token; and mostly the same token as sample_torch.
    torch.manual_seed(3)
    rows = 64
    logits = (2 * torch.randn(rows, 151_936, device="cuda")).to(torch.bfloat16)
    logits[0, 100_000:] = -1e4  # mass only in a prefix
    logits[1, :-1] = -1e4  # all mass on the last slot
    uniforms = torch.rand(rows, device="cuda")
    uniforms[2], uniforms[3] = 0.0, 1.0 - 2**-24
    tokens, logprobs = kernels.sample(logits, uniforms, temperature)
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    cdf = probs.cumsum(dim=-1)
    target = uniforms.double() * cdf[:, -1]
    below = torch.where(tokens > 0, cdf.gather(-1, (tokens - 1).clamp(min=0)[:, None])[:, 0], 0.0)
    upto = cdf.gather(-1, tokens[:, None])[:, 0]
    assert bool(((below - 1e-5 <= target) & (target < upto + 1e-5)).all())
    assert bool((probs.gather(-1, tokens[:, None])[:, 0] > 0).all()) and int(tokens[1]) == 151_935
    reference = torch.log_softmax(logits.float() / temperature, dim=-1).gather(-1, tokens[:, None])[:, 0]
    torch.testing.assert_close(logprobs, reference, atol=1e-5, rtol=1e-5)
    want, _ = sample_torch(logits, SamplingParams(temperature=temperature, max_new_tokens=1), uniforms)
    assert float((tokens == want).float().mean()) >= 0.9


@pytest.mark.gpu
@pytest.mark.skipif(not kernels.available(), reason="needs CUDA and Triton")
def test_a_nan_row_samples_inside_the_vocabulary_with_a_nan_logprob() -> None:
    # A diverged model must not make the sampling kernels read out of bounds (an illegal address
    # would take the worker's CUDA context with it); the NaN log-prob tells the trainer.
    logits = torch.randn(3, 151_936, device="cuda").to(torch.bfloat16)
    logits[1, 7] = float("nan")
    uniforms = torch.rand(3, device="cuda")
    for tokens, logprobs in (kernels.sample(logits, uniforms, 1.0), kernels.greedy(logits)):
        torch.cuda.synchronize()
        assert bool(((tokens >= 0) & (tokens < 151_936)).all())
        assert bool(logprobs[1].isnan()) and bool(logprobs[[0, 2]].isfinite().all())
