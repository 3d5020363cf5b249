"""Change extraction and the fingerprint of the new weights in one pass over both copies (CUDA, Triton).

`changed_indices` plus `fingerprint(new)` read the two bf16 copies of a model several times and
materialise model-size masks and int64 word buffers. Here two Triton kernels over all tensors at
once (a table of tensor addresses, one program per block of 64-bit words) do the same work:

1. scan: read old and new words once; per block, write the changed-element bits (1 bit per
   element, 1/16 of a bf16 model), the count of changed elements and the fingerprint's partial
   sum S_block = sum_i x_i * A[i % 1024] * B[i // 1024] over the block's words of `new`
   (fingerprint.py defines x, A, B; the sum is mod 2**64, so any order gives the same S).
2. compact: from the bits and each block's exclusive prefix of counts, write the sorted flat
   indices of every changed element into one buffer, which is split per tensor.

Between them, one host transfer of the per-tensor counts and sums sizes the output; results equal
`changed_indices(old, new)` and `fingerprint(new)` bit for bit. Only tensors that are contiguous,
on one CUDA device, 8-byte aligned and a whole number of words long take the kernels (every weight
of the supported models); codec.changed_indices_and_fingerprint sends any other through the torch
paths, so callers need not care.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import torch

from .fingerprint import _COLUMN_MULTIPLIERS, _ROW

BLOCK_WORDS = 2048  # words per program: 2 multiplier rows, 16 KiB of each copy
_WORD = 8

try:  # Triton ships with CUDA builds of torch; CPU-only installs use the torch paths.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def available() -> bool:
    return triton is not None and torch.cuda.is_available()


def fusable(old: torch.Tensor, new: torch.Tensor) -> bool:
    """Whether the kernels take this pair (else codec uses the torch paths for it)."""
    n_bytes = new.numel() * new.element_size()
    return (
        old.device == new.device
        and new.device.type == "cuda"
        and old.is_contiguous()
        and new.is_contiguous()
        and n_bytes > 0
        and n_bytes % _WORD == 0
        and old.data_ptr() % _WORD == 0
        and new.data_ptr() % _WORD == 0
    )


if triton is not None:

    @triton.jit
    def _scan_kernel(old_table, new_table, words_table, blk_tensor, blk_word0, cols_ptr,
                     bits_out, count_out, sum_out,
                     ELEM: tl.constexpr, BW: tl.constexpr, ROW: tl.constexpr):
        pid = tl.program_id(0)
        t = tl.load(blk_tensor + pid)
        word0 = tl.load(blk_word0 + pid)
        n_words = tl.load(words_table + t)
        old_p = tl.load(old_table + t).to(tl.pointer_type(tl.int64))
        new_p = tl.load(new_table + t).to(tl.pointer_type(tl.int64))
        offs = tl.arange(0, BW)
        word = word0 + offs
        ok = word < n_words
        o = tl.load(old_p + word, mask=ok, other=0)
        n = tl.load(new_p + word, mask=ok, other=0)
        # Changed lanes (elements) of each word, as an EPW-bit nibble; element j is bits 8*ELEM*j...
        EPW: tl.constexpr = 8 // ELEM
        x = o ^ n
        nib = tl.zeros([BW], dtype=tl.int32)
        changed = tl.zeros([BW], dtype=tl.int32)
        for j in tl.static_range(EPW):
            if ELEM == 8:
                lane = x != 0
            else:
                lane = ((x >> (8 * ELEM * j)) & ((1 << (8 * ELEM)) - 1)) != 0
            nib += lane.to(tl.int32) << j
            changed += lane.to(tl.int32)
        tl.store(count_out + pid, tl.sum(changed))
        # Pack 32 / EPW nibbles per int32: bit k of mask int i is block element 32 * i + k.
        PER: tl.constexpr = 32 // EPW
        packed = tl.sum(tl.reshape(nib, (BW // PER, PER)) << (tl.arange(0, PER) * EPW)[None, :], axis=1)
        tl.store(bits_out + pid * (BW // PER) + tl.arange(0, BW // PER), packed)
        # Fingerprint partial sum of the new words (wrapping int64 arithmetic is mod 2**64).
        mixed = tl.reshape(n ^ (n >> 29), (BW // ROW, ROW))
        cols = tl.load(cols_ptr + tl.arange(0, ROW))
        row_sums = tl.sum(mixed * cols[None, :], axis=1)
        r = (word0 // ROW + tl.arange(0, BW // ROW) + 1).to(tl.int64) * -7046029254386353131
        r = (r ^ (r >> 29)) | 1
        tl.store(sum_out + pid, tl.sum(row_sums * r))

    @triton.jit
    def _popcount(x):
        """Set bits of each uint32 (SWAR)."""
        x = x - ((x >> 1) & 0x55555555)
        x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
        x = (x + (x >> 4)) & 0x0F0F0F0F
        return (x * 0x01010101) >> 24

    @triton.jit
    def _compact_kernel(bits_in, blk_word0, blk_offset, out, ELEM: tl.constexpr, BW: tl.constexpr):
        pid = tl.program_id(0)
        EPW: tl.constexpr = 8 // ELEM
        M: tl.constexpr = BW * EPW // 32
        # Each changed element's rank: the set bits of the mask words before its own, then of its
        # own word below it (a scan over M words, not over every element).
        packed = tl.load(bits_in + pid * M + tl.arange(0, M)).to(tl.uint32, bitcast=True)
        counts = _popcount(packed).to(tl.int64)
        before = tl.cumsum(counts, axis=0) - counts
        k = tl.arange(0, 32).to(tl.uint32)
        flags = (packed[:, None] >> k[None, :]) & 1
        below = _popcount(packed[:, None] & ((tl.full([1, 32], 1, tl.uint32) << k[None, :]) - 1)).to(tl.int64)
        slot = tl.load(blk_offset + pid) + before[:, None] + below
        element = tl.load(blk_word0 + pid) * EPW + tl.arange(0, M)[:, None] * 32 + k[None, :].to(tl.int64)
        tl.store(out + slot, element, mask=flags != 0)


@functools.lru_cache(maxsize=16)
def _plan(
    words: tuple[int, ...], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Blocks of a layout (words per tensor): (tensor of each block, its first word, words per
    tensor), on the device, and the number of blocks. Cached: a model's layout never changes."""
    counts = [-(-w // BLOCK_WORDS) for w in words]
    tensor = torch.repeat_interleave(torch.arange(len(words), dtype=torch.int32), torch.tensor(counts))
    first = torch.cat([torch.arange(c, dtype=torch.int64) * BLOCK_WORDS for c in counts])
    n_words = torch.tensor(words, dtype=torch.int64)
    return tensor.to(device), first.to(device), n_words.to(device), sum(counts)


@functools.lru_cache(maxsize=4)
def _columns(device: torch.device) -> torch.Tensor:
    return torch.from_numpy(_COLUMN_MULTIPLIERS).to(device)


def _group_scan(old: list[torch.Tensor], new: list[torch.Tensor], elem: int):
    device = new[0].device
    tensor_of, word0, n_words, blocks = _plan(tuple(t.numel() * elem // _WORD for t in new), device)
    addresses = torch.tensor([[t.data_ptr() for t in old], [t.data_ptr() for t in new]], dtype=torch.int64)
    if device.type == "cuda":  # pinned: the copy does not wait for the kernels queued before it
        addresses = addresses.pin_memory().to(device, non_blocking=True)
    epw = _WORD // elem
    bits = torch.empty(blocks * BLOCK_WORDS * epw // 32, dtype=torch.int32, device=device)
    count = torch.empty(blocks, dtype=torch.int32, device=device)
    sums = torch.empty(blocks, dtype=torch.int64, device=device)
    _scan_kernel[(blocks,)](addresses[0], addresses[1], n_words, tensor_of, word0, _columns(device),
                            bits, count, sums, ELEM=elem, BW=BLOCK_WORDS, ROW=_ROW, num_warps=8)
    tensor_of_long = tensor_of.long()
    per_tensor_count = torch.zeros(len(new), dtype=torch.int64, device=device).index_add_(
        0, tensor_of_long, count.long()
    )
    per_tensor_sum = torch.zeros(len(new), dtype=torch.int64, device=device).index_add_(
        0, tensor_of_long, sums
    )
    inclusive = torch.cumsum(count, 0)
    return bits, word0, inclusive - count, per_tensor_count, per_tensor_sum, blocks


def extract_and_sums(old: Mapping[str, torch.Tensor],
                     new: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """For tensors that are all `fusable`: (changed_indices(old, new), each new tensor's
    fingerprint sum S) in one pass. codec.changed_indices_and_fingerprint is the entry point."""
    names = sorted(new)
    groups: dict[tuple[torch.device, int], list[str]] = {}
    for name in names:
        groups.setdefault((new[name].device, new[name].element_size()), []).append(name)
    scans = [(elem, members, _group_scan([old[n] for n in members], [new[n] for n in members], elem))
             for (_, elem), members in groups.items()]
    found: dict[str, torch.Tensor] = {}
    sums: dict[str, int] = {}
    if not scans:
        return found, sums
    # The one sync: every group's per-tensor counts and sums in one transfer.
    host = torch.cat([torch.stack([s[3], s[4]]) for _, _, s in scans], dim=1).cpu().tolist()
    at = 0
    for elem, members, (bits, word0, offset, _, _, blocks) in scans:
        counts = host[0][at: at + len(members)]
        sums.update(zip(members, host[1][at: at + len(members)], strict=True))
        at += len(members)
        out = torch.empty(sum(counts), dtype=torch.int64, device=bits.device)
        if out.numel():
            _compact_kernel[(blocks,)](bits, word0, offset, out, ELEM=elem, BW=BLOCK_WORDS, num_warps=8)
        for name, indices in zip(members, out.split(counts), strict=True):
            if indices.numel():
                found[name] = indices
    return found, sums
