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
memory traffic to a few bytes per weight; tensors shorter than one 1024-word row (norms, biases)
are reduced together in one batched pass to save kernel launches.
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
        cached = _row_cache[device] = _row_multiplier_values(0, 1 << max(10, (count - 1).bit_length()), device)
    return cached[:count]


def _words(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as int64 words, the last one zero-padded (a copy only for the tail)."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
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


def tensor_sum(t: torch.Tensor) -> torch.Tensor:
    """S for one tensor, as a 0-d int64 tensor on the tensor's device (no host sync)."""
    words = _words(t)
    cols = _columns(words.device)
    n_rows, rest = divmod(words.numel(), _ROW)
    rows = _rows(n_rows + 1, words.device)
    parts = []
    for start in range(0, n_rows, _SLICE_ROWS):
        count = min(_SLICE_ROWS, n_rows - start)
        block = words[start * _ROW : (start + count) * _ROW].view(count, _ROW)
        parts.append(((_mix(block) * cols).sum(dim=1) * rows[start : start + count]).sum())
    if rest or not parts:
        parts.append((_mix(words[n_rows * _ROW :]) * cols[:rest]).sum() * rows[n_rows])
    return parts[0] if len(parts) == 1 else torch.stack(parts).sum()


def _short_sums(tensors: list[torch.Tensor]) -> torch.Tensor:
    """tensor_sum of many tensors of fewer than 1024 words each (same device), in one pass."""
    words = [_words(t) for t in tensors]
    device = words[0].device
    lengths = torch.tensor([w.numel() for w in words], dtype=torch.int64)
    starts = (torch.cumsum(lengths, 0) - lengths).to(device, non_blocking=True)
    segment = torch.repeat_interleave(torch.arange(len(words), device=device), lengths.to(device), output_size=int(lengths.sum()))
    flat = torch.cat(words)
    position = torch.arange(flat.numel(), device=device) - starts[segment]
    terms = _mix(flat) * _columns(device)[position]
    sums = torch.zeros(len(words), dtype=torch.int64, device=device).index_add_(0, segment, terms)
    return sums * _rows(1, device)[0]


def fingerprint(state: Mapping[str, torch.Tensor]) -> str:
    """"fp1-<32 hex>" over names (sorted), dtypes, shapes and exact bit patterns of all tensors."""
    names = sorted(state)
    host: dict[str, int] = {}
    for device in {state[n].device for n in names}:
        on_device = [n for n in names if state[n].device == device]
        short = [n for n in on_device if state[n].numel() * state[n].element_size() < 8 * _ROW]
        long = [n for n in on_device if n not in frozenset(short)]
        sums = [tensor_sum(state[n]) for n in long]
        if short:
            sums.append(_short_sums([state[n] for n in short]))
        # One host transfer per device instead of one sync per tensor.
        values = torch.cat([s.view(-1) for s in sums]).cpu().tolist() if sums else []
        host.update(zip(long + short, values, strict=True))
    h = hashlib.blake2b(digest_size=16, person=b"sparsecast-fp1")
    for name in names:
        t = state[name]
        h.update(f"{name}\0{str(t.dtype).removeprefix('torch.')}\0{tuple(t.shape)}\0".encode())
        h.update((host[name] & (2**64 - 1)).to_bytes(8, "little"))
    return FINGERPRINT_PREFIX + h.hexdigest()


def chunk_checksum(data: bytes | memoryview) -> str:
    """sha256 hex of one transferred chunk."""
    return hashlib.sha256(data).hexdigest()
