"""A patch staged (verified, decoded; nothing written) and then committed (the write, read back)."""

import pytest
import torch

from shared.patch import (
    TargetMismatchError,
    commit_patch,
    extract_patch,
    fingerprint,
    scatter,
    stage_patch,
)
from shared.patch import apply as apply_module
from shared.patch.codec import bits
from shared.patch.fingerprint import tensor_sums

torch.set_num_threads(1)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                reason="no GPU"))]


def _states(n: int = 3) -> list[dict[str, torch.Tensor]]:
    """n versions: bf16, fp32 and an fp16 tensor whose bytes end mid-word (a padded last word)."""
    g = torch.Generator().manual_seed(3)
    first = {
        "a.weight": torch.randn(64, 33, generator=g).bfloat16(),
        "b.weight": torch.randn(40, generator=g),
        "c.bias": torch.randn(7, generator=g).half(),
    }
    versions = [first]
    for step in range(1, n):
        new = {k: v.clone() for k, v in versions[-1].items()}
        bits(new["a.weight"])[torch.arange(step, 64 * 33, 7)] += 1  # neighbours share words
        bits(new["b.weight"])[[2, 39]] -= step
        bits(new["c.bias"])[[6]] ^= 0x8000  # the element in the padded word
        versions.append(new)
    return versions


def _patch(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], version: int) -> bytes:
    return extract_patch(old, new, run="r", base_version=version, target_version=version + 1,
                         base_fingerprint=fingerprint(old), target_fingerprint=fingerprint(new))


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(bits(a[k]), bits(b[k])) for k in a)


def _on(state: dict[str, torch.Tensor], device: str) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in state.items()}


@pytest.mark.parametrize("device", DEVICES)
def test_stage_writes_nothing_and_predicts_the_target_sums(device: str) -> None:
    old, new = _states(2)
    live = _on(old, device)
    staged = stage_patch(live, _patch(old, new, 0))
    assert bool(staged.writes) == (device == "cuda")  # one scatter on a GPU
    # ... whose kernels were compiled while staging, not in the first version's pause
    assert all((w.values.device, w.values.dtype) in scatter._compiled for w in staged.writes)
    live_before = {k: v.cpu() for k, v in live.items()}
    assert _same(live_before, old)
    assert staged.sums == {k: v & (2**64 - 1) for k, v in tensor_sums(new).items()}
    assert commit_patch(live, staged) == staged.sums
    assert _same({k: v.cpu() for k, v in live.items()}, new) and fingerprint(live) == fingerprint(new)


def test_a_chain_passes_the_sums_on() -> None:
    versions = _states(4)
    live = {k: v.clone() for k, v in versions[0].items()}
    sums = None
    for i in range(3):
        sums = commit_patch(live, stage_patch(live, _patch(versions[i], versions[i + 1], i), sums=sums))
        assert _same(live, versions[i + 1])
    assert sums == {k: v & (2**64 - 1) for k, v in tensor_sums(versions[3]).items()}


def test_a_wrong_target_is_refused_before_any_write() -> None:
    old, new = _states(2)
    wrong = {k: v.clone() for k, v in new.items()}
    bits(wrong["b.weight"])[0] += 1  # the header promises weights the patch does not produce
    patch = extract_patch(old, new, run="r", base_version=0, target_version=1,
                          base_fingerprint=fingerprint(old), target_fingerprint=fingerprint(wrong))
    live = {k: v.clone() for k, v in old.items()}
    with pytest.raises(TargetMismatchError, match="nothing written"):
        stage_patch(live, patch)
    assert _same(live, old)


@pytest.mark.parametrize("device", DEVICES)
def test_a_write_that_lands_wrong_is_caught_and_restored(device: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    old, new = _states(2)
    live = _on(old, device)
    staged = stage_patch(live, _patch(old, new, 0))
    first = staged.decoded[0]
    real_write, real_scatter = apply_module._write, scatter.write

    def flaky(state, decoded, restore):  # one element of the write lands with a flipped bit
        real_write(state, decoded, restore)
        if not restore:
            bits(state[first.name])[first.indices[0]] ^= 1

    def flaky_scatter(writes):
        real_scatter(writes)
        bits(live[first.name])[first.indices[0]] ^= 1

    monkeypatch.setattr(apply_module, "_write", flaky)
    monkeypatch.setattr(scatter, "write", flaky_scatter)
    with pytest.raises(TargetMismatchError, match="restored"):
        commit_patch(live, staged)
    assert _same({k: v.cpu() for k, v in live.items()}, old)


def test_tensors_sharing_bytes_are_fingerprinted_whole() -> None:
    old, new = _states(2)
    old["tied.weight"], new["tied.weight"] = old["a.weight"], new["a.weight"]
    live = {k: v.clone() for k, v in old.items() if k != "tied.weight"}
    live["tied.weight"] = live["a.weight"]
    staged = stage_patch(live, _patch(old, new, 0))
    assert staged.sums is None  # no per-name prediction where names alias
    assert commit_patch(live, staged) == tensor_sums(new)
    assert _same(live, new)


def test_a_tensor_that_moved_since_staging_is_refused() -> None:
    old, new = _states(2)
    live = {k: v.clone() for k, v in old.items()}
    staged = stage_patch(live, _patch(old, new, 0))
    live["a.weight"] = live["a.weight"].clone()
    with pytest.raises(ValueError, match="moved"):
        commit_patch(live, staged)


def test_an_overlap_is_found_past_a_span_in_between() -> None:
    flat = torch.zeros(100)
    # a big unpatched view holding a small one, then the patched tensor inside the big one only
    state = {"big": flat, "small": flat[10:20], "patched": flat[50:60], "apart": torch.zeros(4)}
    assert apply_module._overlapping(state, {"patched"})
    assert not apply_module._overlapping(state, {"apart"})
