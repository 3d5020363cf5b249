"""Patches and fingerprints from shards: each process holds a contiguous slice of every flattened
tensor (FSDP2 shards dim 0) and never the whole model.

The steps, each a function here; the caller moves the bytes between processes with raw-tensor
collectives (services/trainer/distributed.py):

1. `encode_shard`: one process compares all its slices at once (codec.changed_indices, batched on a
   GPU) and encodes what needs no neighbour, in a few passes over the concatenation of all its
   changes, not tensor by tensor: gap varints after each slice's first change, byte planes of the
   new bit patterns and of the deltas. Its `meta` (per tensor: count, first and last global index,
   gap bytes) is all the others need to know about it; `shard_sums` gives its fingerprint parts.
2. `owners`: every tensor with changes gets one process that joins and entropy-codes it, chosen
   from all processes' counts so the zstd work is spread evenly.
3. `ShardEncoding.pack` / `receive_sizes` / `unpack`: each process's bytes for every owner, in one
   buffer (an all-to-all), and the owner's join of its tensors' slices into the RawChange the
   single-process extractor makes (the first gap of a slice needs the previous slice's last index;
   plane k of the tensor is plane k of every slice, concatenated).
4. `pack_encoded` / `unpack_encoded`: the owners' zstd streams as one byte buffer each, for the
   process that lays out the container (codec.build_patch).

The result is byte-identical to extract_patch on the full tensors (tests/unit/shared/patch/
test_patch_sharded.py), and the fingerprint from the slices' sums equals fingerprint() of the full
tensors.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from math import prod

import torch

from .codec import (
    ENCODINGS,
    RawChange,
    bits,
    changed_indices,
    dtype_name,
    planes_encode,
    sparse_delta,
    to_unsigned,
    varint_encode,
    varint_encode_lengths,
    zigzag,
)
from .fingerprint import fingerprint_from_sums, word_sum_at
from .format import EncodedTensor

COUNT, FIRST, LAST, GAP_BYTES = range(4)  # the columns of ShardEncoding.meta


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


@dataclass
class ShardEncoding:
    """One process's changes in all its slices, encoded on its device (see encode_shard)."""

    names: list[str]  # every tensor, sorted (the same list on every process)
    widths: list[int]  # bytes per element of each
    meta: torch.Tensor  # int64 [len(names), 4] on the host: COUNT, FIRST, LAST, GAP_BYTES
    gaps: torch.Tensor  # uint8: every changed element's gap varint (a dummy byte at each first change)
    spans: list[tuple[int, int]]  # per tensor: its gap bytes are gaps[lo:hi]
    columns: list[int]  # per tensor: its first column in planes[width]
    planes: dict[int, tuple[torch.Tensor, torch.Tensor]]  # width -> values, deltas: uint8 [width, n]

    def pack(self, owner: Sequence[int], world: int) -> tuple[torch.Tensor, list[int]]:
        """One buffer holding, for each process in turn, what it owns of this shard (tensors in
        name order: gap bytes, value planes, delta planes), and the size sent to each process."""
        parts: list[list[torch.Tensor]] = [[] for _ in range(world)]
        sizes = [0] * world
        for i, count in enumerate(self.meta[:, COUNT].tolist()):
            if not count:
                continue
            (lo, hi), width = self.spans[i], self.widths[i]
            col = self.columns[i]
            values, deltas = self.planes[width]
            parts[owner[i]] += [self.gaps[lo:hi]]
            parts[owner[i]] += [p[k, col : col + count] for p in (values, deltas) for k in range(width)]
            sizes[owner[i]] += hi - lo + 2 * width * count
        flat = [p for dest in parts for p in dest]
        return (torch.cat(flat) if flat else self.gaps[:0]), sizes


def encode_shard(
    old: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    offsets: Mapping[str, int],
    *,
    batched: bool | None = None,
) -> ShardEncoding:
    """Changes from `old` to `new` (this process's slices: same names, shapes, dtypes, contiguous)
    where slice `name` starts at element offsets[name] of its flattened tensor. A GPU does a few
    host syncs for the whole shard (the batched compare, the varint passes, one transfer of the
    per-tensor numbers), not several per tensor. `batched`: as codec.changed_indices."""
    names = sorted(new)
    flat_old = {n: old[n].reshape(-1) for n in names}
    flat_new = {n: new[n].reshape(-1) for n in names}
    found = changed_indices(flat_old, flat_new, batched=batched)
    widths = [new[n].element_size() for n in names]
    device = next(iter(new.values())).device if new else torch.device("cpu")
    counts = [found[n].numel() if n in found else 0 for n in names]
    changed = [i for i, c in enumerate(counts) if c]
    column = [0] * len(names)
    planes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for width in sorted({widths[i] for i in changed}):
        members = [i for i in changed if widths[i] == width]
        at = 0
        for i in members:
            column[i], at = at, at + counts[i]
        new_u = to_unsigned(torch.cat([bits(flat_new[names[i]])[found[names[i]]] for i in members]), width)
        old_u = to_unsigned(torch.cat([bits(flat_old[names[i]])[found[names[i]]] for i in members]), width)
        delta = sparse_delta(old_u, new_u, width)
        planes[width] = (
            planes_encode(new_u, width).view(width, at),
            planes_encode(zigzag(delta), width).view(width, at),
        )
    meta = torch.tensor([[c, -1, -1, 0] for c in counts], dtype=torch.int64).view(len(names), 4)
    spans = [(0, 0)] * len(names)
    if not changed:
        return ShardEncoding(names, widths, meta, torch.empty(0, dtype=torch.uint8, device=device),
                             spans, column, planes)
    # All changed indices of the shard in one vector (tensors in name order): one diff, one varint
    # pass set. A tensor's first change gets a dummy gap of 0 (its real gap needs the neighbour).
    local = torch.cat([found[names[i]] for i in changed])
    sizes = torch.tensor([counts[i] for i in changed])
    lasts = torch.cumsum(sizes, 0) - 1
    starts = lasts - sizes + 1
    starts_d, lasts_d = starts.to(device), lasts.to(device)
    gap_values = torch.diff(local, prepend=local.new_full((1,), -1)) - 1
    gap_values[starts_d] = 0
    gaps, n_bytes = varint_encode_lengths(gap_values)
    ends = torch.cumsum(n_bytes, 0)
    # The one transfer: each tensor's first and last changed index and its gap bytes' span.
    host = torch.stack([local[starts_d], local[lasts_d], ends[starts_d], ends[lasts_d]]).cpu().tolist()
    for k, i in enumerate(changed):
        first, last, lo, hi = (row[k] for row in host)
        offset = offsets[names[i]]
        meta[i] = torch.tensor([counts[i], first + offset, last + offset, hi - lo])
        spans[i] = (lo, hi)
    return ShardEncoding(names, widths, meta, gaps, spans, column, planes)


def owners(metas: Sequence[torch.Tensor]) -> list[int]:
    """The process that joins and entropy-codes each tensor (-1: no changes anywhere), from every
    process's meta (by rank): the largest tensors first, each to the least loaded process, so
    every process compresses about the same number of changes. The same on every process."""
    totals = torch.stack([m[:, COUNT] for m in metas]).sum(dim=0).tolist()
    load = [0] * len(metas)
    owner = [-1] * len(totals)
    for i in sorted(range(len(totals)), key=lambda i: (-totals[i], i)):
        if totals[i]:
            owner[i] = min(range(len(metas)), key=lambda r: (load[r], r))
            load[owner[i]] += totals[i]
    return owner


def receive_sizes(metas: Sequence[torch.Tensor], widths: Sequence[int], owner: Sequence[int],
                  rank: int) -> list[int]:
    """Bytes process `rank` receives from each process (what their pack() sends it)."""
    mine = [i for i, o in enumerate(owner) if o == rank]
    return [
        sum(int(m[i, GAP_BYTES]) + 2 * widths[i] * int(m[i, COUNT]) for i in mine) for m in metas
    ]


def unpack(
    received: Sequence[torch.Tensor],
    metas: Sequence[torch.Tensor],
    encoding: ShardEncoding,
    owner: Sequence[int],
    rank: int,
    meta: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
) -> list[RawChange]:
    """The RawChange of every tensor `rank` owns (name order) from what each process sent it
    (host uint8 buffers, by rank), as codec.diff_states makes it from the full tensors."""
    mine = [i for i, o in enumerate(owner) if o == rank]
    slices: dict[int, list[SliceChanges]] = {i: [] for i in mine}
    for buffer, m in zip(received, metas, strict=True):
        at = 0
        for i in mine:
            count, first, last, gap_bytes = (int(v) for v in m[i])
            if not count:
                continue
            width = encoding.widths[i]
            gaps = buffer[at : at + gap_bytes]
            values = buffer[at + gap_bytes : at + gap_bytes + width * count].view(width, count)
            at += gap_bytes + width * count
            deltas = buffer[at : at + width * count].view(width, count)
            at += width * count
            slices[i].append(SliceChanges(encoding.names[i], count, first, last, gaps, values, deltas))
        if at != buffer.numel():
            raise ValueError(f"received {buffer.numel()} bytes, the senders' meta accounts for {at}")
    out = []
    for i in mine:
        name = encoding.names[i]
        dtype, shape = meta[name]
        out.append(join_changes(name, shape, dtype, slices[i]))
    return out


_ENCODED_FIELDS = 7  # tensor position, count, encoding, index bytes, index raw, payload bytes, payload raw


def pack_encoded(encoded: Sequence[EncodedTensor], names: Sequence[str]) -> torch.Tensor:
    """Entropy-coded tensors as one uint8 buffer (a table of int64 fields, then the streams)."""
    position = {name: i for i, name in enumerate(names)}
    table = torch.tensor(
        [[len(encoded)] + [0] * (_ENCODED_FIELDS - 1)]
        + [
            [position[e.name], e.count, ENCODINGS.index(e.encoding), len(e.index), e.index_raw_length,
             len(e.payload), e.payload_raw_length]
            for e in encoded
        ],
        dtype=torch.int64,
    )
    streams = b"".join(part for e in encoded for part in (e.index, e.payload))
    body = torch.frombuffer(bytearray(streams), dtype=torch.uint8) if streams else table.new_empty(0).byte()
    return torch.cat([table.view(-1).view(torch.uint8), body])


def unpack_encoded(
    buffer: torch.Tensor, names: Sequence[str], meta: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]
) -> list[EncodedTensor]:
    """Inverse of pack_encoded (`buffer` on the host)."""
    n = int(buffer[:8].view(torch.int64))
    table = buffer[: 8 * _ENCODED_FIELDS * (n + 1)].view(torch.int64).view(n + 1, _ENCODED_FIELDS)[1:]
    data = buffer[8 * _ENCODED_FIELDS * (n + 1) :].numpy()
    out, at = [], 0
    for position, count, encoding, index_len, index_raw, payload_len, payload_raw in table.tolist():
        name = names[position]
        dtype, shape = meta[name]
        index = data[at : at + index_len].tobytes()
        payload = data[at + index_len : at + index_len + payload_len].tobytes()
        at += index_len + payload_len
        out.append(EncodedTensor(name, tuple(shape), dtype_name(dtype), ENCODINGS[encoding], count, index,
                                 index_raw, payload, payload_raw))
    return out


def shard_sums(slices: Sequence[tuple[str, torch.Tensor, int]]) -> list[SliceSums]:
    """The fingerprint part of each slice (name, tensor, its first element in the flattened tensor):
    all interior sums queued on the device, then one transfer (plus one for the edge bytes)."""
    interiors: list[torch.Tensor] = []
    edge_bytes: list[torch.Tensor] = []
    edge_places: list[tuple[int, int, int, int]] = []  # (slice, word index, first byte, length)
    for k, (_, t, offset) in enumerate(slices):
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        b0 = offset * t.element_size()
        b1 = b0 + raw.numel()
        head_end = min(-(-b0 // 8) * 8, b1)  # the first word boundary in the slice, or its end
        tail_start = max(b1 // 8 * 8, head_end)
        if b0 < head_end:
            edge_bytes.append(raw[: head_end - b0])
            edge_places.append((k, b0 // 8, b0 % 8, head_end - b0))
        if tail_start < b1:
            edge_bytes.append(raw[tail_start - b0 :])
            edge_places.append((k, tail_start // 8, 0, b1 - tail_start))
        interior = raw[head_end - b0 : tail_start - b0]
        if interior.storage_offset() % 8:
            interior = interior.clone()
        words = interior.view(torch.int64)
        interiors.append(word_sum_at(words, head_end // 8) if words.numel() else words.new_zeros(()))
    if not slices:
        return []
    sums = torch.stack(interiors).cpu().tolist()
    out = [SliceSums(name, total, []) for (name, _, _), total in zip(slices, sums, strict=True)]
    if edge_bytes:
        host = torch.cat(edge_bytes).cpu().numpy().tobytes()
        at = 0
        for k, word, first, length in edge_places:
            out[k].edges.append((word, first, host[at : at + length]))
            at += length
    return out


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


def dense_size(meta: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]) -> tuple[int, int]:
    """(dense bytes, elements) of the full tensors described by `meta` (no tensors needed)."""
    return (
        sum(prod(shape) * torch.empty(0, dtype=dtype).element_size() for dtype, shape in meta.values()),
        sum(prod(shape) for _, shape in meta.values()),
    )
