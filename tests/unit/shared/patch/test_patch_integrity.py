"""Corruption, truncation, wrong base and all-or-nothing application of shared.patch."""

import pytest
import torch

from shared.patch import (
    CorruptPatchError,
    FormatError,
    PatchError,
    TargetMismatchError,
    TensorMismatchError,
    TruncatedPatchError,
    UnknownTensorError,
    WrongBaseError,
    apply_patch,
    extract_patch,
    header_size,
    read_header,
    verify_chunk,
)
from shared.patch.codec import bits

torch.set_num_threads(1)


def _states() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    old = {
        "a.weight": torch.randn(16, 8, generator=g).bfloat16(),
        "b.weight": torch.randn(40, generator=g),
        "c.bias": torch.randn(6, generator=g).half(),
    }
    new = {k: v.clone() for k, v in old.items()}
    bits(new["a.weight"])[[0, 3, 9, 100, 127]] += 1
    bits(new["b.weight"])[[2, 39]] -= 1
    bits(new["c.bias"])[[5]] ^= 0x8000  # sign flip: a large delta
    return old, new


def _clone(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state.items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(bits(a[k]), bits(b[k])) for k in a)


@pytest.fixture(scope="module")
def small_patch() -> bytes:
    old, new = _states()
    # Tiny chunks so that the data region spans several independently checked chunks.
    return extract_patch(old, new, run="run-1", base_version=5, target_version=6, chunk_bytes=16)


def test_every_single_byte_corruption_is_detected(small_patch):
    old, _ = _states()
    for flip in (0x01, 0x80, 0xFF):
        for i in range(len(small_patch)):
            bad = bytearray(small_patch)
            bad[i] ^= flip
            state = _clone(old)
            with pytest.raises((CorruptPatchError, FormatError, TruncatedPatchError)):
                apply_patch(state, bytes(bad))
            assert _same(state, old), f"byte {i} ^ {flip:#x} modified the weights"


def test_every_truncation_is_detected(small_patch):
    old, _ = _states()
    for n in range(len(small_patch)):
        state = _clone(old)
        with pytest.raises(TruncatedPatchError):
            apply_patch(state, small_patch[:n])
        assert _same(state, old)


def test_trailing_bytes_are_rejected(small_patch):
    with pytest.raises(CorruptPatchError, match="trailing"):
        apply_patch(_states()[0], small_patch + b"\0")


def test_header_parses_from_its_prefix_and_chunks_verify_alone(small_patch):
    size = header_size(small_patch[:16])
    header = read_header(small_patch[:size])
    assert (header.run, header.base_version, header.target_version) == ("run-1", 5, 6)
    assert header.total_size == len(small_patch) and len(header.chunks) > 2
    assert [t.name for t in header.tensors] == ["a.weight", "b.weight", "c.bias"]
    assert header.changed == 8 and header.dense_bytes == 16 * 8 * 2 + 40 * 4 + 6 * 2
    for i, chunk in enumerate(header.chunks):
        start = header.header_bytes + chunk.offset
        verify_chunk(small_patch[start : start + chunk.length], chunk, i)
    chunk = header.chunks[1]
    tampered = bytearray(small_patch[header.header_bytes + chunk.offset :][: chunk.length])
    tampered[0] ^= 1
    with pytest.raises(CorruptPatchError, match="chunk 1"):
        verify_chunk(bytes(tampered), chunk, 1)


def test_wrong_base_is_refused_and_untouched(small_patch):
    _, new = _states()
    for state in (_clone(new), {k: torch.zeros_like(v) for k, v in new.items()}):
        before = _clone(state)
        with pytest.raises(WrongBaseError):
            apply_patch(state, small_patch)
        assert _same(state, before)


def test_unknown_tensor_and_mismatched_shapes_or_dtypes(small_patch):
    old, _ = _states()
    renamed = {("z" if k == "c.bias" else k): v.clone() for k, v in old.items()}
    with pytest.raises(UnknownTensorError):
        apply_patch(renamed, small_patch, verify=False)
    assert _same(renamed, {("z" if k == "c.bias" else k): v for k, v in old.items()})
    for bad in (old["c.bias"].float(), old["c.bias"].reshape(2, 3), torch.zeros(7).half()):
        state = _clone(old)
        state["c.bias"] = bad.clone()
        with pytest.raises(TensorMismatchError):
            apply_patch(state, small_patch, verify=False)
        # Tensors before c.bias were decoded but not written.
        assert _same({k: state[k] for k in ("a.weight", "b.weight")}, old)


def test_target_mismatch_restores_old_bits():
    old, new = _states()
    # A patch claiming a target fingerprint the weights cannot reach.
    patch = extract_patch(
        old, new, run="r", base_version=0, target_version=1, target_fingerprint="fp1-" + "0" * 32
    )
    state = _clone(old)
    with pytest.raises(TargetMismatchError):
        apply_patch(state, patch)
    assert _same(state, old)


def test_extract_rejects_mismatched_states():
    old, new = _states()
    with pytest.raises(UnknownTensorError):
        extract_patch(old, {**new, "extra": torch.zeros(1)}, run="r", base_version=0, target_version=1)
    with pytest.raises(TensorMismatchError):
        extract_patch(
            old, {**new, "b.weight": new["b.weight"].double()}, run="r", base_version=0, target_version=1
        )
    with pytest.raises(PatchError):
        extract_patch(old, new, run="r", base_version=0, target_version=1, encoding="xor")  # type: ignore[arg-type]


def test_bitdelta_needs_the_exact_base():
    old, new = _states()
    patch = extract_patch(old, new, run="r", base_version=0, target_version=1, encoding="bitdelta")
    other = _clone(old)
    bits(other["a.weight"])[0] += 5  # not the base: bitdelta would produce wrong weights
    with pytest.raises(WrongBaseError):
        apply_patch(other, patch)
