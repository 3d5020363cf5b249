"""The Triton kernels of the CUDA decode path equal their torch references."""

from __future__ import annotations

import pytest
import torch

from services.rollout.engine import kernels
from services.rollout.engine.policies import key_redundancy, key_redundancy_fused


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
@pytest.mark.parametrize("threshold", [0.5, 0.1, -0.2])
def test_fused_key_redundancy_equals_the_reference(dtype: torch.dtype, threshold: float) -> None:
    torch.manual_seed(1)
    b, h, s, d = 3, 4, 300, 128
    keys = torch.randn(b, h, s, d, device="cuda").to(dtype)
    keys[:, :, 200] = keys[:, :, 17] * 2  # exact and near duplicates, latest one wins
    keys[:, :, 250] = keys[:, :, 17] + 0.01
    keys[1, 2, 90] = keys[1, 2, 5]
    lengths = torch.tensor([300, 211, 64], device="cuda")
    valid = torch.arange(s, device="cuda")[None] < lengths[:, None]
    latest, value = kernels.key_redundancy_stats(keys, lengths, threshold)
    if threshold == 0.5:
        assert int(latest[0, 0, 17]) == 250 and int(latest[1, 2, 5]) == 90
    torch.testing.assert_close(
        key_redundancy_fused(keys, valid, threshold),
        key_redundancy(keys, valid, threshold),
        atol=1e-6,
        rtol=1e-4,
    )
