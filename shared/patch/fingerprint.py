"""Whole-model fingerprint at memory speed (CPU or CUDA) and per-chunk checksums.

Per tensor we reduce its raw bytes, read as little-endian 64-bit words w_i, to
S = sum_i x_i * m_i  (mod 2**64), with x_i = w_i ^ (w_i >> 29) and an odd multiplier
m_i = A[i % 1024] * B[i // 1024] for every word position. The xorshift is a bijection, so flipping
any bit of w_i changes x_i by some D != 0 with |D| < 2**64, and D * m_i != 0 mod 2**64 because m_i
is odd: any single bit flip changes S. (Without the xorshift, a flip of bit 63 would change S by
2**63 whatever the position, so two sign flips of high elements would cancel.) Integer addition mod 2**64 is associative,
so the result is the same on CPU and GPU and for any reduction order. The per-tensor sums are then
hashed with each tensor's name, dtype and shape through blake2b. Reading 16-bit weights as 64-bit
words keeps the work per weight to about 6 bytes of memory traffic.
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


def _row_multipliers(start: int, count: int, device: torch.device) -> torch.Tensor:
    # An odd, well-mixed multiplier per row (Weyl sequence step then xorshift; wraps mod 2**64).
    r = torch.arange(start + 1, start + count + 1, dtype=torch.int64, device=device)
    r = r * -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64
    r = r ^ (r >> 29)
    return r | 1


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
    # xorshift with a logical right shift (mask off the sign copies): a bijection on 64 bits.
    return w ^ ((w >> 29) & 0x7_FFFF_FFFF)


def tensor_sum(t: torch.Tensor) -> torch.Tensor:
    """S for one tensor, as a 0-d int64 tensor on the tensor's device (no host sync)."""
    words = _words(t)
    cols = _columns(words.device)
    n_rows, rest = divmod(words.numel(), _ROW)
    total = torch.zeros((), dtype=torch.int64, device=words.device)
    for start in range(0, n_rows, _SLICE_ROWS):
        rows = min(_SLICE_ROWS, n_rows - start)
        block = words[start * _ROW : (start + rows) * _ROW].view(rows, _ROW)
        row_sums = (_mix(block) * cols).sum(dim=1)
        total = total + (row_sums * _row_multipliers(start, rows, words.device)).sum()
    if rest:
        tail = _mix(words[n_rows * _ROW :]) * cols[:rest]
        total = total + tail.sum() * _row_multipliers(n_rows, 1, words.device)[0]
    return total


def fingerprint(state: Mapping[str, torch.Tensor]) -> str:
    """"fp1-<32 hex>" over names (sorted), dtypes, shapes and exact bit patterns of all tensors."""
    names = sorted(state)
    sums: list[torch.Tensor] = [tensor_sum(state[name]) for name in names]
    # One host transfer per device instead of one sync per tensor.
    host: dict[str, int] = {}
    by_device: dict[torch.device, list[int]] = {}
    for i, name in enumerate(names):
        by_device.setdefault(state[name].device, []).append(i)
    for positions in by_device.values():
        values = torch.stack([sums[i] for i in positions]).cpu().tolist()
        for i, value in zip(positions, values, strict=True):
            host[names[i]] = value
    h = hashlib.blake2b(digest_size=16, person=b"sparsecast-fp1")
    for name in names:
        t = state[name]
        h.update(f"{name}\0{str(t.dtype).removeprefix('torch.')}\0{tuple(t.shape)}\0".encode())
        h.update((host[name] & (2**64 - 1)).to_bytes(8, "little"))
    return FINGERPRINT_PREFIX + h.hexdigest()


def chunk_checksum(data: bytes | memoryview) -> str:
    """sha256 hex of one transferred chunk."""
    return hashlib.sha256(data).hexdigest()
