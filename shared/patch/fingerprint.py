"""Whole-model fingerprint at memory speed (CPU or CUDA) and per-chunk checksums.

Per tensor we reduce its raw bytes, read as little-endian 64-bit words w_i, to
S = sum_i x_i * m_i  (mod 2**64), with x_i = w_i ^ (w_i >> 29) (arithmetic shift) and an odd
multiplier m_i = A[i % 1024] * B[i // 1024] for every word position. Flipping any one bit of w_i
changes x_i (bit j <= 62 of x_i contains w_i's bit j; a flip of bit 63 flips bits 34..62), so x_i
changes by some D != 0 with |D| < 2**64, and D * m_i != 0 mod 2**64 because m_i is odd: any single
bit flip changes S. (Without the shift-xor, a flip of bit 63 would change S by 2**63 whatever the
position, so two sign flips would cancel.) Integer addition mod 2**64 is associative, so S is
the same on CPU and GPU and for any reduction order. The per-tensor sums are hashed with each
tensor's name, dtype and shape through blake2b. Reading 16-bit weights as 64-bit words keeps the
memory traffic to a few bytes per weight.

Speed on a GPU is bound by kernel launches, not memory, when tensors are reduced one by one (a
28-layer model has ~310 tensors but only ~11 distinct sizes), so on a GPU fingerprint() stacks
tensors of the same byte size into one int64 buffer (a copy: ~2 ms for 3.4 GB at H200 memory
speed) and reduces each stack with a handful of kernels, in place. On a CPU launches are cheap and
memory passes are not, so there each tensor is reduced alone (tensor_sum). Everywhere, tensors
shorter than one 1024-word row (norms, biases) are reduced together in one segmented pass, and all
sums reach the host in one transfer per device.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import numpy as np
import torch

FINGERPRINT_PREFIX = "fp1-"
_ROW = 1024  # words per row of the two-level multiplier table
_SLICE_ROWS = 1 << 16  # rows reduced at once: bounds the int64 temporaries to 512 MiB

# 1024 fixed odd 64-bit column multipliers (a seeded generator, identical everywhere).
_COLUMN_MULTIPLIERS = (
    np.random.default_rng(0x5EED_CA57).integers(0, 2**63, size=_ROW, dtype=np.int64) | 1
)
_column_cache: dict[torch.device, torch.Tensor] = {}


def _columns(device: torch.device) -> torch.Tensor:
    cached = _column_cache.get(device)
    if cached is None:
        cached = torch.from_numpy(_COLUMN_MULTIPLIERS).to(device)
        _column_cache[device] = cached
    return cached


def _row_multiplier_values(start: int, count: int, device: torch.device) -> torch.Tensor:
    # An odd, well-mixed multiplier per row (Weyl sequence step then xorshift; wraps mod 2**64).
    r = torch.arange(start + 1, start + count + 1, dtype=torch.int64, device=device)
    r = r * -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64
    r = r ^ (r >> 29)
    return r | 1


_row_cache: dict[torch.device, torch.Tensor] = {}


def _rows(count: int, device: torch.device) -> torch.Tensor:
    """B[0:count], cached per device (grown in powers of two)."""
    cached = _row_cache.get(device)
    if cached is None or cached.numel() < count:
        cached = _row_cache[device] = _row_multiplier_values(
            0, 1 << max(10, (count - 1).bit_length()), device
        )
    return cached[:count]


def _words(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as int64 words, the last one zero-padded (a copy only for the tail)."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    if raw.storage_offset() % 8:  # a view starting mid-word cannot be read as int64 in place
        raw = raw.clone()
    full = raw.numel() // 8 * 8
    words = raw[:full].view(torch.int64)
    if full == raw.numel():
        return words
    tail = torch.zeros(8, dtype=torch.uint8, device=t.device)
    tail[: raw.numel() - full] = raw[full:]
    return torch.cat([words, tail.view(torch.int64)])


def _mix(w: torch.Tensor) -> torch.Tensor:
    if w.device.type == "cpu":  # numpy's int64 shift/xor are several times faster than torch's on CPU
        a = w.numpy()
        return torch.from_numpy(a ^ (a >> 29))
    return w ^ (w >> 29)


def _mix_(w: torch.Tensor) -> torch.Tensor:
    """_mix in place (w may be a strided view of a buffer we own)."""
    if w.device.type == "cpu":
        a = w.numpy()
        np.bitwise_xor(a, a >> 29, out=a)
    else:
        w ^= w >> 29
    return w


def tensor_sum(t: torch.Tensor) -> torch.Tensor:
    """S for one tensor, as a 0-d int64 tensor on the tensor's device (no host sync)."""
    return _aligned_sum(_words(t), 0)


def _aligned_sum(words: torch.Tensor, first_row: int) -> torch.Tensor:
    """sum_i x_i * m_(first_row * 1024 + i) of int64 words starting on a row boundary."""
    cols = _columns(words.device)
    n_rows, rest = divmod(words.numel(), _ROW)
    rows = _rows(first_row + n_rows + 1, words.device)[first_row:]
    parts = []
    for start in range(0, n_rows, _SLICE_ROWS):
        count = min(_SLICE_ROWS, n_rows - start)
        block = words[start * _ROW : (start + count) * _ROW].view(count, _ROW)
        parts.append(((_mix(block) * cols).sum(dim=1) * rows[start : start + count]).sum())
    if rest or not parts:
        parts.append((_mix(words[n_rows * _ROW :]) * cols[:rest]).sum() * rows[n_rows])
    return parts[0] if len(parts) == 1 else torch.stack(parts).sum()


def word_sum_at(words: torch.Tensor, word_offset: int) -> torch.Tensor:
    """The part of a tensor's S contributed by `words` (int64) lying at word positions
    word_offset, word_offset + 1, ... of that tensor (a slice of it, e.g. one rank's shard):
    S is a sum over positions, so the parts of disjoint slices add up to tensor_sum."""
    head = min(words.numel(), -word_offset % _ROW)  # words before the next row boundary
    total = _aligned_sum(words[head:], (word_offset + head) // _ROW)
    if head:
        col = word_offset % _ROW
        row = _rows(word_offset // _ROW + 1, words.device)[word_offset // _ROW]
        total = total + (_mix(words[:head]) * _columns(words.device)[col : col + head]).sum() * row
    return total


def tensor_sum_at(t: torch.Tensor, word_offset: int) -> torch.Tensor:
    """word_sum_at of a tensor whose bytes start at 64-bit word `word_offset` of a larger tensor
    (its last word zero-padded, as tensor_sum pads the whole tensor's)."""
    return word_sum_at(_words(t), word_offset)


def _short_sums(tensors: list[torch.Tensor]) -> torch.Tensor:
    """tensor_sum of many tensors of fewer than 1024 words each (same device), in one pass."""
    words = [_words(t) for t in tensors]
    device = words[0].device
    lengths = torch.tensor([w.numel() for w in words], dtype=torch.int64)
    starts = (torch.cumsum(lengths, 0) - lengths).to(device, non_blocking=True)
    # non_blocking: a plain host-to-GPU copy would wait for every kernel queued before it.
    segment = torch.repeat_interleave(
        torch.arange(len(words), device=device),
        lengths.to(device, non_blocking=True),
        output_size=int(lengths.sum()),
    )
    flat = torch.cat(words)
    position = torch.arange(flat.numel(), device=device) - starts[segment]
    terms = _mix(flat) * _columns(device)[position]
    sums = torch.zeros(len(words), dtype=torch.int64, device=device).index_add_(0, segment, terms)
    return sums * _rows(1, device)[0]


def _stacked_words(tensors: list[torch.Tensor], n_words: int) -> torch.Tensor:
    """[k, n_words] int64: the bytes of k tensors of one byte size, each zero-padded to whole
    words. Always a fresh buffer, so callers may mix it in place."""
    raws = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    n_bytes = raws[0].numel()
    if n_bytes == 8 * n_words and all(r.storage_offset() % 8 == 0 for r in raws):
        return torch.stack([r.view(torch.int64) for r in raws])  # 8-byte elements: wide copies
    out = torch.zeros(len(raws), 8 * n_words, dtype=torch.uint8, device=raws[0].device)
    out[:, :n_bytes] = torch.stack(raws)  # rare: a tail word or a view starting mid-word
    return out.view(torch.int64)


def _stack_sums(tensors: list[torch.Tensor], n_words: int) -> torch.Tensor:
    """tensor_sum of k tensors of the same byte size (>= one row), as a [k] int64 tensor: one
    stack and ~8 kernels per 2**16 rows instead of ~8 kernels per tensor."""
    w = _stacked_words(tensors, n_words)
    k, device = w.shape[0], w.device
    cols = _columns(device)
    n_rows, rest = divmod(n_words, _ROW)
    rows = _rows(n_rows + 1, device)
    total: torch.Tensor | None = None
    for start in range(0, n_rows, _SLICE_ROWS):
        count = min(_SLICE_ROWS, n_rows - start)
        block = _mix_(w[:, start * _ROW : (start + count) * _ROW].view(k, count, _ROW))
        part = (block.mul_(cols).sum(dim=2) * rows[start : start + count]).sum(dim=1)
        total = part if total is None else total + part
    if rest:
        tail = _mix_(w[:, n_rows * _ROW :])
        part = tail.mul_(cols[:rest]).sum(dim=1) * rows[n_rows]
        total = part if total is None else total + part
    assert total is not None  # n_words >= _ROW
    return total


def device_sums(tensors: list[torch.Tensor], *, stacked: bool | None = None) -> torch.Tensor:
    """[tensor_sum(t) for t in tensors] as one int64 tensor (all on one device), no host sync.
    Those shorter than a row go through one segmented pass. With `stacked` (default: off the CPU,
    where launches, not memory passes, are the cost) tensors of one byte size are stacked, at most
    2**16 rows (512 MiB) per stack; on a CPU the stack copy costs more than it saves (measured)."""
    if not tensors:
        return torch.zeros(0, dtype=torch.int64)
    device = tensors[0].device
    if stacked is None:
        stacked = device.type != "cpu"
    by_size: dict[int, list[int]] = {}  # byte size (0: shorter than a row) -> tensor positions
    for i, t in enumerate(tensors):
        n_bytes = t.numel() * t.element_size()
        by_size.setdefault(n_bytes if n_bytes >= 8 * _ROW else 0, []).append(i)
    # The plan, on the host: (words per tensor, 0 for the short ones; tensor positions).
    batches: list[tuple[int, list[int]]] = []
    for n_bytes, members in by_size.items():
        n_words = (n_bytes + 7) // 8
        if not n_words:
            per_stack = len(members)  # the short ones: one segmented pass
        elif stacked:
            per_stack = max(1, _SLICE_ROWS // (n_words // _ROW))
        else:
            per_stack = 1
        batches += [
            (n_words, members[start : start + per_stack]) for start in range(0, len(members), per_stack)
        ]
    position = [0] * len(tensors)  # where each input's sum lands in the concatenated batch sums
    for j, i in enumerate(i for _, members in batches for i in members):
        position[i] = j
    gather = torch.tensor(position).to(device, non_blocking=True)  # copied before any kernel is queued
    parts = []
    for n_words, members in batches:
        batch = [tensors[i] for i in members]
        if not n_words:
            parts.append(_short_sums(batch))
        else:
            parts.append(_stack_sums(batch, n_words) if stacked else tensor_sum(batch[0]).view(1))
    return torch.cat(parts)[gather]


def tensor_sums(state: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """Each tensor's S, on the host (one transfer per device instead of one sync per tensor)."""
    names = sorted(state)
    host: dict[str, int] = {}
    for device in {state[n].device for n in names}:
        on_device = [n for n in names if state[n].device == device]
        host.update(zip(on_device, device_sums([state[n] for n in on_device]).cpu().tolist(), strict=True))
    return host


def fingerprint(state: Mapping[str, torch.Tensor]) -> str:
    """"fp1-<32 hex>" over names (sorted), dtypes, shapes and exact bit patterns of all tensors."""
    return digest(state, tensor_sums(state))


def words_at(elements: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """The int64 words at positions `words` of a tensor whose flat integer view (codec.bits) is
    `elements`, as _words reads them (the last one zero-padded): a gather, not a pass."""
    per_word = 8 // elements.element_size()
    lanes = words[:, None] * per_word + torch.arange(per_word, device=words.device)
    inside = lanes < elements.numel()
    gathered = torch.where(inside, elements[lanes.clamp(max=max(elements.numel() - 1, 0))], 0)
    return gathered.to(elements.dtype).contiguous().view(torch.int64).reshape(-1)


def change_sum(old_words: torch.Tensor, new_words: torch.Tensor, words: torch.Tensor,
               total_words: int) -> torch.Tensor:
    """How S changes when the int64 words at positions `words` (of a tensor of `total_words`) go from
    `old_words` to `new_words`: sum_i (x(new_i) - x(old_i)) * m_i mod 2**64, a 0-d tensor (no sync).
    S is a sum over positions, so S(new tensor) = S(old tensor) + change_sum(...)."""
    device = words.device
    if not words.numel():
        return torch.zeros((), dtype=torch.int64, device=device)
    multipliers = _columns(device)[words % _ROW] * _rows(total_words // _ROW + 1, device)[words // _ROW]
    return ((_mix(new_words) - _mix(old_words)) * multipliers).sum()


def digest(state: Mapping[str, torch.Tensor], sums: Mapping[str, int]) -> str:
    """The fingerprint from each tensor's S (as returned by device_sums, any integer form)."""
    return fingerprint_from_sums({n: (t.dtype, tuple(t.shape), int(sums[n])) for n, t in state.items()})


def fingerprint_from_sums(sums: Mapping[str, tuple[torch.dtype, tuple[int, ...], int]]) -> str:
    """fingerprint() from each tensor's dtype, shape and S (e.g. combined from shards' parts)."""
    h = hashlib.blake2b(digest_size=16, person=b"sparsecast-fp1")
    for name in sorted(sums):
        dtype, shape, total = sums[name]
        h.update(f"{name}\0{str(dtype).removeprefix('torch.')}\0{tuple(shape)}\0".encode())
        h.update((total & (2**64 - 1)).to_bytes(8, "little"))
    return FINGERPRINT_PREFIX + h.hexdigest()


def chunk_checksum(data: bytes | memoryview) -> str:
    """sha256 hex of one transferred chunk."""
    return hashlib.sha256(data).hexdigest()
