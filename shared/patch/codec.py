"""Extract, encode and decode the changed elements of tensors (encodings `values`, `bitdelta`, and
`ctxans` through ctxans.py).

Everything up to the entropy coder runs in torch on the tensors' own device (CPU or CUDA), fully
vectorised; only the zstd step runs on the host, one tensor stream per thread.

Streams of one tensor with `count` changed elements (docs/patch-format.md is normative):
- index stream: zstd(LEB128(gaps)), gaps = first flat index, then index[i] - index[i-1] - 1.
- payload stream: zstd(byte planes of `count` unsigned `width`-byte integers), plane k holding
  byte k (little-endian) of every integer. `values`: the new bit patterns. `bitdelta`: zigzag of
  (new bits - old bits) mod 2**(8*width) read as a signed integer; mostly ±1 for optimiser steps
  (about half the bytes of `values`, as measured by bench/patch.py), but it needs the exact base.
- `ctxans` (bf16 only; ctxans.py): both streams rANS-coded under contexts from the base weights.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from math import prod
from typing import Literal

import torch
import zstandard

import shared.patch.ctxans as ctxans
import shared.patch.fused as fused
from shared.dtypes import DTYPES

from .errors import CorruptPatchError, FormatError, TensorMismatchError, UnknownTensorError
from .fingerprint import device_sums, digest, fingerprint
from .format import WIDTHS, EncodedTensor, PatchHeader, Stream, TensorEntry, write_patch

# `auto`: per tensor the smallest of all three; `zstd`: the smaller of `values` and `bitdelta` (what
# the sharded writer of services/trainer/distributed.py makes, which has no whole base tensor).
Encoding = Literal["auto", "zstd", "values", "bitdelta", "ctxans"]
ENCODINGS = ("values", "bitdelta", "ctxans")
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MAX_VARINT_BYTES = 9  # 9 * 7 = 63 bits: every non-negative int64
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"  # a standard zstd frame (skippable frames use other magics)
ZSTD_LEVEL = 1  # on these streams levels 3 and 6 were no smaller than 1 (measured), only slower
CHUNK_BYTES = 4 << 20  # a patch's checksummed chunk (the default of every writer)
_MASK_BYTES = 1 << 30  # changed-element masks (1 byte each) held before their counts are fetched
_POOL = ThreadPoolExecutor(max_workers=8, thread_name_prefix="sparsecast-zstd")
_local = threading.local()


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise TensorMismatchError(f"dtype {name} is not supported by patches")
    return name


def bits(t: torch.Tensor) -> torch.Tensor:
    """The flat integer view of a tensor's bit patterns (no copy)."""
    if not t.is_contiguous():
        raise TensorMismatchError("tensor is not contiguous, cannot be viewed or patched in place")
    return t.detach().view(-1).view(_INT_VIEW[t.element_size()])


def to_unsigned(b: torch.Tensor, width: int) -> torch.Tensor:
    """Bit patterns as int64 holding the unsigned value (width 8 keeps the two's complement)."""
    u = b.to(torch.int64)
    return u if width == 8 else u & ((1 << (8 * width)) - 1)


def from_unsigned(u: torch.Tensor, width: int) -> torch.Tensor:
    """Inverse of to_unsigned: int64 unsigned values back to the integer view dtype, wrapping."""
    if width < 8:
        half = 1 << (8 * width - 1)
        u = ((u + half) & ((1 << (8 * width)) - 1)) - half
    return u.to(_INT_VIEW[width])


def _wrap_signed(d: torch.Tensor, width: int) -> torch.Tensor:
    if width == 8:
        return d  # int64 arithmetic already wraps mod 2**64
    half = 1 << (8 * width - 1)
    return ((d + half) & ((1 << (8 * width)) - 1)) - half


def zigzag(d: torch.Tensor) -> torch.Tensor:
    return (d << 1) ^ (d >> 63)


def unzigzag(z: torch.Tensor) -> torch.Tensor:
    # Logical shift right by one on int64: arithmetic shift, then clear the sign bit.
    return ((z >> 1) & 0x7FFF_FFFF_FFFF_FFFF) ^ -(z & 1)


def varint_encode(values: torch.Tensor) -> torch.Tensor:
    """LEB128 of non-negative int64 values, vectorised: one pass per byte position (≤ 9)."""
    return varint_encode_lengths(values)[0]


def varint_encode_lengths(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(varint_encode(values), each value's byte count): a caller encoding several tensors' values
    in one call finds each one's bytes from the counts."""
    if not values.numel():
        return torch.empty(0, dtype=torch.uint8, device=values.device), torch.zeros_like(values)
    longest = max(1, (int(values.max()).bit_length() + 6) // 7)
    n_bytes = torch.ones_like(values)
    for k in range(1, longest):  # usually 1-2 passes: gaps are small
        n_bytes += values >= (1 << (7 * k))
    ends = torch.cumsum(n_bytes, 0)
    out = torch.empty(int(ends[-1]), dtype=torch.uint8, device=values.device)
    starts = ends - n_bytes
    for k in range(longest):
        sel = torch.nonzero(n_bytes > k).view(-1) if k else None
        v = values if sel is None else values[sel]
        byte = (v >> (7 * k)) & 0x7F
        more = (n_bytes if sel is None else n_bytes[sel]) > k + 1
        pos = (starts if sel is None else starts[sel]) + k
        out[pos] = (byte | (more.to(torch.int64) << 7)).to(torch.uint8)
    return out, n_bytes


def varint_decode(data: torch.Tensor, count: int) -> torch.Tensor:
    """Inverse of varint_encode; CorruptPatchError unless exactly `count` well-formed values."""
    if data.numel() == 0 or int(data[-1]) & 0x80:
        raise CorruptPatchError("index stream ends inside a varint")
    ends = torch.nonzero((data & 0x80) == 0).view(-1)
    if ends.numel() != count:
        raise CorruptPatchError(f"index stream holds {ends.numel()} varints, header says {count}")
    starts = torch.cat([ends.new_zeros(1), ends[:-1] + 1])
    lengths = ends - starts + 1
    longest = int(lengths.max())
    if longest > _MAX_VARINT_BYTES:
        raise CorruptPatchError("varint longer than 9 bytes in index stream")
    if bool(((lengths > 1) & (data[ends] == 0)).any()):
        # A trailing zero group adds nothing: one value would have several encodings.
        raise CorruptPatchError("over-long varint (last byte 0x00) in index stream")
    values = (data[starts] & 0x7F).to(torch.int64)
    for k in range(1, longest):
        sel = torch.nonzero(lengths > k).view(-1)
        values[sel] |= (data[starts[sel] + k] & 0x7F).to(torch.int64) << (7 * k)
    return values


def planes_encode(u: torch.Tensor, width: int) -> torch.Tensor:
    """Byte-plane split: plane k = byte k of every value, planes low to high, concatenated.
    Pure byte moves on the int64 little-endian layout (CPU and CUDA are little-endian)."""
    return u.contiguous().view(torch.uint8).view(-1, 8)[:, :width].t().contiguous().view(-1)


def planes_decode(data: torch.Tensor, width: int) -> torch.Tensor:
    out = torch.zeros(data.numel() // width, 8, dtype=torch.uint8, device=data.device)
    out[:, :width] = data.view(width, -1).t()
    return out.view(torch.int64).view(-1)


def _compressor() -> zstandard.ZstdCompressor:
    # ZstdCompressor objects must not be shared between threads.
    c = getattr(_local, "compressor", None)
    if c is None:
        c = _local.compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True)
    return c


def compress(raw: bytes) -> bytes:
    return _compressor().compress(raw)


def decompress(data: bytes | memoryview, raw_length: int, what: str) -> bytes:
    """A stream is exactly one standard zstd frame, without dictionary, whose declared content
    size is `raw_length` (docs/patch-format.md §3): other frames, skippable frames and trailing
    bytes are refused, so every reader decodes the same bytes."""
    if bytes(data[:4]) != ZSTD_MAGIC:
        raise CorruptPatchError(f"{what}: not a zstd frame")
    try:
        frame = zstandard.get_frame_parameters(data)
        if frame.content_size != raw_length:
            declared = "none" if frame.content_size == zstandard.CONTENTSIZE_UNKNOWN else frame.content_size
            raise CorruptPatchError(f"{what}: zstd frame declares {declared} bytes, header says {raw_length}")
        if frame.dict_id:
            raise CorruptPatchError(f"{what}: zstd frame needs a dictionary")
        out = zstandard.ZstdDecompressor().decompress(
            data, max_output_size=raw_length, allow_extra_data=False
        )
    except zstandard.ZstdError as e:
        raise CorruptPatchError(f"{what}: zstd: {e}") from e
    if len(out) != raw_length:
        raise CorruptPatchError(f"{what}: {len(out)} bytes decoded, header says {raw_length}")
    return out


@dataclass
class RawChange:
    """One tensor's changed elements before entropy coding (uint8 tensors on the host)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    count: int
    index_raw: torch.Tensor
    values_raw: torch.Tensor | None
    bitdelta_raw: torch.Tensor | None
    ctx: ctxans.CtxInput | None = None  # what `ctxans` codes (bf16 with the base at hand)


def raw_change(
    name: str, shape: tuple[int, ...], dtype: str, width: int, indices: torch.Tensor, *,
    new_u: torch.Tensor | None = None, delta: torch.Tensor | None = None,
) -> RawChange:
    """Gap varints and byte planes (on the tensors' device, then moved to the host) of the elements
    at `indices` (sorted flat): `values` from new_u, `bitdelta` from delta (signed, wrapped)."""
    gaps = torch.diff(indices, prepend=indices.new_full((1,), -1)) - 1
    zstd = new_u is not None or delta is not None  # else only `ctxans` codes it: no gap varints
    return RawChange(
        name, tuple(shape), dtype, indices.numel(),
        varint_encode(gaps).cpu() if zstd else torch.empty(0, dtype=torch.uint8),
        None if new_u is None else planes_encode(new_u, width).cpu(),
        None if delta is None else planes_encode(zigzag(delta), width).cpu(),
    )


def sparse_delta(old_u: torch.Tensor, new_u: torch.Tensor, width: int) -> torch.Tensor:
    """(new - old) mod 2**(8*width) as a signed integer: the bitdelta of unsigned bit patterns."""
    return _wrap_signed(new_u - old_u, width)


def _entropy_code(raw: RawChange, ctx_streams: tuple[bytes, bytes] | None) -> EncodedTensor:
    """The smallest of the codings the raw change carries (index + payload bytes); on a tie the
    earlier of ctxans, bitdelta, values."""
    coded: list[tuple[int, str, bytes, int, bytes, int]] = []
    if ctx_streams is not None:
        i, p = ctx_streams
        coded.append((len(i) + len(p), "ctxans", i, len(i), p, len(p)))
    options = [
        (e, r) for e, r in (("bitdelta", raw.bitdelta_raw), ("values", raw.values_raw)) if r is not None
    ]
    if options:
        index = compress(raw.index_raw.numpy().tobytes())
        coded += [(len(index) + len(c), e, index, raw.index_raw.numel(), c, r.numel())
                  for e, r in options for c in [compress(r.numpy().tobytes())]]
    _, encoding, index, index_raw_length, payload, payload_raw_length = min(coded, key=lambda x: x[0])
    return EncodedTensor(
        raw.name, raw.shape, raw.dtype, encoding, raw.count, index, index_raw_length, payload,
        payload_raw_length,
    )


def entropy_code(raws: list[RawChange]) -> list[EncodedTensor]:
    """zstd every stream, tensors in parallel (zstd releases the GIL), and rANS-code every tensor
    that carries a `ctxans` input in one batched pass; `auto` keeps the smallest per tensor."""
    inputs = {r.name: r.ctx for r in raws if r.ctx is not None}
    ctx_coded = dict(zip(inputs, ctxans.encode_tensors(list(inputs.values())), strict=True))
    return list(_POOL.map(lambda r: _entropy_code(r, ctx_coded.get(r.name)), raws))


def check_pair(name: str, old: torch.Tensor, new: torch.Tensor) -> str:
    if old.shape != new.shape or old.dtype != new.dtype:
        raise TensorMismatchError(
            f"{name}: old {tuple(old.shape)} {old.dtype} vs new {tuple(new.shape)} {new.dtype}"
        )
    return dtype_name(new.dtype)


def changed_indices(
    old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], *, batched: bool | None = None
) -> dict[str, torch.Tensor]:
    """Sorted flat indices (int64, on the old tensor's device) of the elements whose bit patterns
    differ, for every tensor with at least one change, in name order. Checks names, shapes, dtypes.

    `batched` (default: for tensors off the CPU) is built for GPUs, where one nonzero per tensor
    costs a launch-bound host sync: each tensor is compared by one kernel into a mask shared by
    the tensors of its size; then one count and one nonzero_static (sized by the counts, so no
    sync) per mask; all counts reach the host in one transfer per _MASK_BYTES of masks (one for a
    1.7B model). On a CPU there is no sync to save, and counting bool masks costs more than a
    nonzero per tensor (measured), so it compares and calls nonzero tensor by tensor."""
    if set(old) != set(new):
        missing = sorted(set(old) ^ set(new))[:5]
        raise UnknownTensorError(f"old and new have different tensor names, e.g. {missing}")
    names = sorted(new)
    by_size: dict[tuple[torch.device, int], list[str]] = {}
    for name in names:
        check_pair(name, old[name], new[name])
        by_size.setdefault((old[name].device, old[name].numel()), []).append(name)
    found: dict[str, torch.Tensor] = {}
    if batched is None:
        batched = any(device.type != "cpu" for device, _ in by_size)
    if not batched:
        for name in names:
            indices = torch.nonzero(bits(old[name]) != bits(new[name].to(old[name].device))).view(-1)
            if indices.numel():
                found[name] = indices
        return found
    pending: list[tuple[list[str], torch.Tensor]] = []
    held = 0
    for (device, numel), members in by_size.items():
        if numel == 0:
            continue
        per_mask = max(1, _MASK_BYTES // numel)
        for start in range(0, len(members), per_mask):
            batch = members[start : start + per_mask]
            mask = torch.empty(len(batch), numel, dtype=torch.bool, device=device)
            for row, name in enumerate(batch):
                torch.ne(bits(old[name]), bits(new[name].to(device)), out=mask[row])
            pending.append((batch, mask))
            held += mask.numel()
            if held >= _MASK_BYTES:
                _collect_changes(pending, found)
                pending, held = [], 0
    _collect_changes(pending, found)
    return {name: found[name] for name in names if name in found}


def _collect_changes(pending: list[tuple[list[str], torch.Tensor]], found: dict[str, torch.Tensor]) -> None:
    if not pending:
        return
    counts = [mask.sum(dim=1) for _, mask in pending]
    host_counts = torch.cat([c.to(counts[0].device, non_blocking=True) for c in counts]).tolist()  # the sync
    at = 0
    for batch, mask in pending:
        batch_counts, at = host_counts[at : at + len(batch)], at + len(batch)
        total = sum(batch_counts)
        if not total:
            continue
        flat = torch.nonzero_static(mask.view(-1), size=total).view(-1)
        local = flat if len(batch) == 1 else flat % mask.shape[1]  # rows are tensors, in order
        for name, indices in zip(batch, local.split(batch_counts), strict=True):
            if indices.numel():
                found[name] = indices


def _fused_applies(new: Mapping[str, torch.Tensor]) -> bool:
    return fused.available() and any(t.device.type == "cuda" for t in new.values())


def changed_indices_and_fingerprint(
    old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], str]:
    """(changed_indices(old, new), fingerprint(new)). On a CUDA device with Triton, one fused pass
    over both copies (fused.py: no model-size intermediates, one host sync) for every tensor it
    takes, the torch paths for the rest; elsewhere the torch paths. Same results, bit for bit."""
    if not _fused_applies(new):
        return changed_indices(old, new), fingerprint(new)
    if set(old) != set(new):
        changed_indices(old, new)  # raises the usual error
    for name in new:
        check_pair(name, old[name], new[name])
    names = sorted(new)
    taken = [n for n in names if fused.fusable(old[n], new[n])]
    rest = [n for n in names if n not in set(taken)]
    found, sums = fused.extract_and_sums({n: old[n] for n in taken}, {n: new[n] for n in taken})
    if rest:  # the few odd tensors (views, tails): their own syncs
        found.update(changed_indices({n: old[n] for n in rest}, {n: new[n] for n in rest}))
        by_device: dict[torch.device, list[str]] = {}
        for n in rest:
            by_device.setdefault(new[n].device, []).append(n)
        for members in by_device.values():
            sums.update(zip(members, device_sums([new[n] for n in members]).cpu().tolist(), strict=True))
    return {n: found[n] for n in names if n in found}, digest(new, sums)


def diff_states(
    old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], encoding: Encoding,
    changed: Mapping[str, torch.Tensor] | None = None,
) -> list[RawChange]:
    """Raw changes of every tensor that differs bitwise (compared as integers on their device);
    `changed`: changed_indices(old, new) when the caller already has them. `ctxans` codes the
    tensors it supports (bf16) and `bitdelta` the others."""
    raws = []
    for name, indices in (changed_indices(old, new) if changed is None else changed).items():
        ob, nb = bits(old[name]), bits(new[name].to(old[name].device))
        width = nb.element_size()
        dtype = dtype_name(new[name].dtype)
        ctx = encoding in ("auto", "ctxans") and ctxans.supports(dtype, nb.numel())
        new_u = to_unsigned(nb[indices], width)
        delta = None
        if encoding != "values":
            delta = sparse_delta(to_unsigned(ob[indices], width), new_u, width)
        zstd = encoding in ("auto", "zstd") or not ctx
        raw = raw_change(name, tuple(new[name].shape), dtype, width, indices,
                         new_u=new_u if zstd and encoding in ("auto", "zstd", "values") else None,
                         delta=delta if zstd and encoding != "values" else None)
        if ctx:
            raw.ctx = ctxans.CtxInput(ob, indices, zigzag(delta))  # type: ignore[arg-type]
        raws.append(raw)
    return raws


def dense_bytes(state: Mapping[str, torch.Tensor]) -> int:
    """Bytes of a whole state, dense: what a patch is measured against."""
    return sum(t.numel() * t.element_size() for t in state.values())


def extract_patch(
    old: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    *,
    run: str,
    base_version: int,
    target_version: int,
    encoding: Encoding = "zstd",
    base_fingerprint: str | None = None,
    target_fingerprint: str | None = None,
    chunk_bytes: int = CHUNK_BYTES,
) -> bytes:
    """The patch turning `old` into `new` (same names, shapes, dtypes), as container bytes.
    `encoding`: "zstd" (default) takes the smaller of values and bitdelta per tensor, fast; "auto"
    also tries ctxans (fewest bytes, several times slower to code and decode)."""
    if encoding not in ("auto", "zstd", *ENCODINGS):
        raise FormatError(f"unknown encoding {encoding!r}")
    with torch.no_grad():
        if target_fingerprint is None or _fused_applies(new):  # fused: the fingerprint costs no extra pass
            indices, target_fp = changed_indices_and_fingerprint(old, new)
            target_fp = target_fingerprint or target_fp
        else:
            indices, target_fp = changed_indices(old, new), target_fingerprint
        raws = diff_states(old, new, encoding, indices)
        base_fp = base_fingerprint or fingerprint(old)
    return build_patch(
        entropy_code(raws), run=run, base_version=base_version, base_fingerprint=base_fp,
        target_version=target_version, target_fingerprint=target_fp, chunk_bytes=chunk_bytes,
        dense_bytes=dense_bytes(new),
        numel=sum(t.numel() for t in new.values()),
    )


def build_patch(
    encoded: list[EncodedTensor], *, run: str, base_version: int, base_fingerprint: str,
    target_version: int, target_fingerprint: str, chunk_bytes: int, dense_bytes: int, numel: int,
) -> bytes:
    header = PatchHeader(
        run=run, base_version=base_version, base_fingerprint=base_fingerprint,
        target_version=target_version, target_fingerprint=target_fingerprint,
        dense_bytes=dense_bytes, numel=numel, changed=sum(e.count for e in encoded),
        tensors=[], chunks=[], chunk_bytes=chunk_bytes,
    )
    return write_patch(header, encoded)


@dataclass
class DecodedTensor:
    """One tensor's change, decoded and validated against its model tensor, not yet written."""

    name: str
    indices: torch.Tensor  # int64, sorted, on the model tensor's device
    new_bits: torch.Tensor  # integer view dtype
    old_bits: torch.Tensor  # what is there now (to restore on failure)


def decode_streams(
    entry: TensorEntry, index: bytes | memoryview, payload: bytes | memoryview
) -> tuple[bytes, bytes]:
    return (
        decompress(index, entry.index.raw_length, f"{entry.name}: index stream"),
        decompress(payload, entry.payload.raw_length, f"{entry.name}: payload stream"),
    )


def decode_sparse(
    entry: TensorEntry, index_raw: bytes, payload_raw: bytes, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted flat indices, payload) of one entry; payload = new unsigned bits (`values`) or the
    signed delta (`bitdelta`), as int64 on `device`. Validates indices against the entry's shape.
    Not for `ctxans` entries: they need their base tensor (decode_ctxans)."""
    if entry.encoding == "ctxans":
        raise FormatError(f"{entry.name}: a ctxans entry decodes only against its base tensor")
    width = WIDTHS[entry.dtype]
    gaps = varint_decode(torch.frombuffer(bytearray(index_raw), dtype=torch.uint8).to(device), entry.count)
    numel = prod(entry.shape)
    if int(gaps.max()) >= numel:
        raise CorruptPatchError(f"{entry.name}: index gap beyond the tensor")
    indices = torch.cumsum(gaps + 1, 0) - 1
    if int(indices[-1]) >= numel:
        raise CorruptPatchError(f"{entry.name}: index {int(indices[-1])} beyond {numel} elements")
    if indices.numel() > 1 and not bool((indices[1:] > indices[:-1]).all()):
        raise CorruptPatchError(f"{entry.name}: index sum overflows")  # int64 wrap-around
    u = planes_decode(torch.frombuffer(bytearray(payload_raw), dtype=torch.uint8).to(device), width)
    return indices, unzigzag(u) if entry.encoding == "bitdelta" else u


def decode_tensor(
    entry: TensorEntry, index_raw: bytes, payload_raw: bytes, target: torch.Tensor
) -> DecodedTensor:
    """Indices and new bit patterns for `target`, validated; reads but never writes `target`."""
    _check_target(entry, target)
    indices, u = decode_sparse(entry, index_raw, payload_raw, target.device)
    width = target.element_size()
    old_bits = bits(target)[indices]
    if entry.encoding == "bitdelta":
        u = to_unsigned(old_bits, width) + u
    return DecodedTensor(entry.name, indices, from_unsigned(u, width), old_bits)


def stream_bytes(data: bytes | memoryview, header: PatchHeader, stream: Stream) -> memoryview:
    start = header.header_bytes + stream.offset
    return memoryview(data)[start : start + stream.length]


def _check_target(entry: TensorEntry, target: torch.Tensor) -> None:
    if tuple(target.shape) != entry.shape or dtype_name(target.dtype) != entry.dtype:
        raise TensorMismatchError(
            f"{entry.name}: model has {tuple(target.shape)} {target.dtype}, patch {entry.shape} {entry.dtype}"
        )


def decode_ctxans(
    data: bytes | memoryview, header: PatchHeader, entries: list[TensorEntry],
    state: Mapping[str, torch.Tensor],
) -> list[DecodedTensor]:
    """Decode `ctxans` entries against their base tensors in `state` (all in one rANS pass)."""
    for e in entries:
        _check_target(e, state[e.name])
    items = [
        ctxans.CtxStreams(e.name, e.count, stream_bytes(data, header, e.index),
                          stream_bytes(data, header, e.payload), bits(state[e.name]))
        for e in entries
    ]
    decoded = ctxans.decode_tensors(items)
    olds = [bits(state[e.name])[indices] for e, (indices, _) in zip(entries, decoded, strict=True)]
    # The new bit patterns of every entry in one pass (per entry: four small ops, ~200 entries).
    new = from_unsigned(to_unsigned(torch.cat(olds), 2) + unzigzag(torch.cat([z for _, z in decoded])), 2)
    return [DecodedTensor(e.name, indices, n, old)
            for e, (indices, _), n, old in zip(entries, decoded, new.split([o.numel() for o in olds]), olds,
                                               strict=True)]


def decode_patch(
    data: bytes | memoryview, header: PatchHeader, state: Mapping[str, torch.Tensor]
) -> list[DecodedTensor]:
    """Decode every tensor of a (checksum-verified) patch against `state`, writing nothing."""
    for entry in header.tensors:
        if entry.name not in state:
            raise UnknownTensorError(f"patch changes {entry.name!r}, which the model does not have")
    zstd = [e for e in header.tensors if e.encoding != "ctxans"]
    raws = list(
        _POOL.map(
            lambda e: decode_streams(
                e, stream_bytes(data, header, e.index), stream_bytes(data, header, e.payload)
            ),
            zstd,
        )
    )
    decoded = {e.name: decode_tensor(e, i, p, state[e.name]) for e, (i, p) in zip(zstd, raws, strict=True)}
    by_device: dict[torch.device, list[TensorEntry]] = {}
    for e in header.tensors:
        if e.encoding == "ctxans":
            by_device.setdefault(state[e.name].device, []).append(e)
    for entries in by_device.values():
        decoded.update((d.name, d) for d in decode_ctxans(data, header, entries, state))
    return [decoded[e.name] for e in header.tensors]
