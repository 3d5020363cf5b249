"""Patches and fingerprints from shards: each process holds a contiguous slice of every flattened
tensor (FSDP2 shards dim 0) and never the whole model.

Per slice, a process finds its changed elements and encodes them as far as can be done without
its neighbours: the gap varints after its first change and the byte planes of the new values and
deltas (SliceChanges), and its part of the fingerprint sums (SliceSums). One process then joins
the slices in order (the first gap of a slice needs the previous slice's last index; plane k of
the tensor is plane k of every slice, concatenated), entropy-codes and lays out the container.
The result is byte-identical to extract_patch on the full tensors (tests/unit/test_patch_sharded.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from math import prod

import torch

from .codec import (
    RawChange,
    bits,
    build_patch,
    dtype_name,
    entropy_code,
    planes_encode,
    sparse_delta,
    to_unsigned,
    varint_encode,
    zigzag,
)
from .fingerprint import fingerprint_from_sums, word_sum_at


@dataclass
class SliceChanges:
    """The changed elements of one slice of one tensor, encoded up to what needs the neighbours.
    Indices are flat and global (the slice's element offset added)."""

    name: str
    count: int
    first: int  # global index of the first change (-1 when count == 0)
    last: int  # global index of the last change
    gaps: torch.Tensor  # uint8 LEB128 of the gaps after the first change (host)
    values: torch.Tensor  # uint8 [width, count]: byte planes of the new bit patterns (host)
    deltas: torch.Tensor  # uint8 [width, count]: byte planes of zigzag(new - old) (host)


@dataclass
class SliceSums:
    """One slice's part of a tensor's fingerprint sum: the words wholly inside the slice, summed,
    and the bytes of the (at most two) words it shares with a neighbour or the zero padding."""

    name: str
    interior: int
    edges: list[tuple[int, int, bytes]]  # (word index, first byte in that word, bytes)


def slice_changes(name: str, prev: torch.Tensor, cur: torch.Tensor, offset: int) -> SliceChanges:
    """Changes from `prev` to `cur` (one slice, same shape and dtype) whose first element is
    element `offset` of the flattened tensor."""
    dtype_name(cur.dtype)
    old, new = bits(prev.contiguous()), bits(cur.contiguous())
    width = new.element_size()
    local = torch.nonzero(old != new).view(-1)
    if not local.numel():
        empty = torch.empty(width, 0, dtype=torch.uint8)
        return SliceChanges(name, 0, -1, -1, torch.empty(0, dtype=torch.uint8), empty, empty)
    new_u = to_unsigned(new[local], width)
    delta = sparse_delta(to_unsigned(old[local], width), new_u, width)
    count = local.numel()
    first, last = (int(v) + offset for v in torch.stack([local[0], local[-1]]).tolist())
    gaps = varint_encode(torch.diff(local) - 1)
    return SliceChanges(
        name,
        count,
        first,
        last,
        gaps.cpu(),
        planes_encode(new_u, width).view(width, count).cpu(),
        planes_encode(zigzag(delta), width).view(width, count).cpu(),
    )


def slice_sums(name: str, t: torch.Tensor, offset: int) -> SliceSums:
    """The fingerprint part of a slice `t` starting at element `offset` of its flattened tensor."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    b0 = offset * t.element_size()
    b1 = b0 + raw.numel()
    head_end = min(-(-b0 // 8) * 8, b1)  # the first word boundary in the slice, or its end
    tail_start = max(b1 // 8 * 8, head_end)
    edges = []
    if b0 < head_end:
        edges.append((b0 // 8, b0 % 8, raw[: head_end - b0].cpu().numpy().tobytes()))
    if tail_start < b1:
        edges.append((tail_start // 8, 0, raw[tail_start - b0 :].cpu().numpy().tobytes()))
    interior = raw[head_end - b0 : tail_start - b0]
    if interior.storage_offset() % 8:
        interior = interior.clone()
    words = interior.view(torch.int64)
    return SliceSums(name, int(word_sum_at(words, head_end // 8)) if words.numel() else 0, edges)


def combine_sums(parts: Iterable[SliceSums]) -> int:
    """A tensor's fingerprint sum S from the SliceSums of slices covering it exactly once."""
    total = 0
    shared: dict[int, bytearray] = {}  # word index -> its 8 bytes (zeros where no slice reaches)
    for part in parts:
        total += part.interior
        for word, at, data in part.edges:
            shared.setdefault(word, bytearray(8))[at : at + len(data)] = data
    for word, word_bytes in shared.items():
        total += int(word_sum_at(torch.frombuffer(word_bytes, dtype=torch.int64), word))
    return total & (2**64 - 1)


def fingerprint_from_slices(
    meta: Mapping[str, tuple[torch.dtype, tuple[int, ...]]], parts: Iterable[SliceSums]
) -> str:
    """fingerprint() of the full tensors (`meta`: name -> dtype, shape) from all slices' sums."""
    by_name: dict[str, list[SliceSums]] = {name: [] for name in meta}
    for part in parts:
        by_name[part.name].append(part)
    return fingerprint_from_sums(
        {n: (dtype, shape, combine_sums(by_name[n])) for n, (dtype, shape) in meta.items()}
    )


def join_changes(
    name: str, shape: tuple[int, ...], dtype: torch.dtype, slices: Sequence[SliceChanges]
) -> RawChange:
    """One tensor's RawChange (as codec.diff_states makes it) from its slices' changes."""
    parts = sorted((s for s in slices if s.count), key=lambda s: s.first)
    index: list[torch.Tensor] = []
    previous = -1
    for part in parts:
        index += [varint_encode(torch.tensor([part.first - previous - 1])), part.gaps]
        previous = part.last
    width = torch.empty(0, dtype=dtype).element_size()

    def planes(which: str) -> torch.Tensor:
        return torch.cat([torch.cat([getattr(p, which)[k] for p in parts]) for k in range(width)])

    return RawChange(
        name,
        tuple(shape),
        dtype_name(dtype),
        sum(p.count for p in parts),
        torch.cat(index),
        planes("values"),
        planes("deltas"),
    )


def assemble_patch(
    meta: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
    changes: Iterable[SliceChanges],
    *,
    run: str,
    base_version: int,
    target_version: int,
    base_fingerprint: str,
    target_fingerprint: str,
    chunk_bytes: int = 4 << 20,
) -> bytes:
    """The container extract_patch(..., encoding="auto") makes for the same full tensors, from
    every slice's changes (any order; slices without changes may be left out)."""
    by_name: dict[str, list[SliceChanges]] = {}
    for change in changes:
        if change.count:
            by_name.setdefault(change.name, []).append(change)
    raws = [join_changes(name, meta[name][1], meta[name][0], by_name[name]) for name in sorted(by_name)]
    return build_patch(
        entropy_code(raws),
        run=run,
        base_version=base_version,
        base_fingerprint=base_fingerprint,
        target_version=target_version,
        target_fingerprint=target_fingerprint,
        chunk_bytes=chunk_bytes,
        dense_bytes=sum(
            prod(shape) * torch.empty(0, dtype=dtype).element_size() for dtype, shape in meta.values()
        ),
        numel=sum(prod(shape) for _, shape in meta.values()),
    )
