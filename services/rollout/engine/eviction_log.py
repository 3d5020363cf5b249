"""What a compressed cache hid from each query, recorded while generating: the worker's side of
eviction replay.

The trainer's eviction replay (LossConfig.recompute = "replayed") needs, for every sampled token,
which positions its query saw in each layer and KV head. Eviction is permanent, so one number per
(layer, KV head, position) says it all: the first query position that no longer saw that position
(`evicted_at`; -1: never evicted). A worker whose engine records it (`LLMEngine.record_evictions`)
ships it with each sample, and the trainer builds the masks from it (`visibility`) instead of
rerunning the engine over the batch (services.rollout.engine.replay), which cost the demo's trainer
about half of its step on a 2-core CPU. Size: layers × KV heads × (prompt + completion) integers per
sample, so it suits the small models replay is for, not billion-parameter ones.
"""

from __future__ import annotations

import torch

from services.rollout.engine.kv_cache import KVCache

NEVER = -1


class EvictionLog:
    """`evicted_at` of every sequence of one generate() call, on the engine's device."""

    def __init__(self, batch: int, num_layers: int, num_kv_heads: int, total: int,
                 device: torch.device) -> None:
        """total: one past the last position any sequence can reach (longest prompt + max_new_tokens)."""
        self.total = total
        self.evicted_at = torch.full((batch, num_layers, num_kv_heads, total), NEVER, dtype=torch.int32,
                                     device=device)

    def mark(self, cache: KVCache, sequences: torch.Tensor, next_query: torch.Tensor) -> None:
        """After a compression: every position below `next_query` that a layer/head of cache row r no
        longer stores is hidden from query `next_query[r]` on. `sequences[r]`: the sequence (output
        row) in cache row r."""
        dev, total = self.evicted_at.device, self.total
        slots = torch.arange(total, device=dev)
        written = slots[None, None] < next_query[:, None, None]  # [rows, 1, total]
        since = next_query.to(torch.int32)[:, None, None]
        for layer in range(self.evicted_at.shape[1]):
            before = self.evicted_at[sequences, layer]
            newly = written & ~cache.stored_mask(layer, total) & (before == NEVER)
            self.evicted_at[sequences, layer] = torch.where(newly, since, before)

    def of(self, sequence: int, length: int) -> list[int]:
        """Sequence `sequence`'s record over its first `length` positions (prompt + completion),
        flattened layer-major: [layer][KV head][position]."""
        return self.evicted_at[sequence, :, :, :length].flatten().tolist()


def visibility(evicted_at: list[int], num_layers: int, num_kv_heads: int, length: int,
               device: torch.device | str = "cpu") -> torch.Tensor:
    """bool [layers, Hkv, length, length] from a sample's `evicted_at`: entry [l, h, q, k] says the
    query at position q saw position k in layer l, KV head h (what replay.visible_positions gives
    for the same sample). Raises ValueError if the record does not fit the shape."""
    if len(evicted_at) != num_layers * num_kv_heads * length:
        raise ValueError(f"evicted_at has {len(evicted_at)} entries, not {num_layers} layers × "
                         f"{num_kv_heads} KV heads × {length} positions")
    since = torch.tensor(evicted_at, dtype=torch.long, device=device)
    since = since.view(num_layers, num_kv_heads, 1, length)
    slots = torch.arange(length, device=device)
    if bool(((since != NEVER) & (since <= slots.view(1, 1, 1, length))).any()):
        raise ValueError("evicted_at hides a position from its own query")
    query = slots.view(1, 1, length, 1)
    causal = slots.view(1, 1, 1, length) <= query
    return causal & ((since == NEVER) | (since > query))
