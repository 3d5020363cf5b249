"""Preallocated, compactable KV cache of one generation batch.

Layout (docs/engine.md): keys and values are `[layers, batch, kv_heads, capacity, head_dim]`.
Keys are stored after RoPE at their logical positions, so evicting a token never shifts another
token's position. Each sequence (row) stores `lengths[row]` tokens in slots `[0, lengths[row])`,
in chronological order; every layer and every KV head of a row stores the same number of tokens,
but per-head policies keep different tokens in each head. Compression gathers the kept slots of
each (row, head) to the front, one layer at a time, so the extra memory it needs is one layer's
worth and the batch's KV memory never depends on the generated length.

Attention over the cache (writing new keys and values, attending) is attention.CacheAttention's.
"""

from __future__ import annotations

import torch

from services.rollout.engine.config import KVConfig
from services.rollout.engine.policies import EvictionPolicy, make_policy


class KVCache:
    def __init__(self, *, num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 prompt_lengths: list[int], capacity: int, kv: KVConfig, dtype: torch.dtype,
                 device: torch.device, span_bucket: int | None = None) -> None:
        batch = len(prompt_lengths)
        self.kv = kv
        self.policy: EvictionPolicy = make_policy(kv)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
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

    # ------------------------------------------------------------------ bookkeeping
    def advance(self) -> None:
        """One decode step was stored in every row (attention.CacheAttention wrote it)."""
        self.lengths = [n + 1 for n in self.lengths]
        self.lengths_t = self.lengths_t + 1
        if self.q_window is not None:
            self.q_next = (self.q_next + 1) % self.kv.window

    def window_queries(self, layer: int) -> torch.Tensor:
        """The last `window` queries of a layer, oldest first: [B, Hq, W, D]."""
        assert self.q_window is not None
        return self.q_window[layer].roll(-self.q_next, dims=2) if self.q_next else self.q_window[layer]

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
        self.lengths_t = torch.tensor(keep, device=dev)
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
