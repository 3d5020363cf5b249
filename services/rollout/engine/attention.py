"""Attention over the KV cache: what the model's layers call, apart from the cache's storage.

As nano-vllm keeps `layers/attention.py` apart from its block manager, the cache
(kv_cache.KVCache) only stores keys, values, positions and what policies score by, and evicts;
`CacheAttention` writes each layer's new keys and values into it and attends over the slots in
use. Prefill runs torch SDPA over the padded prompts with one causal + padding mask. Decode
runs torch SDPA (each KV head's query heads batched as its queries, no K/V repeat), or, for
H2O, grouped-query matmuls whose softmax weights it accumulates in the cache. When every row
stores the same number of tokens (equal prompts: a GRPO group, a benchmark) no mask is needed
and SDPA can take its fastest (flash) kernel; otherwise one additive mask per step, over a span
rounded up to the cache's `span_bucket` slots on CUDA so attention sees few distinct shapes
(kernels that plan or allocate per shape do it a handful of times per batch, not every step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.rollout.engine.attention_weights import grouped_probs
from services.rollout.engine.kv_cache import KVCache


@dataclass
class _DecodePlan:
    """How one decode step writes and attends in the layers whose rows store these lengths."""

    slot: int | None  # the slot every row writes (rows in lockstep), else per-row slots
    slots: torch.Tensor  # [B] per-row slots (the lengths)
    span: int  # slots attention reads
    mask: torch.Tensor | None  # [B, 1, 1, S] bool, when rows differ or H2O needs the weights
    bias: torch.Tensor | None  # the mask as an additive bias, for SDPA


class CacheAttention:
    """The prefill and decode AttendFns of one generation batch over `cache`."""

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        self._prefill_mask = torch.empty(0, dtype=torch.bool)
        self._prefill_lengths = torch.empty(0, dtype=torch.long)
        self._rows = torch.empty(0)
        self._plans: list[_DecodePlan] = []

    # ------------------------------------------------------------------ prefill
    def begin_prefill(self, width: int) -> None:
        c = self.cache
        lengths = torch.tensor(c.prompt_lengths, device=c.device)
        slots = torch.arange(width, device=c.device)
        key_ok = slots[None, :] < lengths[:, None]
        causal = slots[None, :] <= slots[:, None]
        self._prefill_mask = (causal[None] & key_ok[:, None, :]).unsqueeze(1)  # [B, 1, T, T]
        c.positions[:, :, :, :width] = slots.to(torch.int32)
        self._prefill_lengths = lengths
        c.set_layer_lengths([list(c.prompt_lengths)] * c.num_layers)

    def prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """AttendFn for the padded prompt batch: q [B, Hq, T, D], k/v [B, Hkv, T, D]."""
        c = self.cache
        width = q.shape[2]
        c.k[layer][:, :, :width] = k
        c.v[layer][:, :, :width] = v
        if c.q_window is not None:
            w = c.kv.window
            idx = (self._prefill_lengths[:, None] - w + torch.arange(w, device=c.device)).clamp(min=0)
            c.q_window[layer] = q.gather(2, idx[:, None, :, None].expand(-1, q.shape[1], -1, q.shape[3]))
        if c.attn_acc is not None and not c.kv.keep_prompt:
            # H2O over a compressible prompt: attention each prompt key received from the prompt.
            probs = grouped_probs(q, k, self._prefill_mask[:, :, None])  # [B, Hkv, G, T, T]
            query_ok = self._prefill_mask[:, 0].diagonal(dim1=-2, dim2=-1)  # [B, T]: t < prompt length
            rows_ok = query_ok[:, None, None, :, None]  # padded queries add nothing
            c.attn_acc[layer, :, :, :width] = (probs * rows_ok).sum(dim=3).mean(dim=2)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self._prefill_mask, enable_gqa=True)

    # ------------------------------------------------------------------ decode
    def begin_decode(self, positions: torch.Tensor) -> None:
        """Prepare one decode step; positions [B] are the logical positions of the new tokens."""
        c = self.cache
        self._rows = torch.arange(c.batch, device=c.device)
        plans: dict[tuple[int, ...], _DecodePlan] = {}  # layers storing the same lengths share one
        self._plans = []
        for layer in range(c.num_layers):
            lengths = c.layer_lengths(layer)
            key = (c.capacities[layer], *lengths)
            if key not in plans:
                plans[key] = self._plan(lengths, c.lengths_t[layer], c.capacities[layer])
            self._plans.append(plans[key])
        layers, batch, heads, _ = c.positions.shape
        shape = (layers, batch, heads, 1)
        c.positions.scatter_(3, c.lengths_t[:, :, None, None].expand(shape),
                             positions.to(torch.int32).view(1, batch, 1, 1).expand(shape))

    def _plan(self, lengths: list[int], slots: torch.Tensor, capacity: int) -> _DecodePlan:
        c = self.cache
        longest, shortest = max(lengths), min(lengths)
        # Rows in lockstep write the same slot: plain slicing instead of an index_put per layer.
        slot = longest if longest == shortest else None
        if slot is not None and c.attn_acc is None:
            return _DecodePlan(slot, slots, longest + 1, None, None)
        bucket = c.span_bucket
        span = min(capacity, -(-(longest + 1) // bucket) * bucket)
        arange = torch.arange(span, device=c.device)
        mask = (arange[None, :] <= slots[:, None])[:, None, None, :]  # [B, 1, 1, S]
        # SDPA would turn a bool mask into this additive one in every layer; do it once per step.
        bias = (torch.zeros(mask.shape, dtype=c.k[0].dtype, device=c.device)
                .masked_fill_(~mask, float("-inf")) if c.attn_acc is None else None)
        return _DecodePlan(slot, slots, span, mask, bias)

    def decode(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """AttendFn for one new token per row: q [B, Hq, 1, D], k/v [B, Hkv, 1, D]."""
        c, plan = self.cache, self._plans[layer]
        b = q.shape[0]
        k_cache, v_cache = c.k[layer], c.v[layer]
        if plan.slot is not None:
            k_cache[:, :, plan.slot] = k[:, :, 0]
            v_cache[:, :, plan.slot] = v[:, :, 0]
        else:
            k_cache[self._rows, :, plan.slots] = k[:, :, 0]
            v_cache[self._rows, :, plan.slots] = v[:, :, 0]
        if c.q_window is not None:
            c.q_window[layer, :, :, c.q_next] = q[:, :, 0]
        keys = k_cache[:, :, : plan.span]
        values = v_cache[:, :, : plan.span]
        if c.attn_acc is None:
            # Fused kernel when no policy needs the weights. The G query heads of a KV head act as G
            # queries of that head, so no GQA support or K/V repeat is needed from the kernel.
            qg = q.view(b, c.num_kv_heads, c.group, c.head_dim)
            out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=plan.bias)
            # reshape, not view: CUDA's memory-efficient kernel returns [B, Hkv, G, D] with the G
            # queries outermost in memory (fp32 on an H200), which no view can merge into Hq.
            return out.reshape(b, c.num_heads, 1, c.head_dim)
        assert plan.mask is not None  # _plan makes one whenever attention is accumulated
        probs = grouped_probs(q, keys, plan.mask[:, :, None])  # [B, Hkv, G, 1, S]
        c.attn_acc[layer, :, :, : plan.span] += probs[:, :, :, 0].mean(dim=2)
        out = torch.matmul(probs.to(values.dtype), values[:, :, None])  # [B, Hkv, G, 1, D]
        return out.view(b, c.num_heads, 1, c.head_dim)

    def end_decode(self) -> None:
        self.cache.advance()
