"""Merge a chain of patches v→v+1→…→v+k into one v→v+k patch.

Each tensor's chain is folded into one sparse map position → ("set" new bits | "add" delta):
set∘anything-set = set, set then add = set(bits + delta), add then add = add(sum), add then set =
set. With the base weights every position resolves to final bits, positions back at their base
value are dropped, and each tensor is re-encoded with the smallest encoding (`ctxans` included).
Without the base, a tensor whose folded map is all "set" is written as `values` and all "add" as
`bitdelta`; a mix needs the base. A chain with `ctxans` tensors needs the base too (each patch's
contexts are the weights it applies to): the chain is applied to a copy of the changed tensors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

import shared.patch.ctxans as ctxans

from .codec import (
    RawChange,
    bits,
    build_patch,
    decode_patch,
    decode_sparse,
    decode_streams,
    diff_states,
    dtype_name,
    entropy_code,
    raw_change,
    sparse_delta,
    stream_bytes,
    to_unsigned,
    zigzag,
)
from .errors import PatchError, TensorMismatchError, WrongBaseError
from .fingerprint import fingerprint
from .format import WIDTHS, PatchHeader, TensorEntry, parse_patch


@dataclass
class _Folded:
    shape: tuple[int, ...]
    dtype: str
    indices: torch.Tensor  # sorted flat int64
    is_set: torch.Tensor  # bool: value holds new bits (else a delta)
    value: torch.Tensor  # int64


def _fold(prev: _Folded | None, entry: TensorEntry, indices: torch.Tensor, payload: torch.Tensor) -> _Folded:
    if prev is None:
        is_set = torch.full_like(indices, entry.encoding == "values", dtype=torch.bool)
        return _Folded(entry.shape, entry.dtype, indices, is_set, payload)
    if (prev.shape, prev.dtype) != (entry.shape, entry.dtype):
        raise TensorMismatchError(f"{entry.name}: shape/dtype changes along the chain")
    union, where = torch.unique(torch.cat([prev.indices, indices]), return_inverse=True)  # sorted
    is_set = torch.zeros(union.numel(), dtype=torch.bool)
    value = torch.zeros(union.numel(), dtype=torch.int64)
    at_prev, at_new = where[: prev.indices.numel()], where[prev.indices.numel() :]
    is_set[at_prev], value[at_prev] = prev.is_set, prev.value
    if entry.encoding == "values":
        is_set[at_new], value[at_new] = True, payload
    else:
        value[at_new] += payload  # wraps mod 2**64; reduced mod the dtype width at the end
    return _Folded(entry.shape, entry.dtype, union, is_set, value)


def _headers_chain(headers: Sequence[PatchHeader]) -> None:
    for a, b in zip(headers, headers[1:], strict=False):
        if a.run != b.run or a.target_version != b.base_version or a.target_fingerprint != b.base_fingerprint:
            raise WrongBaseError(
                f"not a chain: {a.run}:{a.base_version}->{a.target_version} then "
                f"{b.run}:{b.base_version}->{b.target_version}"
            )


def _resolve(name: str, f: _Folded, base: Mapping[str, torch.Tensor] | None) -> RawChange | None:
    width = WIDTHS[f.dtype]
    mask = (1 << (8 * width)) - 1 if width < 8 else -1
    if base is not None:
        if name not in base:
            raise WrongBaseError(f"base has no tensor {name!r}")
        t = base[name]
        if tuple(t.shape) != f.shape or dtype_name(t.dtype) != f.dtype:
            raise TensorMismatchError(
                f"{name}: base is {tuple(t.shape)} {t.dtype}, patches {f.shape} {f.dtype}"
            )
        old_u = to_unsigned(bits(t)[f.indices.to(t.device)].cpu(), width)
        new_u = torch.where(f.is_set, f.value, old_u + f.value) & mask
        keep = torch.nonzero(new_u != old_u).view(-1)
        if not keep.numel():
            return None
        new_u, old_u = new_u[keep], old_u[keep]
        delta = sparse_delta(old_u, new_u, width)
        raw = raw_change(name, f.shape, f.dtype, width, f.indices[keep], new_u=new_u, delta=delta)
        if ctxans.supports(f.dtype, t.numel()):
            raw.ctx = ctxans.CtxInput(bits(t), f.indices[keep].to(t.device), zigzag(delta).to(t.device))
        return raw
    if bool(f.is_set.all()):
        return raw_change(name, f.shape, f.dtype, width, f.indices, new_u=f.value & mask)
    if bool(f.is_set.any()):
        raise PatchError(f"{name}: merging `values` and `bitdelta` changes needs the base weights")
    delta = sparse_delta(torch.zeros_like(f.value), f.value & mask, width)
    keep = torch.nonzero(delta).view(-1)
    if not keep.numel():
        return None
    return raw_change(name, f.shape, f.dtype, width, f.indices[keep], delta=delta[keep])


def _fold_chain(
    patches: Sequence[bytes | memoryview], headers: list[PatchHeader], base: Mapping[str, torch.Tensor] | None
) -> list[RawChange]:
    folded: dict[str, _Folded] = {}
    for data, header in zip(patches, headers, strict=True):
        for entry in header.tensors:
            index_raw, payload_raw = decode_streams(
                entry, stream_bytes(data, header, entry.index), stream_bytes(data, header, entry.payload)
            )
            indices, payload = decode_sparse(entry, index_raw, payload_raw, torch.device("cpu"))
            folded[entry.name] = _fold(folded.get(entry.name), entry, indices, payload)
    return [r for name in sorted(folded) if (r := _resolve(name, folded[name], base)) is not None]


def _replay(
    patches: Sequence[bytes | memoryview], headers: list[PatchHeader], base: Mapping[str, torch.Tensor] | None
) -> list[RawChange]:
    """Apply the chain to a copy of the tensors it changes; the raw changes from base to the end."""
    if base is None:
        raise PatchError("merging a chain with `ctxans` tensors needs the base weights")
    names = sorted({e.name for h in headers for e in h.tensors})
    missing = [n for n in names if n not in base]
    if missing:
        raise WrongBaseError(f"base has no tensor {missing[0]!r}")
    start = {n: base[n] for n in names}
    state = {n: t.clone() for n, t in start.items()}
    for data, header in zip(patches, headers, strict=True):
        for d in decode_patch(data, header, state):
            bits(state[d.name])[d.indices] = d.new_bits
    return diff_states(start, state, "auto")


def merge_patches(
    patches: Sequence[bytes | memoryview], base: Mapping[str, torch.Tensor] | None = None, *,
    chunk_bytes: int | None = None,
) -> bytes:
    """One patch from the first patch's base to the last one's target. With `base` (the weights at
    the first base version) the result is minimal: positions that returned to their base bits are
    dropped."""
    if not patches:
        raise PatchError("nothing to merge")
    headers = [parse_patch(p) for p in patches]
    _headers_chain(headers)
    first, last = headers[0], headers[-1]
    with torch.no_grad():
        if base is not None and fingerprint(base) != first.base_fingerprint:
            raise WrongBaseError(f"base weights are not {first.base_fingerprint}")
        if any(e.encoding == "ctxans" for h in headers for e in h.tensors):
            raws = _replay(patches, headers, base)
        else:
            raws = _fold_chain(patches, headers, base)
    merged = build_patch(
        entropy_code(raws), run=first.run, base_version=first.base_version,
        base_fingerprint=first.base_fingerprint, target_version=last.target_version,
        target_fingerprint=last.target_fingerprint, chunk_bytes=chunk_bytes or first.chunk_bytes,
        dense_bytes=last.dense_bytes, numel=last.numel,
    )
    return merged
