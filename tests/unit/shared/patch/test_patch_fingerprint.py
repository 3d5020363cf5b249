"""Fingerprint sensitivity and snapshots."""

import pytest
import torch

from shared.patch import (
    CorruptPatchError,
    FormatError,
    fingerprint,
    load_snapshot,
    save_snapshot,
    snapshot_info,
)
from shared.patch.codec import bits
from shared.patch.fingerprint import _short_sums, tensor_sum

torch.set_num_threads(1)


def test_every_single_bit_flip_changes_the_fingerprint():
    # Sizes around the 8-byte word and 1024-word row boundaries, for each element width.
    state = {
        "bf16": torch.randn(1030 * 4 + 3).bfloat16(),
        "f16": torch.randn(5).half(),
        "f32": torch.randn(5),
        "f64": torch.randn(2).double(),
    }
    reference = fingerprint(state)
    seen = {reference}
    for name, t in state.items():
        raw = t.view(-1).view(torch.uint8)
        n = raw.numel()
        # bf16: the first words, both sides of the first 1024-word row, the zero-padded tail word
        positions = range(n) if name != "bf16" else [*range(16), *range(8184, 8200), *range(n - 14, n)]
        for byte in positions:
            for bit in range(8):
                raw[byte] ^= 1 << bit
                fp = fingerprint(state)
                raw[byte] ^= 1 << bit
                assert fp != reference, f"{name} byte {byte} bit {bit} undetected"
                seen.add(fp)
    assert fingerprint(state) == reference
    assert len(seen) == 1 + 8 * (46 + 10 + 20 + 16)  # flips are also told apart


def test_fingerprint_sees_names_shapes_dtypes_not_dict_order():
    a = torch.randn(4, 6)
    base = fingerprint({"x": a, "y": torch.ones(2)})
    assert fingerprint({"y": torch.ones(2), "x": a.clone()}) == base
    assert base.startswith("fp1-") and len(base) == 4 + 32
    variants = [
        {"x2": a, "y": torch.ones(2)},
        {"x": a.reshape(6, 4), "y": torch.ones(2)},
        {"x": a.view(torch.int32), "y": torch.ones(2)},
        {"x": a, "y": torch.ones(2), "z": torch.zeros(0)},
        {"x": a},
    ]
    assert len({fingerprint(v) for v in variants} | {base}) == len(variants) + 1


def test_batched_short_tensors_match_the_per_tensor_reduction():
    short = [torch.randn(n).bfloat16() for n in (0, 1, 3, 4, 5, 100, 4095)] + [torch.randn(7).double()]
    assert _short_sums(short).tolist() == [int(tensor_sum(t)) for t in short]


def test_pairs_of_sign_flips_do_not_cancel():
    t = torch.randn(4096).bfloat16()
    reference = fingerprint({"w": t})
    for i, j in [(3, 7), (3, 4003), (0, 1), (1027, 2051)]:
        s = t.clone()
        s[[i, j]] = -s[[i, j]]
        assert fingerprint({"w": s}) != reference


def test_swapped_elements_change_the_fingerprint():
    t = torch.arange(4096, dtype=torch.float32).bfloat16()
    s = t.clone()
    s[[10, 3000]] = s[[3000, 10]]
    assert fingerprint({"w": t}) != fingerprint({"w": s})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fingerprint_is_the_same_on_cuda():
    state = {"a": torch.randn(3000, 7).bfloat16(), "b": torch.randn(13)}
    assert fingerprint({k: v.cuda() for k, v in state.items()}) == fingerprint(state)


def test_snapshot_round_trip_keeps_bits_and_fingerprint():
    emb = torch.randn(10, 4).bfloat16()
    nan_bits = torch.tensor([0x7F81, -1, 0, -32768], dtype=torch.int16).view(torch.bfloat16)
    state = {"embed.weight": emb, "lm_head.weight": emb, "special": nan_bits}  # tied: shared storage
    data = save_snapshot(state, run="run-9", version=12)
    info = snapshot_info(data)
    assert (info.run, info.version, info.fingerprint) == ("run-9", 12, fingerprint(state))
    loaded, info2 = load_snapshot(data)
    assert info2 == info
    assert all(torch.equal(bits(loaded[k]), bits(state[k])) for k in state)


def test_snapshot_corruption_and_foreign_files_are_rejected():
    data = bytearray(save_snapshot({"w": torch.randn(64)}, run="r", version=1))
    data[-3] ^= 0x10  # inside the tensor data
    with pytest.raises(CorruptPatchError):
        load_snapshot(bytes(data))
    from safetensors.torch import save

    with pytest.raises(FormatError):
        load_snapshot(save({"w": torch.zeros(2)}))
