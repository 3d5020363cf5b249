"""Token sampling and the recorded log-prob.

Recorded log-prob (docs/internals.md, the quantity the trainer divides by): for each sampled
token, `log_softmax(logits / T)[token]` in fp32 over the full vocabulary, before top-k/top-p
filtering; T = 0 (greedy) records `log_softmax(logits)[token]`.

Sampling is inverse-CDF with one uniform per sequence and step, drawn by the caller from a
seeded torch.Generator: a sequence's draws depend only on the seed, its index in the request and
the step, so the same request with the same seed gives the same tokens.
"""

from __future__ import annotations

import torch

import services.rollout.engine.kernels as kernels
from services.rollout.engine.config import SamplingParams


def sample(
    logits: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] (any dtype), uniforms [B] in [0, 1) -> (tokens [B] int64, logprobs [B] fp32).
    On CUDA, greedy and unfiltered sampling read the logits in one Triton kernel (kernels.greedy,
    kernels.sample) instead of ~10 passes over an fp32 copy; the rest is `sample_torch`."""
    if logits.is_cuda and kernels.available():
        if params.temperature == 0.0:
            return kernels.greedy(logits)
        if params.top_k == 0 and params.top_p == 1.0:
            return kernels.sample(logits, uniforms, params.temperature)
    return sample_torch(logits, params, uniforms)


def sample_torch(
    logits: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample` in torch ops, on any device (the reference the CUDA kernels are tested against)."""
    logits = logits.float()
    if params.temperature == 0.0:
        logprobs = torch.log_softmax(logits, dim=-1)
        tokens = logits.argmax(dim=-1)
    else:
        logprobs = torch.log_softmax(logits / params.temperature, dim=-1)
        probs = filtered_probs(logprobs, params.top_k, params.top_p)
        cdf = probs.cumsum(dim=-1)
        target = (uniforms[:, None] * cdf[:, -1:]).contiguous()
        tokens = torch.searchsorted(cdf, target, right=True)[:, 0].clamp(max=logits.shape[-1] - 1)
    return tokens, logprobs.gather(-1, tokens[:, None])[:, 0]


def filtered_probs(logprobs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Probabilities after top-k then top-p (nucleus) filtering, unnormalised (sampling scales by the sum)."""
    vocab = logprobs.shape[-1]
    if 0 < top_k < vocab:
        kth = logprobs.topk(top_k, dim=-1).values[:, -1:]
        logprobs = logprobs.masked_fill(logprobs < kth, float("-inf"))
    if top_p < 1.0:
        sorted_lp, order = logprobs.sort(dim=-1, descending=True)
        sorted_p = torch.softmax(sorted_lp, dim=-1)
        # Drop a token when the mass before it already reaches top_p (the top token always stays).
        drop = (sorted_p.cumsum(dim=-1) - sorted_p) >= top_p
        sorted_lp = sorted_lp.masked_fill(drop, float("-inf"))
        logprobs = torch.full_like(logprobs, float("-inf")).scatter(-1, order, sorted_lp)
    return torch.exp(logprobs)
