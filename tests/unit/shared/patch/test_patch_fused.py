"""The fused extraction + fingerprint pass (CUDA, Triton) equals changed_indices + fingerprint."""

import pytest
import torch

from shared.patch import fused
from shared.patch.codec import bits, changed_indices, changed_indices_and_fingerprint
from shared.patch.fingerprint import fingerprint


def states(device: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    old = {
        "a.bf16": torch.randn(3000, 4, generator=g).bfloat16(),  # several blocks, a partial one
        "b.f32": torch.randn(1024, 8, generator=g),
        "c.f64": torch.randn(5, generator=g).double(),
        "d.i8": torch.randint(-100, 100, (64,), generator=g).to(torch.int8),
        "e.odd": torch.randn(3, 5, generator=g).bfloat16(),  # 30 bytes: the torch path
        "f.f16": torch.randn(9000, generator=g).half(),
        "g.all": torch.randn(16, generator=g).bfloat16(),
        "h.none": torch.randn(4096, generator=g).bfloat16(),
        "i.sign": torch.randn(8192, generator=g).bfloat16(),
    }
    new = {k: v.clone() for k, v in old.items()}
    for name, t in new.items():
        b = bits(t)
        if name != "h.none":
            b[torch.rand(b.numel(), generator=g) < 0.05] ^= 1
    bits(new["g.all"]).add_(1)
    bits(new["i.sign"])[[0, 4095, 4096, 8191]] ^= -32768  # the sign bit of words' top lanes
    return ({k: v.to(device) for k, v in old.items()}, {k: v.to(device) for k, v in new.items()})


@pytest.mark.gpu
@pytest.mark.skipif(not fused.available(), reason="needs CUDA and Triton")
@pytest.mark.parametrize("block_words", [fused.BLOCK_WORDS, 1024])
def test_fused_pass_equals_the_torch_paths(monkeypatch, block_words):
    monkeypatch.setattr(fused, "BLOCK_WORDS", block_words)
    fused._plan.cache_clear()
    old, new = states("cuda")
    got, fp = changed_indices_and_fingerprint(old, new)
    cpu_old, cpu_new = states("cpu")
    expected = changed_indices(cpu_old, cpu_new)
    assert list(got) == list(expected) and "h.none" not in got
    for name, indices in expected.items():
        assert got[name].dtype == torch.int64 and torch.equal(got[name].cpu(), indices), name
    assert fp == fingerprint(cpu_new) == fingerprint(new)
    fused._plan.cache_clear()


def test_cpu_states_take_the_torch_paths():
    old, new = states("cpu")
    got, fp = changed_indices_and_fingerprint(old, new)
    assert fp == fingerprint(new)
    assert {k: v.tolist() for k, v in got.items()} == {
        k: v.tolist() for k, v in changed_indices(old, new).items()
    }
