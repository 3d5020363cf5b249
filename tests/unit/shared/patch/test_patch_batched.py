"""Batched (stacked / grouped) fingerprint sums and change extraction equal the per-tensor
reference on mixed shapes, dtypes and layouts."""

import importlib

import pytest
import torch

import shared.patch.codec as codec
from shared.patch.codec import bits, changed_indices

fp = importlib.import_module("shared.patch.fingerprint")  # the package re-exports a function of that name
torch.set_num_threads(1)


def mixed_tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    base = torch.randn(64, 70, generator=g)
    return [
        torch.tensor(3.5),  # 0-d
        torch.zeros(0),  # empty
        torch.zeros(0, 5).half(),
        torch.randn(1024 * 4, generator=g).bfloat16(),  # exactly 2 rows of words
        torch.randn(1024 * 4, generator=g).bfloat16(),  # same size: stacked with the previous
        torch.randn(1024 * 4, generator=g).half(),  # same byte size, other dtype: same stack
        torch.randn(2048 + 1, generator=g),  # fp32, 1 row and a tail word
        torch.randn(4099, generator=g).bfloat16(),  # tail word zero-padded (8198 bytes)
        torch.randn(4099, generator=g).bfloat16(),
        base.t(),  # non-contiguous fp32 view (4480 elements: 2 rows + 192 words)
        base.bfloat16()[:, 3:67],  # non-contiguous bf16 view
        torch.randn(8193, generator=g).bfloat16()[1:],  # storage offset not 8-byte aligned
        torch.randn(3, 5, generator=g).bfloat16(),  # short
        torch.randn(100, generator=g).double(),  # short
    ]


@pytest.mark.parametrize("slice_rows", [1 << 16, 1])
def test_device_sums_equal_the_per_tensor_reduction(monkeypatch, slice_rows):
    tensors = mixed_tensors()
    monkeypatch.setattr(fp, "_SLICE_ROWS", slice_rows)  # 1: every stack of one tensor, row by row
    copies = [t.clone() for t in tensors]
    reference = [int(fp.tensor_sum(t)) for t in tensors]
    assert fp.device_sums(tensors, stacked=True).tolist() == reference
    assert fp.device_sums(tensors, stacked=False).tolist() == reference
    assert all(torch.equal(a, b) for a, b in zip(tensors, copies, strict=True))  # read, never mixed in place


def test_fingerprint_matches_a_per_tensor_fingerprint():
    import hashlib

    state = {f"t{i:02d}": t for i, t in enumerate(mixed_tensors())}
    h = hashlib.blake2b(digest_size=16, person=b"sparsecast-fp1")
    for name in sorted(state):
        t = state[name]
        h.update(f"{name}\0{str(t.dtype).removeprefix('torch.')}\0{tuple(t.shape)}\0".encode())
        h.update((int(fp.tensor_sum(t)) & (2**64 - 1)).to_bytes(8, "little"))
    assert fp.fingerprint(state) == "fp1-" + h.hexdigest()


def changed_pairs() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    old = {
        "a_scalar": torch.tensor(1.0),
        "b_empty": torch.zeros(0).bfloat16(),
        "c_bf16": torch.randn(40, 50, generator=g).bfloat16(),
        "d_f16": torch.randn(2000, generator=g).half(),  # same numel as c: same mask
        "e_f32": torch.randn(2000, generator=g),
        "f_same": torch.randn(2000, generator=g).bfloat16(),  # unchanged, between changed ones
        "g_f32": torch.randn(7, generator=g),
        "h_all": torch.randn(5, generator=g).bfloat16(),
    }
    new = {k: v.clone() for k, v in old.items()}
    new["a_scalar"].fill_(-1.0)
    for name in ("c_bf16", "d_f16", "e_f32"):
        flat = bits(new[name])
        picks = torch.randperm(flat.numel(), generator=g)[:37]
        flat[picks] += 1
    bits(new["c_bf16"])[[0, 1999]] ^= 1  # the first and last element of a mask row
    bits(new["g_f32"])[3] ^= 1 << 31  # 0.0 vs -0.0 style sign flip
    bits(new["h_all"]).add_(1)
    return old, new


@pytest.mark.parametrize("mask_bytes", [1 << 30, 1])
def test_changed_indices_equal_per_tensor_nonzero(monkeypatch, mask_bytes):
    monkeypatch.setattr(codec, "_MASK_BYTES", mask_bytes)  # 1: a count sync per tensor
    old, new = changed_pairs()
    reference = {}
    for name in sorted(new):
        nz = torch.nonzero(bits(old[name]) != bits(new[name])).view(-1)
        if nz.numel():
            reference[name] = nz
    got = changed_indices(old, new, batched=True)
    assert {k: v.tolist() for k, v in changed_indices(old, new, batched=False).items()} == {
        k: v.tolist() for k, v in got.items()
    }
    assert list(got) == list(reference) == ["a_scalar", "c_bf16", "d_f16", "e_f32", "g_f32", "h_all"]
    for name, indices in reference.items():
        assert got[name].dtype == torch.int64 and torch.equal(got[name], indices), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_defaults_are_the_batched_paths_and_match_the_cpu():
    tensors = mixed_tensors()
    assert fp.device_sums([t.cuda() for t in tensors]).tolist() == [int(fp.tensor_sum(t)) for t in tensors]
    old, new = changed_pairs()
    on_cuda = changed_indices({k: v.cuda() for k, v in old.items()}, {k: v.cuda() for k, v in new.items()})
    expected = changed_indices(old, new)
    assert list(on_cuda) == list(expected)
    assert all(torch.equal(on_cuda[k].cpu(), expected[k]) for k in expected)
