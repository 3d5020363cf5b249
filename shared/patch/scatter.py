"""The write of a staged patch as one scatter over all its tensors, and its read-back (CUDA, Triton).

A patch touches every tensor of a model (~310 for a 28-layer Qwen3); one indexed write per tensor
costs a launch each, several milliseconds of host time while generation waits. Here the staged
patch carries, per element size, one flat buffer of absolute addresses (the live tensor's
data_ptr + index * element size) and one of the new bit patterns; the write is one kernel that
stores each value at its address, and the check one kernel that reads every written element back
and counts those that differ. Both move only the changed elements (plus their addresses), so they
run at HBM speed on a GPU: the in-place write the rollout worker pauses for (shared.patch.apply).

Addresses are taken, and the kernels compiled, while staging; apply.commit_patch refuses a staged
patch whose tensors no longer live where they did. Tensors on a CPU (or without Triton) are
written per tensor by torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .fused import triton

BLOCK = 4096  # elements per program


@dataclass
class FlatWrite:
    """One element size's share of a patch: where each new value goes and what it is."""

    addresses: torch.Tensor  # int64 absolute byte addresses, on the device
    values: torch.Tensor  # the new bit patterns (integer view dtype of that element size)


def available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


if triton is not None:
    import triton.language as tl

    # n unspecialised: one compiled kernel per element size whatever the count (see _compile)
    @triton.jit(do_not_specialize=["n"])
    def _scatter_kernel(addresses, values, n, ELEM: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        address = tl.load(addresses + offs, mask=ok, other=0)
        value = tl.load(values + offs, mask=ok, other=0)
        if ELEM == 1:
            tl.store(address.to(tl.pointer_type(tl.int8)), value, mask=ok)
        elif ELEM == 2:
            tl.store(address.to(tl.pointer_type(tl.int16)), value, mask=ok)
        elif ELEM == 4:
            tl.store(address.to(tl.pointer_type(tl.int32)), value, mask=ok)
        else:
            tl.store(address.to(tl.pointer_type(tl.int64)), value, mask=ok)

    @triton.jit(do_not_specialize=["n"])
    def _readback_kernel(addresses, values, n, wrong, ELEM: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        address = tl.load(addresses + offs, mask=ok, other=0)
        value = tl.load(values + offs, mask=ok, other=0)
        # volatile: read what memory holds now, not a cached copy of the stores
        if ELEM == 1:
            got = tl.load(address.to(tl.pointer_type(tl.int8)), mask=ok, other=0, volatile=True)
        elif ELEM == 2:
            got = tl.load(address.to(tl.pointer_type(tl.int16)), mask=ok, other=0, volatile=True)
        elif ELEM == 4:
            got = tl.load(address.to(tl.pointer_type(tl.int32)), mask=ok, other=0, volatile=True)
        else:
            got = tl.load(address.to(tl.pointer_type(tl.int64)), mask=ok, other=0, volatile=True)
        bad = tl.sum(((got != value) & ok).to(tl.int32))
        tl.atomic_add(wrong, bad)


_compiled: set[tuple[torch.device, torch.dtype]] = set()


def _compile(device: torch.device, dtype: torch.dtype) -> None:
    """Compile both kernels for one element size on a scratch element, once per process: Triton
    compiles on first launch (~1 s), which must not land inside the first version's pause."""
    if (device, dtype) in _compiled:
        return
    scratch = torch.zeros(1, dtype=dtype, device=device)
    probe = FlatWrite(torch.tensor([scratch.data_ptr()], dtype=torch.int64, device=device), scratch.clone())
    write([probe])
    wrong_after_write([probe]).item()
    _compiled.add((device, dtype))


def flat_writes(parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> list[FlatWrite]:
    """(live tensor, sorted indices, new bits) per tensor, all on one CUDA device: one FlatWrite
    per element size (built while the weights still serve; the kernels compiled here too)."""
    by_size: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for target, indices, new_bits in parts:
        elem = target.element_size()
        addresses, values = by_size.setdefault(elem, ([], []))
        addresses.append(indices * elem + target.data_ptr())
        values.append(new_bits)
    writes = [FlatWrite(torch.cat(a), torch.cat(v)) for a, v in by_size.values()]
    for w in writes:
        _compile(w.values.device, w.values.dtype)
    return writes


def write(writes: list[FlatWrite]) -> None:
    """Store every value at its address (queued on the current stream; no host sync)."""
    for w in writes:
        n = w.values.numel()
        # Staged on a side stream: keep the buffers from being reused until this stream is done.
        w.addresses.record_stream(torch.cuda.current_stream(w.addresses.device))
        w.values.record_stream(torch.cuda.current_stream(w.values.device))
        if n:
            _scatter_kernel[(triton.cdiv(n, BLOCK),)](w.addresses, w.values, n,
                                                     ELEM=w.values.element_size(), BLOCK=BLOCK, num_warps=8)


def wrong_after_write(writes: list[FlatWrite]) -> torch.Tensor:
    """How many written elements do not hold their new value now, as a device int32 (no sync)."""
    device = writes[0].values.device
    wrong = torch.zeros(1, dtype=torch.int32, device=device)
    for w in writes:
        n = w.values.numel()
        if n:
            _readback_kernel[(triton.cdiv(n, BLOCK),)](w.addresses, w.values, n, wrong,
                                                      ELEM=w.values.element_size(), BLOCK=BLOCK, num_warps=8)
    return wrong
