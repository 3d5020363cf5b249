"""Patches and fingerprints from shards equal, byte for byte, those of the full tensors."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from shared.patch import apply_patch, extract_patch, fingerprint
from shared.patch.codec import build_patch, entropy_code
from shared.patch.fingerprint import tensor_sum, tensor_sum_at
from shared.patch.sharded import (
    SliceSums,
    combine_sums,
    dense_size,
    encode_shard,
    fingerprint_from_slices,
    owners,
    pack_encoded,
    receive_sizes,
    shard_sums,
    unpack,
    unpack_encoded,
)


def _model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "embed.weight": (37, 24),
        "layers.0.q.weight": (24, 24),
        "layers.0.norm.weight": (24,),
        "odd.weight": (7, 3),
        "long.weight": (2100, 3),
        "one.weight": (1,),
    }
    out = {name: torch.randn(shape, generator=g).to(torch.bfloat16) for name, shape in shapes.items()}
    out["master.weight"] = torch.randn(5, 11, generator=g)  # fp32: 4-byte elements
    return out


def _step(state: dict[str, torch.Tensor], seed: int, fraction: float = 0.1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        moved = t.float() + 0.05 * torch.randn(t.shape, generator=g) * (
            torch.rand(t.shape, generator=g) < fraction
        )
        out[name] = moved.to(t.dtype)
    out["one.weight"] = state["one.weight"].clone()  # one tensor unchanged
    return out


def _bounds(numel: int, parts: int, seed: int) -> list[tuple[int, int]]:
    """`parts` contiguous uneven slices of [0, numel), some of them empty."""
    g = torch.Generator().manual_seed(seed)
    cuts = sorted(torch.randint(0, numel + 1, (parts - 1,), generator=g).tolist())
    edges = [0, *cuts, numel]
    return list(zip(edges[:-1], edges[1:], strict=True))


Meta = dict[str, tuple[torch.dtype, tuple[int, ...]]]


def _shards(
    state: dict[str, torch.Tensor], parts: int, seed: int
) -> list[tuple[dict[str, torch.Tensor], dict[str, int]]]:
    """Process p's slices (slice p of every flattened tensor, uneven, some empty) and offsets."""
    out: list[tuple[dict[str, torch.Tensor], dict[str, int]]] = [({}, {}) for _ in range(parts)]
    for i, name in enumerate(sorted(state)):
        for p, (start, end) in enumerate(_bounds(state[name].numel(), parts, seed + i)):
            out[p][0][name] = state[name].reshape(-1)[start:end]
            out[p][1][name] = start
    return out


def _sums(state: dict[str, torch.Tensor], parts: int, seed: int) -> list[SliceSums]:
    return [
        s
        for shard, offsets in _shards(state, parts, seed)
        for s in shard_sums([(name, t, offsets[name]) for name, t in shard.items()])
    ]


def _sharded_patch(
    old: dict[str, torch.Tensor],
    new: dict[str, torch.Tensor],
    parts: int,
    seed: int,
    meta: Meta,
    batched: bool | None = None,
    **header: Any,
) -> bytes:
    """What the processes of services/trainer/distributed.py do, with lists for the collectives:
    encode each shard, all-to-all the slices to their owners, entropy-code there, gather on 0."""
    olds, news = _shards(old, parts, seed), _shards(new, parts, seed)
    encodings = [
        encode_shard(o, n, offsets, batched=batched)
        for (o, _), (n, offsets) in zip(olds, news, strict=True)
    ]
    metas = [e.meta for e in encodings]
    owner = owners(metas)
    sent = [e.pack(owner, parts) for e in encodings]
    blobs = []
    for rank in range(parts):
        sizes = receive_sizes(metas, encodings[rank].widths, owner, rank)
        received = [buffer.split(send_sizes)[rank] for buffer, send_sizes in sent]
        assert [r.numel() for r in received] == sizes
        coded = entropy_code(unpack(received, metas, encodings[rank], owner, rank, meta))
        blobs.append(pack_encoded(coded, encodings[rank].names))
    streams = [e for blob in reversed(blobs) for e in unpack_encoded(blob, encodings[0].names, meta)]
    dense_bytes, numel = dense_size(meta)
    return build_patch(
        sorted(streams, key=lambda e: e.name), dense_bytes=dense_bytes, numel=numel, **header
    )


def _meta(state: dict[str, torch.Tensor]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    return {name: (t.dtype, tuple(t.shape)) for name, t in state.items()}


@pytest.mark.parametrize("batched", [None, True])  # True: the GPUs' compare, here on the CPU
@pytest.mark.parametrize(("parts", "seed"), [(1, 0), (2, 1), (3, 2), (8, 3)])
def test_patch_from_uneven_slices_is_byte_identical(parts: int, seed: int, batched: bool | None) -> None:
    old = _model(seed)
    new = _step(old, seed + 100)
    meta = _meta(new)
    base_fp = fingerprint_from_slices(meta, _sums(old, parts, seed))
    target_fp = fingerprint_from_slices(meta, _sums(new, parts, seed))
    assert (base_fp, target_fp) == (fingerprint(old), fingerprint(new))
    # The sharded writer has no whole base tensor, so no `ctxans`: `zstd` is its `auto`.
    full = extract_patch(old, new, run="r", base_version=3, target_version=4, chunk_bytes=512,
                         encoding="zstd")
    joined = _sharded_patch(
        old, new, parts, seed, meta, batched, run="r", base_version=3, target_version=4,
        base_fingerprint=base_fp, target_fingerprint=target_fp, chunk_bytes=512,
    )
    assert joined == full
    replica = {k: v.clone() for k, v in old.items()}
    apply_patch(replica, joined)
    assert fingerprint(replica) == fingerprint(new)


def test_owners_spread_the_changes() -> None:
    counts = [[0, 90, 10, 40, 40, 30], [0, 10, 0, 20, 20, 30]]  # two processes' counts, six tensors
    metas = [torch.tensor([[c, -1, -1, 0] for c in row]) for row in counts]
    owner = owners(metas)
    assert owner[0] == -1  # no changes anywhere: nobody codes it
    load = [sum(sum(row[i] for row in counts) for i, o in enumerate(owner) if o == r) for r in range(2)]
    # Largest first, each to the least loaded: 100 -> 0, 60 -> 1, 60 -> 1, 60 -> 0, 10 -> 1.
    assert owner == [-1, 0, 1, 1, 1, 0] and load == [160, 130]


def test_no_change_and_empty_slices() -> None:
    old = _model(5)
    encodings = [encode_shard(o, o, offsets) for o, offsets in _shards(old, 4, 5)]
    assert all(int(e.meta[:, 0].sum()) == 0 for e in encodings)
    assert owners([e.meta for e in encodings]) == [-1] * len(old)
    fp = fingerprint(old)
    assert fingerprint_from_slices(_meta(old), _sums(old, 4, 5)) == fp
    patch = _sharded_patch(
        old, old, 4, 5, _meta(old), run="r", base_version=0, target_version=1,
        base_fingerprint=fp, target_fingerprint=fp, chunk_bytes=4 << 20,
    )
    assert patch == extract_patch(old, old, run="r", base_version=0, target_version=1)
    (empty,) = shard_sums([("x", torch.empty(0, dtype=torch.bfloat16), 5)])
    assert (empty.interior, empty.edges) == (0, [])


def test_special_values_are_bit_exact() -> None:
    # NaN payloads, -0.0 vs 0.0 and infinities differ only in bits: they must travel as bits.
    nan_a = torch.tensor([0x7FC1], dtype=torch.int16).view(torch.bfloat16)
    nan_b = torch.tensor([0x7FC2], dtype=torch.int16).view(torch.bfloat16)
    old = {"w": torch.tensor([0.0, 1.0, math.inf, 2.0, 0.5, -1.0, 3.0], dtype=torch.bfloat16)}
    new = {"w": old["w"].clone()}
    old["w"][4], new["w"][4] = nan_a[0], nan_b[0]
    new["w"][0], new["w"][2], new["w"][5] = -0.0, -math.inf, math.nan
    meta = _meta(new)
    patch = _sharded_patch(
        old, new, 3, 9, meta, run="r", base_version=0, target_version=1, chunk_bytes=4 << 20,
        base_fingerprint=fingerprint_from_slices(meta, _sums(old, 3, 9)),
        target_fingerprint=fingerprint_from_slices(meta, _sums(new, 3, 9)),
    )
    assert patch == extract_patch(old, new, run="r", base_version=0, target_version=1)
    replica = {"w": old["w"].clone()}
    apply_patch(replica, patch)
    assert torch.equal(replica["w"].view(torch.int16), new["w"].view(torch.int16))


def test_sums_of_slices_add_up_at_any_word_offset() -> None:
    g = torch.Generator().manual_seed(0)
    t = torch.randint(-(2**62), 2**62, (5000,), generator=g)  # int64: one word per element
    for cut in (0, 1, 1023, 1024, 1025, 3000, 5000):
        parts = int(tensor_sum_at(t[:cut], 0)) + int(tensor_sum_at(t[cut:], cut))
        assert parts & (2**64 - 1) == int(tensor_sum(t)) & (2**64 - 1)
    # Slices of 2-byte elements sharing words with their neighbours.
    b = torch.randn(1001, generator=g).to(torch.bfloat16)
    parts = shard_sums([("b", b[s:e], s) for s, e in [(0, 3), (3, 4), (4, 517), (517, 1001)]])
    assert combine_sums(parts) == int(tensor_sum(b)) & (2**64 - 1)
