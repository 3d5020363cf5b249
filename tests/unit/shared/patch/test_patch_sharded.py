"""Patches and fingerprints from shards equal, byte for byte, those of the full tensors."""

from __future__ import annotations

import math

import pytest
import torch

from shared.patch import apply_patch, extract_patch, fingerprint
from shared.patch.fingerprint import tensor_sum, tensor_sum_at
from shared.patch.sharded import (
    SliceChanges,
    SliceSums,
    assemble_patch,
    combine_sums,
    fingerprint_from_slices,
    slice_changes,
    slice_sums,
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


def _sharded(
    old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], parts: int, seed: int
) -> tuple[list[SliceChanges], list[SliceSums], list[SliceSums]]:
    changes, old_sums, new_sums = [], [], []
    for i, name in enumerate(sorted(new)):
        flat_old, flat_new = old[name].reshape(-1), new[name].reshape(-1)
        for start, end in _bounds(flat_new.numel(), parts, seed + i):
            changes.append(slice_changes(name, flat_old[start:end], flat_new[start:end], start))
            old_sums.append(slice_sums(name, flat_old[start:end], start))
            new_sums.append(slice_sums(name, flat_new[start:end], start))
    return changes, old_sums, new_sums


def _meta(state: dict[str, torch.Tensor]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    return {name: (t.dtype, tuple(t.shape)) for name, t in state.items()}


@pytest.mark.parametrize(("parts", "seed"), [(1, 0), (2, 1), (3, 2), (8, 3)])
def test_patch_from_uneven_slices_is_byte_identical(parts: int, seed: int) -> None:
    old = _model(seed)
    new = _step(old, seed + 100)
    changes, old_sums, new_sums = _sharded(old, new, parts, seed)
    meta = _meta(new)
    base_fp, target_fp = fingerprint_from_slices(meta, old_sums), fingerprint_from_slices(meta, new_sums)
    assert (base_fp, target_fp) == (fingerprint(old), fingerprint(new))
    full = extract_patch(old, new, run="r", base_version=3, target_version=4, chunk_bytes=512)
    joined = assemble_patch(
        meta,
        reversed(changes),
        run="r",
        base_version=3,
        target_version=4,
        base_fingerprint=base_fp,
        target_fingerprint=target_fp,
        chunk_bytes=512,
    )
    assert joined == full
    replica = {k: v.clone() for k, v in old.items()}
    apply_patch(replica, joined)
    assert fingerprint(replica) == fingerprint(new)


def test_no_change_and_empty_slices() -> None:
    old = _model(5)
    changes, _, sums = _sharded(old, old, 4, 5)
    assert all(c.count == 0 for c in changes)
    fp = fingerprint(old)
    assert fingerprint_from_slices(_meta(old), sums) == fp
    patch = assemble_patch(
        _meta(old),
        changes,
        run="r",
        base_version=0,
        target_version=1,
        base_fingerprint=fp,
        target_fingerprint=fp,
    )
    assert patch == extract_patch(old, old, run="r", base_version=0, target_version=1)
    empty = slice_sums("x", torch.empty(0, dtype=torch.bfloat16), 5)
    assert (empty.interior, empty.edges) == (0, [])


def test_special_values_are_bit_exact() -> None:
    # NaN payloads, -0.0 vs 0.0 and infinities differ only in bits: they must travel as bits.
    nan_a = torch.tensor([0x7FC1], dtype=torch.int16).view(torch.bfloat16)
    nan_b = torch.tensor([0x7FC2], dtype=torch.int16).view(torch.bfloat16)
    old = {"w": torch.tensor([0.0, 1.0, math.inf, 2.0, 0.5, -1.0, 3.0], dtype=torch.bfloat16)}
    new = {"w": old["w"].clone()}
    old["w"][4], new["w"][4] = nan_a[0], nan_b[0]
    new["w"][0], new["w"][2], new["w"][5] = -0.0, -math.inf, math.nan
    changes, old_sums, new_sums = _sharded(old, new, 3, 9)
    meta = _meta(new)
    patch = assemble_patch(
        meta,
        changes,
        run="r",
        base_version=0,
        target_version=1,
        base_fingerprint=fingerprint_from_slices(meta, old_sums),
        target_fingerprint=fingerprint_from_slices(meta, new_sums),
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
    parts = [slice_sums("b", b[s:e], s) for s, e in [(0, 3), (3, 4), (4, 517), (517, 1001)]]
    assert combine_sums(parts) == int(tensor_sum(b)) & (2**64 - 1)
