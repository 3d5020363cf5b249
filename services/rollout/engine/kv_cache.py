"""Preallocated, compactable KV cache of one generation batch.

Layout (docs/engine.md): keys and values are `[layers, batch, kv_heads, capacity, head_dim]`.
Keys are stored after RoPE at their logical positions, so evicting a token never shifts another
token's position. Each sequence (row) stores `lengths[row]` tokens in slots `[0, lengths[row])`,
in chronological order; every layer and every KV head of a row stores the same number of tokens,
but per-head policies keep different tokens in each head. Compression gathers the kept slots of
each (row, head) to the front, one layer at a time, so the extra memory it needs is one layer's
worth and the batch's KV memory never depends on the generated length.

Decode attention runs over the slots in use: torch SDPA (each KV head's query heads batched as its
queries, no K/V repeat), or, for H2O, grouped-query matmuls whose softmax weights it accumulates.
When every row stores the same number of tokens (equal prompts: a GRPO group, a benchmark) no mask
is needed and SDPA can take its fastest (flash) kernel; otherwise one additive mask per step, over
a span rounded up to `span_bucket` slots on CUDA so attention sees few distinct shapes (kernels
that plan or allocate per shape do it a handful of times per batch, not every step).

A `static` cache (CUDA graphs, cuda_graphs.py) never reallocates: rows that leave the batch are
compacted in place and the tensors above become views of the first live rows; its decode step
(fused_decode.py) reads lengths from the device, so one captured graph serves every step. Compression runs outside the graph, in place, as in the eager cache.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from services.rollout.engine import kernels
from services.rollout.engine.config import KVConfig
from services.rollout.engine.policies import EvictionPolicy, make_policy


class KVCache:
    def __init__(self, *, num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 prompt_lengths: list[int], capacity: int, kv: KVConfig, dtype: torch.dtype,
                 device: torch.device, span_bucket: int | None = None, static: bool = False) -> None:
        batch = len(prompt_lengths)
        self.kv = kv
        self.policy: EvictionPolicy = make_policy(kv)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        self.scale = 1.0 / math.sqrt(head_dim)
        self.capacity = capacity
        self.device = device
        self.span_bucket = span_bucket or (128 if device.type == "cuda" else 1)
        shape = (num_layers, batch, num_kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # Logical position of each stored token (what streaming ranks by, what tests inspect).
        self.positions = torch.zeros(shape[:-1], dtype=torch.int32, device=device)
        self.q_window = (torch.zeros((num_layers, batch, num_heads, kv.window, head_dim), dtype=dtype,
                                     device=device) if self.policy.uses_query_window else None)
        # q_window is a ring: the next decode query overwrites slot q_next (the oldest); prefill
        # fills it oldest first, so it starts at 0. window_queries() returns it oldest first.
        self.q_next = 0
        self.attn_acc = (torch.zeros(shape[:-1], dtype=torch.float32, device=device)
                         if self.policy.uses_accumulated_attention else None)
        self.prompt_lengths = list(prompt_lengths)
        # Host-side bookkeeping: rows advance in lockstep, so no device sync is needed to know them.
        self.lengths = [0] * batch
        self.protected = list(prompt_lengths) if kv.keep_prompt else [0] * batch
        self.lengths_t = torch.zeros(batch, dtype=torch.long, device=device)
        self.static = static
        if static:
            # The whole allocation (graphs address it), and the ring's next slot on the device.
            self._full = {"k": self.k, "v": self.v, "positions": self.positions, "q_window": self.q_window}
            self._lengths_full = self.lengths_t
            self.q_next_t = torch.zeros(1, dtype=torch.long, device=device)
            self.attn_buffers = kernels.attention_buffers(batch, num_heads, capacity, head_dim, device)

    # ------------------------------------------------------------------ sizes
    @property
    def batch(self) -> int:
        return len(self.lengths)

    @property
    def bytes_per_token(self) -> int:
        """K + V bytes of one token over all layers and KV heads."""
        layers, _, heads, _, dim = self.k.shape
        return 2 * layers * heads * dim * self.k.element_size()

    @property
    def nbytes(self) -> int:
        """Bytes allocated for K and V (the batch's KV memory)."""
        return 2 * self.k.numel() * self.k.element_size()

    # ------------------------------------------------------------------ prefill
    def begin_prefill(self, width: int) -> None:
        lengths = torch.tensor(self.prompt_lengths, device=self.device)
        slots = torch.arange(width, device=self.device)
        key_ok = slots[None, :] < lengths[:, None]
        causal = slots[None, :] <= slots[:, None]
        self._prefill_mask = (causal[None] & key_ok[:, None, :]).unsqueeze(1)  # [B, 1, T, T]
        self.positions[:, :, :, :width] = slots.to(torch.int32)
        self._prefill_lengths = lengths
        self.lengths = list(self.prompt_lengths)
        self._set_lengths_t(lengths)

    def prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """AttendFn for the padded prompt batch: q [B, Hq, T, D], k/v [B, Hkv, T, D]."""
        width = q.shape[2]
        self.k[layer, :, :, :width] = k
        self.v[layer, :, :, :width] = v
        if self.q_window is not None:
            w = self.kv.window
            idx = (self._prefill_lengths[:, None] - w + torch.arange(w, device=self.device)).clamp(min=0)
            self.q_window[layer] = q.gather(2, idx[:, None, :, None].expand(-1, q.shape[1], -1, q.shape[3]))
        if self.attn_acc is not None and not self.kv.keep_prompt:
            # H2O over a compressible prompt: attention each prompt key received from the prompt.
            probs = self.grouped_probs(q, k, self._prefill_mask[:, :, None])  # [B, Hkv, G, T, T]
            query_ok = self._prefill_mask[:, 0].diagonal(dim1=-2, dim2=-1)  # [B, T]: t < prompt length
            rows_ok = query_ok[:, None, None, :, None]  # padded queries add nothing
            self.attn_acc[layer, :, :, :width] = (probs * rows_ok).sum(dim=3).mean(dim=2)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self._prefill_mask, enable_gqa=True)

    # ------------------------------------------------------------------ decode
    def begin_decode(self, positions: torch.Tensor) -> None:
        """Prepare one decode step; positions [B] are the logical positions of the new tokens."""
        longest, shortest = max(self.lengths), min(self.lengths)
        # Rows in lockstep write the same slot: plain slicing instead of an index_put per layer.
        self._slot: int | None = longest if longest == shortest else None
        self._rows = torch.arange(self.batch, device=self.device)
        self._slots = self.lengths_t
        if self._slot is not None and self.attn_acc is None:
            self._span, self._decode_mask, self._bias = longest + 1, None, None
        else:
            bucket = self.span_bucket
            self._span = min(self.capacity, -(-(longest + 1) // bucket) * bucket)
            slot = torch.arange(self._span, device=self.device)
            self._decode_mask = (slot[None, :] <= self._slots[:, None])[:, None, None, :]  # [B, 1, 1, S]
            # SDPA would turn a bool mask into this additive one in every layer; do it once per step.
            self._bias = (torch.zeros(self._decode_mask.shape, dtype=self.k.dtype, device=self.device)
                          .masked_fill_(~self._decode_mask, float("-inf")) if self.attn_acc is None else None)
        if self._slot is not None:
            self.positions[:, :, :, self._slot] = positions.to(torch.int32)[None, :, None]
        else:
            self.positions[:, self._rows, :, self._slots] = positions.to(torch.int32)[:, None, None]

    def decode(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """AttendFn for one new token per row: q [B, Hq, 1, D], k/v [B, Hkv, 1, D]."""
        b = q.shape[0]
        if self._slot is not None:
            self.k[layer, :, :, self._slot] = k[:, :, 0]
            self.v[layer, :, :, self._slot] = v[:, :, 0]
        else:
            self.k[layer, self._rows, :, self._slots] = k[:, :, 0]
            self.v[layer, self._rows, :, self._slots] = v[:, :, 0]
        if self.q_window is not None:
            self.q_window[layer, :, :, self.q_next] = q[:, :, 0]
        keys = self.k[layer, :, :, : self._span]
        values = self.v[layer, :, :, : self._span]
        if self.attn_acc is None:
            # Fused kernel when no policy needs the weights. The G query heads of a KV head act as G
            # queries of that head, so no GQA support or K/V repeat is needed from the kernel.
            qg = q.view(b, self.num_kv_heads, self.group, self.head_dim)
            out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=self._bias)
            # reshape, not view: CUDA's memory-efficient kernel returns [B, Hkv, G, D] with the G
            # queries outermost in memory (fp32 on an H200), which no view can merge into Hq.
            return out.reshape(b, self.num_heads, 1, self.head_dim)
        probs = self.grouped_probs(q, keys, self._decode_mask[:, :, None])  # [B, Hkv, G, 1, S]
        self.attn_acc[layer, :, :, : self._span] += probs[:, :, :, 0].mean(dim=2)
        out = torch.matmul(probs.to(values.dtype), values[:, :, None])  # [B, Hkv, G, 1, D]
        return out.view(b, self.num_heads, 1, self.head_dim)

    # ------------------------------------------------------------------ static decode (CUDA graphs)
    def record_positions(self, positions: torch.Tensor) -> None:
        """Graph-safe begin_decode: positions [b] of the new tokens at slot lengths[row], rows [0, b)."""
        b = positions.shape[0]
        full = self._full["positions"]
        slot = self._lengths_full[:b].clamp(max=self.capacity - 1)
        shape = (full.shape[0], b, full.shape[2], 1)
        full[:, :b].scatter_(3, slot.view(1, b, 1, 1).expand(shape),
                             positions.to(torch.int32).view(1, b, 1, 1).expand(shape))

    def static_lengths(self, b: int) -> torch.Tensor:
        """Stored tokens of rows [0, b) of the allocation (b = graph bucket), on the device."""
        return self._lengths_full[:b]

    def static_layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(K, V, query ring or None) of one layer over the whole allocation, for fused_decode."""
        q_window = self._full["q_window"]
        return self._full["k"][layer], self._full["v"][layer], None if q_window is None else q_window[layer]

    def advance_static(self, b: int) -> None:
        """Graph-safe end of a decode step on the device (the host side: end_decode_host)."""
        self._lengths_full[:b] += 1
        if self.q_window is not None:
            self.q_next_t.add_(1).remainder_(self.kv.window)

    def device_state(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What advance_static changes (for a graph's warm-up step to be undone)."""
        return self._lengths_full.clone(), self.q_next_t.clone()

    def restore_device_state(self, state: tuple[torch.Tensor, torch.Tensor]) -> None:
        self._lengths_full.copy_(state[0])
        self.q_next_t.copy_(state[1])

    def end_decode_host(self) -> None:
        self.lengths = [n + 1 for n in self.lengths]
        if self.q_window is not None:
            self.q_next = (self.q_next + 1) % self.kv.window

    def _set_lengths_t(self, lengths: torch.Tensor) -> None:
        if self.static:
            self.lengths_t.copy_(lengths)
        else:
            self.lengths_t = lengths.clone()

    def end_decode(self) -> None:
        self.lengths = [n + 1 for n in self.lengths]
        self.lengths_t = self.lengths_t + 1
        if self.q_window is not None:
            self.q_next = (self.q_next + 1) % self.kv.window

    def window_queries(self, layer: int) -> torch.Tensor:
        """The last `window` queries of a layer, oldest first: [B, Hq, W, D]."""
        assert self.q_window is not None
        return self.q_window[layer].roll(-self.q_next, dims=2) if self.q_next else self.q_window[layer]

    def grouped_probs(self, q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Softmax attention of q [B, Hq, T, D] over keys [B, Hkv, S, D] -> fp32 [B, Hkv, G, T, S].

        Query head h reads KV head h // group, as transformers' repeat_kv does.
        """
        b, _, t, d = q.shape
        qg = q.view(b, self.num_kv_heads, self.group, t, d)
        scores = torch.matmul(qg, keys[:, :, None].transpose(-1, -2)) * self.scale
        scores = scores.masked_fill(~mask, float("-inf"))
        return torch.softmax(scores, dim=-1, dtype=torch.float32)

    # ------------------------------------------------------------------ eviction
    def needs_compression(self) -> bool:
        """True once some row holds budget + buffer evictable tokens (its buffer is full)."""
        if self.policy.name == "dense":
            return False
        limit = self.kv.budget + self.kv.buffer
        return any(n - p >= limit for n, p in zip(self.lengths, self.protected, strict=True))

    def compress(self) -> list[int]:
        """Evict down to protected + budget tokens per row; returns tokens evicted per row (per head)."""
        keep = [min(n, p + self.kv.budget) for n, p in zip(self.lengths, self.protected, strict=True)]
        evicted = [n - k for n, k in zip(self.lengths, keep, strict=True)]
        if not any(evicted):
            return evicted
        span = max(self.lengths)
        dev = self.device
        slot = torch.arange(span, device=dev)
        lengths = torch.tensor(self.lengths, device=dev)[:, None]
        protected = torch.tensor(self.protected, device=dev)[:, None]
        valid = slot[None] < lengths  # [B, S]
        forced = (slot[None] < protected) | (slot[None] >= lengths - self.kv.window)
        rank_ok = (slot[None] < torch.tensor(keep, device=dev)[:, None])[:, None]  # [B, 1, S]
        for layer in range(self.k.shape[0]):
            score = self.policy.score(self, layer, span, valid).float()
            score = score.expand(-1, self.num_kv_heads, -1)
            score = score.masked_fill(forced[:, None], float("inf")).masked_fill(~valid[:, None], float("-inf"))
            order = score.argsort(dim=-1, descending=True, stable=True)
            kept = torch.zeros_like(score, dtype=torch.bool).scatter_(-1, order, rank_ok.expand_as(score))
            # Kept slots first, in their original (chronological) order.
            perm = torch.where(kept, slot, slot + span).argsort(dim=-1)
            self._gather_(layer, perm, span)
            if self.attn_acc is not None:
                # The evicted tokens' sums now sit in the free slots: a token written there later
                # must start from zero, not inherit them.
                self.attn_acc[layer, :, :, :span].masked_fill_(~rank_ok, 0.0)
        self.lengths = keep
        self._set_lengths_t(torch.tensor(keep, device=dev))
        return evicted

    def _gather_(self, layer: int, perm: torch.Tensor, span: int) -> None:
        idx = perm[..., None].expand(-1, -1, -1, self.head_dim)
        for buf in (self.k, self.v):
            buf[layer, :, :, :span] = buf[layer, :, :, :span].gather(2, idx)
        self.positions[layer, :, :, :span] = self.positions[layer, :, :, :span].gather(2, perm)
        if self.attn_acc is not None:
            self.attn_acc[layer, :, :, :span] = self.attn_acc[layer, :, :, :span].gather(2, perm)

    # ------------------------------------------------------------------ batch
    def select_rows(self, rows: list[int]) -> None:
        """Keep only these rows (finished sequences leave the batch)."""
        if self.static:
            return self._compact_rows(rows)
        index = torch.tensor(rows, device=self.device)
        self.k = self.k.index_select(1, index)
        self.v = self.v.index_select(1, index)
        self.positions = self.positions.index_select(1, index)
        if self.q_window is not None:
            self.q_window = self.q_window.index_select(1, index)
        if self.attn_acc is not None:
            self.attn_acc = self.attn_acc.index_select(1, index)
        self.lengths = [self.lengths[r] for r in rows]
        self.protected = [self.protected[r] for r in rows]
        self.prompt_lengths = [self.prompt_lengths[r] for r in rows]
        self.lengths_t = self.lengths_t.index_select(0, index)

    def _compact_rows(self, rows: list[int]) -> None:
        """select_rows of a static cache: live rows move to the front of the allocation, in place
        (row by row, in increasing order: a row is only ever copied to a lower one already moved)."""
        for new, old in enumerate(rows):
            if new != old:
                for buf in self._full.values():
                    if buf is not None:
                        buf[:, new].copy_(buf[:, old])
        n = len(rows)
        lengths = self._lengths_full
        lengths[:n] = lengths.index_select(0, torch.tensor(rows, device=self.device))
        lengths[n:] = 0  # rows past the live batch in a padded graph bucket start over
        self.k, self.v, self.positions = (self._full[key][:, :n] for key in ("k", "v", "positions"))
        if self.q_window is not None:
            self.q_window = self._full["q_window"][:, :n]
        self.lengths_t = lengths[:n]
        self.lengths = [self.lengths[r] for r in rows]
        self.protected = [self.protected[r] for r in rows]
        self.prompt_lengths = [self.prompt_lengths[r] for r in rows]


def cache_capacity(prompt_lengths: list[int], max_new_tokens: int, kv: KVConfig) -> int:
    """Slots per row: everything for dense, else the most a row can hold between compressions."""
    longest = max(prompt_lengths)
    dense = longest + max_new_tokens
    if kv.policy == "dense":
        return dense
    if kv.keep_prompt:
        return min(dense, longest + kv.budget + kv.buffer)
    # The whole prompt is written before it is first compressed.
    return min(dense, max(longest, kv.budget + kv.buffer))
