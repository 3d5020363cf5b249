"""Softmax attention weights of grouped-query attention, for policies that score by attention."""

from __future__ import annotations

import math

import torch


def grouped_probs(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Softmax attention of q [B, Hq, T, D] over keys [B, Hkv, S, D] -> fp32 [B, Hkv, G, T, S].

    Query head h reads KV head h // G (G = Hq / Hkv), as transformers' repeat_kv does; `mask`
    broadcasts to [B, Hkv, G, T, S] and marks the keys each query may see.
    """
    b, hq, t, d = q.shape
    hkv, s = keys.shape[1], keys.shape[2]
    g = hq // hkv
    # The G query heads of a KV head are G·T rows of one product with that head's keys: a
    # broadcast over a G axis instead made matmul copy the transposed keys G times (2 ms a layer
    # at 0.6B, batch 112, on an H100).
    qg = q.reshape(b, hkv, g * t, d)
    scores = torch.matmul(qg, keys.transpose(-1, -2)).view(b, hkv, g, t, s) * (1.0 / math.sqrt(d))
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1, dtype=torch.float32)
