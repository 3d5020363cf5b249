"""Preallocated, compactable KV cache of one generation batch.

Layout (docs/engine.md): layer l's keys and values are `[batch, kv_heads, capacity_l, head_dim]`,
all layers in one allocation (`k[l]`, `v[l]` are views of it). Every layer has the same capacity
unless `KVConfig.layer_budgets` gives the layers different budgets (PyramidKV): then each layer
is only as large as its own budget needs, so a pyramid costs the memory of a uniform budget.
Keys are stored after RoPE at their logical positions, so evicting a token never shifts another
token's position. Row `r` of layer `l` stores its tokens in slots `[0, layer_lengths(l)[r])`, in
chronological order; every KV head of a layer stores the same number of tokens, but per-head
policies keep different tokens in each head. Compression moves the kept slots of each
(row, head) to the front, one layer at a time: on CUDA in place (kernels.compact_), elsewhere by
a gather whose extra memory is one layer's worth; the batch's KV memory never depends on the
generated length.

Attention over the cache (writing new keys and values, attending) is attention.CacheAttention's,
or, for a static cache, fused_decode.FusedDecoder's. A static cache (CUDA graphs, cuda_graphs.py)
lives in a `StaticStorage` that the engine keeps across generate() calls: it never reallocates,
rows that leave the batch are compacted in place and the cache's tensors become views of the
first live rows; per-row lengths and the query ring's slot also live on the device, so one
captured decode step serves every step of every call that fits the storage. Compression runs
outside the graph, in place, as for the eager cache.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

import services.rollout.engine.kernels as kernels
from services.rollout.engine.config import KVConfig, layer_budgets
from services.rollout.engine.policies import EvictionPolicy, make_policy

# A held static storage serves a batch whose layers need up to this many slots fewer than it has
# (prompt lengths vary between calls; a capacity that differs by a few tokens should not cost a
# new allocation and new graphs). Larger gaps reallocate, so the memory held stays close to need.
REUSE_SLACK = 256


def _layer_buffers(batch: int, heads: int, capacities: Sequence[int], head_dim: int, dtype: torch.dtype,
                   device: torch.device) -> list[torch.Tensor]:
    """One zeroed allocation, viewed as one [batch, heads, capacity_l, head_dim] tensor per layer."""
    per_slot = batch * heads * head_dim
    flat = torch.zeros(per_slot * sum(capacities), dtype=dtype, device=device)
    views, at = [], 0
    for cap in capacities:
        views.append(flat[at:at + per_slot * cap].view(batch, heads, cap, head_dim))
        at += per_slot * cap
    return views


def _layer_lengths(num_layers: int, batch: int, device: torch.device) -> torch.Tensor:
    """Zeroed per-layer, per-row lengths [num_layers, batch] (int64), each layer's row starting on
    16 bytes: Triton specialises a pointer argument on 16-byte alignment, so with an odd batch the
    odd layers' rows would compile every kernel that reads them a second time (on a fresh H100 3.7 s
    inside the first compression at 1.7B batch 59, and more at its graphs' capture)."""
    return torch.zeros((num_layers, batch + batch % 2), dtype=torch.long, device=device)[:, :batch]


class StaticStorage:
    """What a static cache allocates, and the graph-safe operations of a captured decode step.

    The engine keeps one across generate() calls (CUDA graphs address these tensors); `fits` says
    whether a new batch can use it, `reset` makes it as a fresh allocation."""

    def __init__(self, *, num_layers: int, batch: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 capacities: Sequence[int], window: int | None, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.batch, self.capacities, self.window = batch, list(capacities), window
        self.layout = (num_layers, num_heads, num_kv_heads, head_dim, dtype)
        self.k = _layer_buffers(batch, num_kv_heads, capacities, head_dim, dtype, device)
        self.v = _layer_buffers(batch, num_kv_heads, capacities, head_dim, dtype, device)
        capacity = max(capacities)
        # Positions are 4 bytes a slot against K+V's 4 * head_dim: one tensor at the largest capacity.
        self.positions = torch.zeros((num_layers, batch, num_kv_heads, capacity), dtype=torch.int32,
                                     device=device)
        self.q_window = (torch.zeros((num_layers, batch, num_heads, window, head_dim), dtype=dtype,
                                     device=device) if window else None)
        self.lengths = _layer_lengths(num_layers, batch, device)
        self.q_next = torch.zeros(1, dtype=torch.long, device=device)
        self.attn_buffers = kernels.attention_buffers(batch, num_heads, capacity, head_dim, device)

    def fits(self, batch: int, capacities: Sequence[int], window: int | None,
             layout: tuple[int, int, int, int, torch.dtype]) -> bool:
        return (layout == self.layout and window == self.window and batch <= self.batch
                and len(capacities) == len(self.capacities)
                and all(0 <= have - need <= REUSE_SLACK
                        for have, need in zip(self.capacities, capacities, strict=True)))

    def reset(self) -> None:
        """Zero everything, as a new allocation is (one memset: ~6 ms for 15 GB on an H100)."""
        for buf in (*self.k, *self.v, self.positions, self.lengths, self.q_next):
            buf.zero_()
        if self.q_window is not None:
            self.q_window.zero_()

    # ------------------------------------------------------------------ inside a captured step
    def record_positions(self, positions: torch.Tensor) -> None:
        """Positions [b] of the new tokens at slot lengths[layer, row] of rows [0, b)."""
        b = positions.shape[0]
        layers, _, heads, capacity = self.positions.shape
        slot = self.lengths[:, :b].clamp(max=capacity - 1)
        shape = (layers, b, heads, 1)
        self.positions[:, :b].scatter_(3, slot.view(layers, b, 1, 1).expand(shape),
                                       positions.to(torch.int32).view(1, b, 1, 1).expand(shape))

    def layer(self, layer: int,
              b: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(K, V, query ring or None, lengths of rows [0, b)) of one layer, for fused_decode."""
        q_window = None if self.q_window is None else self.q_window[layer]
        return self.k[layer], self.v[layer], q_window, self.lengths[layer, :b]

    def advance(self, b: int) -> None:
        """End of a decode step on the device (the host side: KVCache.advance)."""
        self.lengths[:, :b] += 1
        if self.window:
            self.q_next.add_(1).remainder_(self.window)

    def device_state(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What advance changes (for a graph's warm-up step to be undone)."""
        return self.lengths.clone(), self.q_next.clone()

    def restore_device_state(self, state: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.lengths.copy_(state[0])
        self.q_next.copy_(state[1])


class KVCache:
    def __init__(self, *, num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 prompt_lengths: list[int], capacity: int | Sequence[int], kv: KVConfig, dtype: torch.dtype,
                 device: torch.device, span_bucket: int | None = None,
                 storage: StaticStorage | None = None) -> None:
        """capacity: slots per row, one for every layer or one per layer (layer_capacities); with a
        storage (static cache) the storage's capacities, which may be a little larger."""
        batch = len(prompt_lengths)
        self.kv = kv
        self.policy: EvictionPolicy = make_policy(kv)
        self.num_layers = num_layers
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        self.budgets = layer_budgets(kv, num_layers)
        self.device = device
        self.span_bucket = span_bucket or (128 if device.type == "cuda" else 1)
        self.storage = storage
        self.static = storage is not None
        if storage is not None:
            assert batch <= storage.batch and not self.policy.uses_accumulated_attention
            self.capacities = list(storage.capacities)
        else:
            self.capacities = [capacity] * num_layers if isinstance(capacity, int) else list(capacity)
        self.capacity = max(self.capacities)
        window = kv.window if self.policy.uses_query_window else None
        if storage is not None:
            self.k, self.v = [t[:batch] for t in storage.k], [t[:batch] for t in storage.v]
            self.positions = storage.positions[:, :batch]
            self.q_window = None if storage.q_window is None else storage.q_window[:, :batch]
        else:
            self.k = _layer_buffers(batch, num_kv_heads, self.capacities, head_dim, dtype, device)
            self.v = _layer_buffers(batch, num_kv_heads, self.capacities, head_dim, dtype, device)
            # Logical position of each stored token (what streaming ranks by, what tests inspect).
            self.positions = torch.zeros((num_layers, batch, num_kv_heads, self.capacity), dtype=torch.int32,
                                         device=device)
            self.q_window = (torch.zeros((num_layers, batch, num_heads, window, head_dim), dtype=dtype,
                                         device=device) if window else None)
        # q_window is a ring: the next decode query overwrites slot q_next (the oldest); prefill
        # fills it oldest first, so it starts at 0. window_queries() returns it oldest first.
        self.q_next = 0
        self.attn_acc = (torch.zeros(self.positions.shape, dtype=torch.float32, device=device)
                         if self.policy.uses_accumulated_attention else None)
        self.prompt_lengths = list(prompt_lengths)
        self.protected = list(prompt_lengths) if kv.keep_prompt else [0] * batch
        # Host-side bookkeeping: rows advance in lockstep, so no device sync is needed to know them.
        # lengths[r]: tokens stored by row r's fullest layer; layer l stores deficits[l][r] fewer
        # (all 0 with uniform budgets). Both change only at prefill, compression and select_rows.
        self.lengths = [0] * batch
        self.deficits = [[0] * batch for _ in range(num_layers)]
        self._stored_deficit = [0] * batch  # mean of the deficits over the layers, rounded
        self._limits = [0] * batch  # lengths[r] at which some layer of row r holds budget + buffer
        # Per layer and row, on the device (a static cache: a view of the storage's).
        self.lengths_t = (storage.lengths[:, :batch] if storage is not None
                          else _layer_lengths(num_layers, batch, device))
        # CUDA moves the kept slots with one Triton kernel (no accumulators to move along).
        self._compact_in_place = device.type == "cuda" and kernels.available() and self.attn_acc is None

    # ------------------------------------------------------------------ sizes
    @property
    def batch(self) -> int:
        return len(self.lengths)

    @property
    def bytes_per_token(self) -> int:
        """K + V bytes of one token over all layers and KV heads."""
        _, heads, _, dim = self.k[0].shape
        return 2 * self.num_layers * heads * dim * self.k[0].element_size()

    @property
    def nbytes(self) -> int:
        """Bytes of K and V for the batch's rows (the batch's KV memory)."""
        return 2 * sum(t.numel() for t in self.k) * self.k[0].element_size()

    # ------------------------------------------------------------------ bookkeeping
    def layer_lengths(self, layer: int) -> list[int]:
        """Tokens each row stores in this layer."""
        deficits = self.deficits[layer]
        return [n - d for n, d in zip(self.lengths, deficits, strict=True)] if any(deficits) else self.lengths

    def stored_mask(self, layer: int, total: int) -> torch.Tensor:
        """bool [rows, Hkv, total]: the positions below `total` each row's KV heads store in `layer`
        (what a query decoded now sees there; the eviction replay and the eviction log read it)."""
        stored = self.layer_lengths(layer)
        span = max(stored)
        kept = self.positions[layer, :, :, :span].long()  # [rows, Hkv, span]
        ok = (torch.arange(span, device=self.device)[None, None]
              < torch.tensor(stored, device=self.device)[:, None, None])
        mask = torch.zeros((kept.shape[0], kept.shape[1], total + 1), dtype=torch.bool, device=self.device)
        mask.scatter_(2, torch.where(ok, kept.clamp(max=total - 1), total), True)
        return mask[:, :, :total]

    def stored(self) -> list[int]:
        """Tokens each row stores, per layer and KV head: the mean over the layers, rounded."""
        if not any(self._stored_deficit):
            return self.lengths
        return [n - d for n, d in zip(self.lengths, self._stored_deficit, strict=True)]

    def set_layer_lengths(self, per_layer: list[list[int]]) -> None:
        """Set the tokens stored per [layer][row], on the host and the device."""
        batch = len(per_layer[0])
        self.lengths = [max(col) for col in zip(*per_layer, strict=True)]
        self.deficits = [[n - m for n, m in zip(self.lengths, row, strict=True)] for row in per_layer]
        layers = self.num_layers
        sums = [sum(col) for col in zip(*self.deficits, strict=True)]
        self._stored_deficit = [(2 * s + layers) // (2 * layers) for s in sums]  # round half up
        buffer = self.kv.buffer
        self._limits = [
            min(p + b + buffer + d[r] for b, d in zip(self.budgets, self.deficits, strict=True))
            for r, p in enumerate(self.protected)
        ]
        values = torch.tensor(per_layer, dtype=torch.long, device=self.device)
        if self.storage is not None:
            self.lengths_t.copy_(values)
            # Rows past the live batch in a padded graph bucket start over.
            self.storage.lengths[:, batch:] = 0
        else:
            self.lengths_t = _layer_lengths(self.num_layers, batch, self.device)
            self.lengths_t.copy_(values)

    def advance(self) -> None:
        """One decode step was stored in every layer of every row (attention.CacheAttention wrote it;
        for a static cache the captured step advanced the device side, StaticStorage.advance)."""
        self.lengths = [n + 1 for n in self.lengths]
        if not self.static:
            self.lengths_t += 1  # in place: a new tensor would lose the rows' alignment
        if self.q_window is not None:
            self.q_next = (self.q_next + 1) % self.kv.window

    def window_queries(self, layer: int) -> torch.Tensor:
        """The last `window` queries of a layer, oldest first: [B, Hq, W, D]."""
        assert self.q_window is not None
        return self.q_window[layer].roll(-self.q_next, dims=2) if self.q_next else self.q_window[layer]

    # ------------------------------------------------------------------ eviction
    def needs_compression(self) -> bool:
        """True once some layer of some row holds its budget + buffer evictable tokens."""
        if self.policy.name == "dense":
            return False
        return any(n >= limit for n, limit in zip(self.lengths, self._limits, strict=True))

    def compress(self) -> list[int]:
        """Evict each layer of each row that reached its limit down to protected + its budget;
        returns tokens evicted per row (per KV head, the mean over the layers, rounded).

        Only the rows at their own limit: a row's cache then depends on its own tokens alone, never
        on when its batch-mates fill up (batch-invariant, so the trainer can replay a sequence's
        eviction by itself: engine/replay.py)."""
        dev = self.device
        per_layer: list[list[int]] = []
        evicted = [0] * self.batch
        masks: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[torch.Tensor, ...]] = {}
        due = [n >= limit for n, limit in zip(self.lengths, self._limits, strict=True)]
        for layer in range(self.num_layers):
            lengths = self.layer_lengths(layer)
            keep = [min(n, p + self.budgets[layer]) if d else n
                    for n, p, d in zip(lengths, self.protected, due, strict=True)]
            per_layer.append(keep)
            if keep == lengths:
                continue
            evicted = [e + n - k for e, n, k in zip(evicted, lengths, keep, strict=True)]
            key = (tuple(lengths), tuple(keep))
            if key not in masks:  # layers with the same lengths share their masks (all, if uniform)
                span = max(lengths)
                slot = torch.arange(span, device=dev)
                lengths_t = torch.tensor(lengths, device=dev)[:, None]
                protected = torch.tensor(self.protected, device=dev)[:, None]
                valid = slot[None] < lengths_t  # [B, S]
                forced = (slot[None] < protected) | (slot[None] >= lengths_t - self.kv.window)
                rank_ok = (slot[None] < torch.tensor(keep, device=dev)[:, None])[:, None]  # [B, 1, S]
                masks[key] = (slot, valid, forced, rank_ok)
            slot, valid, forced, rank_ok = masks[key]
            span = slot.shape[0]
            score = self.policy.score(self, layer, span, valid).float()
            score = score.expand(-1, self.num_kv_heads, -1)
            score = score.masked_fill(forced[:, None], float("inf")).masked_fill(
                ~valid[:, None], float("-inf")
            )
            order = score.argsort(dim=-1, descending=True, stable=True)
            kept = torch.zeros_like(score, dtype=torch.bool).scatter_(-1, order, rank_ok.expand_as(score))
            # Kept slots first, in their original (chronological) order.
            if self._compact_in_place:
                kernels.compact_(self.k[layer], self.v[layer], self.positions[layer], kept)
                continue
            perm = torch.where(kept, slot, slot + span).argsort(dim=-1)
            self._gather_(layer, perm, span)
            if self.attn_acc is not None:
                # The evicted tokens' sums now sit in the free slots: a token written there later
                # must start from zero, not inherit them.
                self.attn_acc[layer, :, :, :span].masked_fill_(~rank_ok, 0.0)
        if any(evicted):
            self.set_layer_lengths(per_layer)
        layers = self.num_layers
        return [(2 * e + layers) // (2 * layers) for e in evicted]

    def _gather_(self, layer: int, perm: torch.Tensor, span: int) -> None:
        idx = perm[..., None].expand(-1, -1, -1, self.head_dim)
        for buf in (self.k[layer], self.v[layer]):
            buf[:, :, :span] = buf[:, :, :span].gather(2, idx)
        self.positions[layer, :, :, :span] = self.positions[layer, :, :, :span].gather(2, perm)
        if self.attn_acc is not None:
            self.attn_acc[layer, :, :, :span] = self.attn_acc[layer, :, :, :span].gather(2, perm)

    # ------------------------------------------------------------------ batch
    def select_rows(self, rows: list[int]) -> None:
        """Keep only these rows (finished sequences leave the batch)."""
        layers = [self.layer_lengths(layer) for layer in range(self.num_layers)]
        per_layer = [[lengths[r] for r in rows] for lengths in layers]
        self.protected = [self.protected[r] for r in rows]
        self.prompt_lengths = [self.prompt_lengths[r] for r in rows]
        if self.storage is not None:
            self._compact_rows(self.storage, rows)
        else:
            index = torch.tensor(rows, device=self.device)
            self.k = [t.index_select(0, index) for t in self.k]
            self.v = [t.index_select(0, index) for t in self.v]
            self.positions = self.positions.index_select(1, index)
            if self.q_window is not None:
                self.q_window = self.q_window.index_select(1, index)
            if self.attn_acc is not None:
                self.attn_acc = self.attn_acc.index_select(1, index)
        self.set_layer_lengths(per_layer)

    def _compact_rows(self, storage: StaticStorage, rows: list[int]) -> None:
        """select_rows of a static cache: live rows move to the front of the allocation, in place
        (row by row, in increasing order: a row is only ever copied to a lower one already moved)."""
        for new, old in enumerate(rows):
            if new != old:
                for buf in (*storage.k, *storage.v):
                    buf[new].copy_(buf[old])
                for full in (storage.positions, storage.q_window):
                    if full is not None:
                        full[:, new].copy_(full[:, old])
        n = len(rows)
        self.k, self.v = [t[:n] for t in storage.k], [t[:n] for t in storage.v]
        self.positions = storage.positions[:, :n]
        if storage.q_window is not None:
            self.q_window = storage.q_window[:, :n]
        self.lengths_t = storage.lengths[:, :n]


def layer_capacities(prompt_lengths: list[int], max_new_tokens: int, kv: KVConfig,
                     num_layers: int) -> list[int]:
    """Slots per row in each layer: everything for dense, else the most the layer can hold
    between compressions."""
    longest = max(prompt_lengths)
    dense = longest + max_new_tokens
    if kv.policy == "dense":
        return [dense] * num_layers
    if kv.keep_prompt:
        return [min(dense, longest + budget + kv.buffer) for budget in layer_budgets(kv, num_layers)]
    # The whole prompt is written before it is first compressed.
    return [min(dense, max(longest, budget + kv.buffer)) for budget in layer_budgets(kv, num_layers)]
