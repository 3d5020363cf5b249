"""Bit-exact round trips of shared.patch for random bit patterns, special values included."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.patch import apply_patch, extract_patch, merge_patches, read_header
from shared.patch.codec import bits, varint_decode, varint_encode

torch.set_num_threads(1)

_SPECIALS = {
    # ±0, ±inf, quiet/signalling NaNs with payloads, smallest/largest subnormals
    torch.bfloat16: [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0xFFFF, 0x0001, 0x807F, 0x3F80],
    torch.float16: [0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E00, 0x7C01, 0xFFFF, 0x0001, 0x83FF, 0x3C00],
    torch.float32: [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00001, 0x7F800001, 0xFFFFFFFF, 1,
                    0x807FFFFF, 0x3F800000],
}
_DTYPES = list(_SPECIALS)


def _tensor(patterns: list[int], dtype: torch.dtype) -> torch.Tensor:
    width = 8 * torch.empty((), dtype=dtype).element_size()
    signed = [p - (1 << width) if p >= 1 << (width - 1) else p for p in patterns]
    int_dtype = torch.int16 if width == 16 else torch.int32
    return torch.tensor(signed, dtype=int_dtype).view(dtype)


@st.composite
def tensor_pair(draw: st.DrawFn, dtype: torch.dtype | None = None, size: int | None = None):
    """(old, new): random patterns mixed with specials; new changes a random subset of old."""
    dtype = dtype or draw(st.sampled_from(_DTYPES))
    width = 8 * torch.empty((), dtype=dtype).element_size()
    pattern = st.one_of(st.integers(0, (1 << width) - 1), st.sampled_from(_SPECIALS[dtype]))
    n = size or draw(st.integers(1, 300))
    old = draw(st.lists(pattern, min_size=n, max_size=n))
    changes = draw(st.dictionaries(st.integers(0, n - 1), pattern, max_size=n))
    # Mostly "optimiser-like" changes: one ulp up or down.
    nudges = draw(st.dictionaries(st.integers(0, n - 1), st.sampled_from([1, -1]), max_size=n))
    new = list(old)
    for i, d in nudges.items():
        new[i] = (new[i] + d) % (1 << width)
    for i, p in changes.items():
        new[i] = p
    return _tensor(old, dtype), _tensor(new, dtype)


def _same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(bits(a[k]), bits(b[k])) for k in a)


@settings(max_examples=40, deadline=None)
@given(
    pairs=st.lists(tensor_pair(), min_size=1, max_size=4),
    encoding=st.sampled_from(["auto", "values", "bitdelta"]),
)
def test_round_trip_is_bit_exact(pairs, encoding):
    old = {f"t{i}": o for i, (o, _) in enumerate(pairs)}
    new = {f"t{i}": n for i, (_, n) in enumerate(pairs)}
    patch = extract_patch(
        old, new, run="r", base_version=3, target_version=4, encoding=encoding, chunk_bytes=64
    )
    state = {k: v.clone() for k, v in old.items()}
    header = apply_patch(state, patch)
    assert _same_bits(state, new)
    assert header.changed == sum(int((bits(old[k]) != bits(new[k])).sum()) for k in old)
    assert all(t.encoding == encoding for t in header.tensors) or encoding == "auto"


@settings(max_examples=15, deadline=None)
@given(pair=tensor_pair())
def test_values_patch_is_idempotent(pair):
    old, new = pair
    patch = extract_patch(
        {"w": old}, {"w": new}, run="r", base_version=0, target_version=1, encoding="values"
    )
    state = {"w": old.clone()}
    apply_patch(state, patch, verify=False)
    apply_patch(state, patch, verify=False)
    assert torch.equal(bits(state["w"]), bits(new))


@settings(max_examples=25, deadline=None)
@given(chain=st.integers(2, 4).flatmap(lambda k: st.tuples(st.sampled_from(_DTYPES), st.just(k))).flatmap(
    lambda dk: st.tuples(*[tensor_pair(dk[0], 64) for _ in range(dk[1])])),
    encoding=st.sampled_from(["auto", "values", "bitdelta"]), with_base=st.booleans())
def test_merge_equals_sequential_apply(chain, encoding, with_base):
    # Versions v0..vk: v0 = first pair's old, v_{i+1} = pair i's new (a chain of arbitrary states).
    versions = [{"w": chain[0][0], "z": torch.zeros(3)}] + [{"w": n, "z": torch.zeros(3)} for _, n in chain]
    patches = [
        extract_patch(
            versions[i], versions[i + 1], run="r", base_version=i, target_version=i + 1, encoding=encoding
        )
        for i in range(len(chain))
    ]
    base = {k: v.clone() for k, v in versions[0].items()}
    merged = merge_patches(patches, base if with_base or encoding != "values" else None)
    header = read_header(merged)
    assert (header.base_version, header.target_version) == (0, len(chain))
    sequential = {k: v.clone() for k, v in versions[0].items()}
    for p in patches:
        apply_patch(sequential, p)
    once = {k: v.clone() for k, v in versions[0].items()}
    apply_patch(once, merged)
    assert _same_bits(once, sequential)
    if with_base:  # minimal: exactly the elements that differ end to end
        assert header.changed == int((bits(versions[0]["w"]) != bits(versions[-1]["w"])).sum())


def test_merge_of_bitdelta_chain_without_base_composes_deltas():
    a = torch.arange(20, dtype=torch.float32).bfloat16()
    b, c = a.clone(), a.clone()
    bits(b)[[1, 5]] += 1
    bits(c)[[1, 5]] += 1
    bits(c)[[5, 7]] += 1
    patches = [extract_patch({"w": x}, {"w": y}, run="r", base_version=i, target_version=i + 1,
                             encoding="bitdelta") for i, (x, y) in enumerate([(a, b), (b, c)])]
    merged = merge_patches(patches)
    assert [t.encoding for t in read_header(merged).tensors] == ["bitdelta"]
    state = {"w": a.clone()}
    apply_patch(state, merged)
    assert torch.equal(bits(state["w"]), bits(c))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 2**63 - 1) | st.integers(0, 300), min_size=1, max_size=200))
def test_varint_round_trip(values):
    t = torch.tensor(values, dtype=torch.int64)
    encoded = varint_encode(t)
    assert encoded.numel() == sum(max(1, (v.bit_length() + 6) // 7) for v in values)
    assert torch.equal(varint_decode(encoded, len(values)), t)


def test_unchanged_state_gives_an_empty_patch():
    state = {"w": torch.randn(10, 10).bfloat16()}
    patch = extract_patch(state, state, run="r", base_version=1, target_version=2)
    header = read_header(patch)
    assert header.tensors == [] and header.changed == 0 and header.chunks == []
    copy = {"w": state["w"].clone()}
    apply_patch(copy, patch)
    assert torch.equal(copy["w"], state["w"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_patches_match_cpu_patches():
    g = torch.Generator().manual_seed(1)
    old = {"w": torch.randn(300, 70, generator=g).bfloat16(), "b": torch.randn(33, generator=g)}
    new = {k: v.clone() for k, v in old.items()}
    bits(new["w"])[::13] += 1
    bits(new["b"])[[0, 32]] -= 1
    cuda_old = {k: v.cuda() for k, v in old.items()}
    cuda_new = {k: v.cuda() for k, v in new.items()}
    version = dict(run="r", base_version=0, target_version=1)
    patch = extract_patch(cuda_old, cuda_new, **version)
    assert patch == extract_patch(old, new, **version)  # same bytes from either device
    apply_patch(cuda_old, patch)
    assert _same_bits({k: v.cpu() for k, v in cuda_old.items()}, new)
