"""Encoding `ctxans` (docs/patch-format.md §4.1): bit-exact round trips, the writer's choices, below
the i.i.d. floor on Adam-like steps, and a strict reader of its streams."""

from __future__ import annotations

import math
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.patch import (
    CorruptPatchError,
    FormatError,
    PatchError,
    apply_patch,
    ctxans,
    extract_patch,
    merge_patches,
    read_header,
)
from shared.patch.codec import bits, varint_decode, varint_encode

from .test_patch_roundtrip import tensor_pair
from .test_patch_strict import encoded, rewrite

torch.set_num_threads(1)
VERSION = dict(run="r", base_version=0, target_version=1)


def _adam_like(n: int, seed: int, lr: float = 2e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 weights before and after one sign-like step of an fp32 master (as Adam's first step)."""
    g = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=g) * 0.02
    step = lr * torch.sign(torch.randn(n, generator=g))
    return master.bfloat16(), (master + step).bfloat16()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(bits(a), bits(b))


def _round_trip(
    old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], encoding: str = "ctxans"
) -> bytes:
    patch = extract_patch(old, new, encoding=encoding, **VERSION)  # type: ignore[arg-type]
    state = {k: v.clone() for k, v in old.items()}
    apply_patch(state, patch)  # checks the target fingerprint too
    assert all(_same(state[k], new[k]) for k in new)
    return patch


@settings(max_examples=25, deadline=None)
@given(pairs=st.lists(tensor_pair(torch.bfloat16), min_size=1, max_size=3))
def test_random_bit_patterns_round_trip(pairs) -> None:
    old = {f"t{i}": o for i, (o, _) in enumerate(pairs)}
    new = {f"t{i}": n for i, (_, n) in enumerate(pairs)}
    header = read_header(_round_trip(old, new))
    assert {t.encoding for t in header.tensors} <= {"ctxans"}


@pytest.mark.parametrize("case", ["one element", "one of many", "all change", "many-ulp", "specials"])
def test_edge_cases_round_trip(case: str) -> None:
    old, new = _adam_like(5000, 1)
    if case == "one element":
        old, new = old[:1].clone(), old[:1].clone()
        bits(new)[0] += 1
    elif case == "one of many":
        new = old.clone()
        bits(new)[4321] -= 1
    elif case == "all change":
        new = old.clone()
        bits(new)[:] += 1
    elif case == "many-ulp":  # sign flips and far jumps: deltas up to +-32768, z up to 65535
        new = old.clone()
        bits(new)[::7] ^= -0x8000
        bits(new)[3::11] += 300
    else:  # bases in the exponent classes 0 and 255: zeros, subnormals, inf, NaN
        patterns = torch.tensor([0, -0x8000, 1, 0x7F, 0x7F80, -0x80, 0x7FC0, 0x7F81] * 50, dtype=torch.int16)
        old = patterns.view(torch.bfloat16).clone()
        new = old.clone()
        bits(new)[::3] += 1
    header = read_header(_round_trip({"w": old}, {"w": new}))
    assert [t.encoding for t in header.tensors] == ["ctxans"]


def test_no_change_gives_the_empty_patch() -> None:
    old, _ = _adam_like(1000, 2)
    header = read_header(_round_trip({"w": old}, {"w": old.clone()}))
    assert header.tensors == [] and header.changed == 0


def test_other_dtypes_fall_back_to_bitdelta_and_a_ctxans_entry_must_be_bf16() -> None:
    old = {"h": torch.randn(300).half(), "f": torch.randn(300), "w": _adam_like(300, 3)[0]}
    new = {k: v.clone() for k, v in old.items()}
    for t in new.values():
        bits(t)[::5] += 1
    patch = _round_trip(old, new)
    assert {t.name: t.encoding for t in read_header(patch).tensors} == {
        "f": "bitdelta", "h": "bitdelta", "w": "ctxans"}
    tensors = encoded(patch)
    tensors[1].encoding = "ctxans"  # "h", float16
    with pytest.raises(FormatError, match="bfloat16"):
        read_header(rewrite(patch, tensors))


def test_auto_keeps_the_old_encodings_where_they_are_smaller() -> None:
    big_old, big_new = _adam_like(200_000, 4)
    small_old = torch.randn(64).bfloat16()
    small_new = small_old.clone()
    bits(small_new)[7] += 1  # one change: the rANS framing costs more than two zstd frames
    old, new = {"big": big_old, "small": small_old}, {"big": big_new, "small": small_new}
    header = read_header(_round_trip(old, new, "auto"))
    assert {t.name: t.encoding for t in header.tensors} == {"big": "ctxans", "small": "bitdelta"}
    zstd = read_header(_round_trip(old, new, "zstd"))
    assert {t.encoding for t in zstd.tensors} == {"bitdelta"}
    assert header.total_size < zstd.total_size


def test_old_encodings_still_decode() -> None:
    old, new = _adam_like(20_000, 5)
    for encoding in ("values", "bitdelta"):
        header = read_header(_round_trip({"w": old}, {"w": new}, encoding))
        assert [t.encoding for t in header.tensors] == [encoding]


def test_adam_like_step_codes_below_the_iid_floor() -> None:
    old, new = _adam_like(400_000, 6)
    patch = extract_patch({"w": old}, {"w": new}, encoding="ctxans", **VERSION)
    header = read_header(patch)
    p = header.changed / old.numel()
    floor = -(p * math.log2(p) + (1 - p) * math.log2(1 - p)) / p + 1
    stored = sum(t.index.length + t.payload.length for t in header.tensors)
    bitdelta = read_header(extract_patch({"w": old}, {"w": new}, encoding="bitdelta", **VERSION))
    assert 0.01 < p < 0.2
    assert 8 * stored / header.changed < 0.85 * floor
    assert stored < sum(t.index.length + t.payload.length for t in bitdelta.tensors)


def test_gap_tables_sum_to_the_precision_and_keep_every_possible_gap() -> None:
    changed = torch.tensor([1, 5, 999, 1000, 1, 3])
    size = torch.tensor([1, 10, 1000, 1000, 2**30, 17])
    f = ctxans.gap_tables(changed, size)
    assert bool((f.sum(1) == ctxans.TOTAL).all())
    lo = ctxans._gap_bounds(torch.device("cpu"))[:-1]
    assert torch.equal(f > 0, lo[None, :] < size[:, None])
    assert int(f[3].argmax()) == 0 and int(f[4].argmax()) > 40  # dense: gap 0; sparse: long gaps


@pytest.mark.parametrize("with_base", [True, False])
def test_merge_of_a_ctxans_chain_needs_the_base(with_base: bool) -> None:
    v0, v1 = _adam_like(30_000, 7)
    v2 = v1.clone()
    bits(v2)[::9] -= 1
    patches = [extract_patch({"w": a}, {"w": b}, run="r", base_version=i, target_version=i + 1,
                             encoding="ctxans") for i, (a, b) in enumerate([(v0, v1), (v1, v2)])]
    if not with_base:
        with pytest.raises(PatchError, match="needs the base"):
            merge_patches(patches)
        return
    merged = merge_patches(patches, {"w": v0})
    state = {"w": v0.clone()}
    apply_patch(state, merged)
    assert _same(state["w"], v2)
    assert read_header(merged).changed == int((bits(v0) != bits(v2)).sum())


# --- a strict reader ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def patch() -> bytes:
    old, new = _adam_like(3000, 8)
    return extract_patch({"w": old}, {"w": new}, encoding="ctxans", **VERSION)


def _header_ints(stream: bytes) -> tuple[list[int], bytes]:
    (count,) = struct.unpack_from("<I", stream)
    data = torch.frombuffer(bytearray(stream[4:]), dtype=torch.uint8)
    size = int(torch.nonzero(data < 0x80).view(-1)[count - 1]) + 1
    return varint_decode(data[:size], count).tolist(), stream[4 + size :]


def _with_header(values: list[int], rest: bytes) -> bytes:
    return struct.pack("<I", len(values)) + varint_encode(torch.tensor(values)).numpy().tobytes() + rest


def _mutated(patch: bytes, stream: str, fn) -> bytes:
    tensors = encoded(patch)
    t = tensors[0]
    data = t.index if stream == "index" else t.payload
    data = fn(data)
    if stream == "index":
        t.index, t.index_raw_length = data, len(data)
    else:
        t.payload, t.payload_raw_length = data, len(data)
    return rewrite(patch, tensors)


def _refused(data: bytes, match: str) -> None:
    old, _ = _adam_like(3000, 8)
    state = {"w": old.clone()}
    with pytest.raises(CorruptPatchError, match=match):
        apply_patch(state, data, verify=False)
    assert _same(state["w"], old)


def _index_header(fn):
    """Mutate the index stream's header values [K, classes, counts, lane word counts]."""
    def mutate(stream: bytes) -> bytes:
        values, rest = _header_ints(stream)
        return _with_header(fn(values), rest)
    return mutate


def _k(values: list[int]) -> int:
    return values[0]


@pytest.mark.parametrize(("stream", "fn", "match"), [
    ("index", lambda s: s + b"\0", "extra bits"),
    ("payload", lambda s: s + b"\0", "extra bits"),
    ("index", lambda s: s[:-1], "extra bits|shorter"),
    ("payload", lambda s: s[:3], "shorter"),
    ("index", lambda s: s[:-40] + bytes([s[-40] ^ 0x10]) + s[-39:], "rANS lane|padding|beyond|extra"),
    ("index", _index_header(lambda v: [0, *v[1:]]), "classes|header"),
    ("index", _index_header(lambda v: v[: 1 + _k(v)] + [v[1 + _k(v)] + 1] + v[2 + _k(v):]),
     "sum to the entry's count"),
    ("index", _index_header(lambda v: [v[0], v[2], v[1], *v[3:]] if v[0] > 1 else [v[0], 300, *v[2:]]),
     "strictly increasing"),
    ("index", _index_header(lambda v: [*v, 0]), "more varints"),
    ("index", _index_header(lambda v: v[:-1] + [v[-1] + 1]), "rANS lane|shorter"),
])
def test_malformed_streams_are_refused(patch: bytes, stream: str, fn, match: str) -> None:
    _refused(_mutated(patch, stream, fn), match)


def test_a_table_that_does_not_sum_to_the_precision_is_refused(patch: bytes) -> None:
    def mutate(stream: bytes) -> bytes:
        values, rest = _header_ints(stream)
        values[2] += 1  # M, then the first table's m, then its first frequency
        return _with_header(values, rest)
    _refused(_mutated(patch, "payload", mutate), "does not sum")


def test_a_class_larger_than_the_base_has_is_refused() -> None:
    # The base's class sizes are the decoder's: a patch made for other weights names more changes
    # in a class than these weights hold.
    old, new = _adam_like(3000, 9)
    patch = extract_patch({"w": old}, {"w": new}, encoding="ctxans", **VERSION)
    other = torch.full((3000,), 1.0).bfloat16()  # one class only
    with pytest.raises(CorruptPatchError, match="class"):
        apply_patch({"w": other}, patch, verify=False)


def test_non_zero_padding_bits_are_refused() -> None:
    with pytest.raises(CorruptPatchError, match="padding"):
        ctxans.unpack_bits([bytes([0b0000_0101, 0b1000_0000])], torch.tensor([3, 6]), ["x"])
    with pytest.raises(CorruptPatchError, match="bytes of extra bits"):
        ctxans.unpack_bits([bytes([5, 0, 0])], torch.tensor([3, 6]), ["x"])
    ok = ctxans.unpack_bits([bytes([0b0000_0101, 0b0000_0000])], torch.tensor([3, 6]), ["x"])
    assert ok.tolist() == [5, 0]


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2**42 - 1), st.integers(0, 42)), min_size=1, max_size=50))
def test_extra_bits_pack_and_unpack(fields) -> None:
    nbits = torch.tensor([n for _, n in fields])
    values = torch.tensor([v & ((1 << n) - 1) for v, n in fields])
    assert torch.equal(ctxans.unpack_bits(ctxans.pack_bits(values, nbits), nbits, ["x"]), values)
    cut = len(fields) // 2  # two segments, each from a whole byte
    counts = [cut, len(fields) - cut]
    packed = ctxans.pack_bits(values, nbits, counts)
    assert [len(p) for p in packed] == [-(-int(nbits[:cut].sum()) // 8), -(-int(nbits[cut:].sum()) // 8)]
    assert torch.equal(ctxans.unpack_bits(packed, nbits, ["x", "y"], counts), values)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 2**44 - 1) | st.integers(0, 40), min_size=1, max_size=100))
def test_symbol_mapping_is_invertible(values) -> None:
    v = torch.tensor(values)
    sym, nbits, extra = ctxans.gap_symbols(v)
    assert bool((sym < ctxans.GAP_ALPHABET).all())
    lo = ctxans._gap_bounds(torch.device("cpu"))
    assert bool(((lo[sym] <= v) & (v < lo[sym + 1])).all())
    assert torch.equal(ctxans._from_symbols(sym, ctxans.pack_bits(extra, nbits), ["x"]), v)


@pytest.mark.parametrize(("first", "match"), [
    (lambda k: bytes([k | 0x80, 0x00]), "over-long"),  # K with an empty last group
    (lambda k: bytes([0x80] * 9 + [0x01]), "longer than 9 bytes"),
])
def test_header_varints_are_minimal_leb128(patch: bytes, first, match: str) -> None:
    def mutate(stream: bytes) -> bytes:
        values, rest = _header_ints(stream)
        tail = varint_encode(torch.tensor(values[1:])).numpy().tobytes()
        return struct.pack("<I", len(values)) + first(values[0]) + tail + rest
    _refused(_mutated(patch, "index", mutate), match)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")


@needs_cuda
def test_the_gpu_decodes_what_the_cpu_does() -> None:
    """On a GPU the lanes decode in one Triton kernel (ctxans._decode_lanes), not the torch step
    loop: the same patches apply bit-exactly there, whichever device coded them."""
    olds, news = {}, {}
    for i, n in enumerate((1, 17, 3000, 70_000)):  # one symbol, a partial lane, many lanes
        olds[f"t{i}"], news[f"t{i}"] = _adam_like(n, 20 + i, lr=3e-4)
    cpu_patch = extract_patch(olds, news, encoding="ctxans", **VERSION)
    gpu = {k: v.cuda() for k, v in olds.items()}
    gpu_patch = extract_patch(gpu, {k: v.cuda() for k, v in news.items()}, encoding="ctxans", **VERSION)
    for patch in (cpu_patch, gpu_patch):
        state = {k: v.clone() for k, v in gpu.items()}
        apply_patch(state, patch)
        assert all(_same(state[k].cpu(), news[k]) for k in news)
        state = {k: v.clone() for k, v in olds.items()}
        apply_patch(state, patch)
        assert all(_same(state[k], news[k]) for k in news)


@needs_cuda
def test_the_gpu_encodes_what_the_cpu_does() -> None:
    """On a GPU the lanes encode in one Triton kernel (ctxans._encode_lanes): the patch is the
    same, byte for byte, as the CPU's torch step loop writes."""
    olds, news = {}, {}
    for i, n in enumerate((1, 17, 3000, 70_000, 3000)):  # one symbol, a partial lane, many lanes
        olds[f"t{i}"], news[f"t{i}"] = _adam_like(n, 40 + i, lr=3e-4)
    cpu_patch = extract_patch(olds, news, encoding="ctxans", **VERSION)
    gpu_patch = extract_patch({k: v.cuda() for k, v in olds.items()}, {k: v.cuda() for k, v in news.items()},
                              encoding="ctxans", **VERSION)
    assert gpu_patch == cpu_patch


@needs_cuda
def test_a_corrupt_lane_is_refused_on_the_gpu(patch: bytes) -> None:
    data = _mutated(patch, "index", lambda s: s[:-40] + bytes([s[-40] ^ 0x10]) + s[-39:])
    old, _ = _adam_like(3000, 8)
    state = {"w": old.cuda()}
    with pytest.raises(CorruptPatchError, match="rANS lane|padding|beyond|extra"):
        apply_patch(state, data, verify=False)
    assert _same(state["w"].cpu(), old)


def test_entries_of_mixed_sizes_decode_together_in_the_callers_order(monkeypatch) -> None:
    """Same-size bases share one sort of their classes (split once a group passes _SORT_ELEMENTS);
    entries are decoded out of order inside and come back in the caller's; a check that fails for
    several entries names the first in the patch's order."""
    monkeypatch.setattr(ctxans, "_SORT_ELEMENTS", 7000)  # the four 3000s: two groups of two
    sizes = [3000, 700, 3000, 3000, 700, 1, 3000]
    old, new = {}, {}
    for i, n in enumerate(sizes):
        o, changed = _adam_like(max(n, 2), 30 + i, lr=3e-4)
        if n == 1:
            o, changed = o[:1].clone(), o[:1].clone()
            bits(changed)[0] += 1
        old[f"t{i}"], new[f"t{i}"] = o, changed
    patch = _round_trip(old, new)
    assert [t.encoding for t in read_header(patch).tensors] == ["ctxans"] * len(sizes)
    bad = {k: v.clone() for k, v in old.items()}
    for name in ("t3", "t1"):  # inside, t3's group is decoded before t1's
        bad[name] = torch.full((sizes[int(name[1])],), 1.0).bfloat16()  # one exponent class only
    with pytest.raises(CorruptPatchError, match="^t1: .*class"):
        apply_patch(bad, patch, verify=False)


def test_value_tables_own_pooled_and_mixed_in_one_call() -> None:
    """Per tensor: classes whose own table pays get one (in class order, after the pooled row of
    the rest, if any); every tensor's choice in one call, each as if alone."""
    mixed = torch.zeros(4, ctxans.VALUE_ALPHABET, dtype=torch.int64)
    mixed[0, :5] = torch.tensor([100000, 50000, 100, 10, 1])
    mixed[1, 3:9] = torch.tensor([90000, 10, 10, 10, 10, 70000])
    mixed[2:, 0], mixed[2:, 1] = 2, 1
    flat = torch.ones(2, ctxans.VALUE_ALPHABET, dtype=torch.int64)  # nothing pays: one pooled table
    tables, value_of = ctxans._value_tables([mixed, flat, mixed[:2]])
    assert [v.tolist() for v in value_of] == [[1, 2, 0, 0], [0, 0], [0, 1]]
    assert torch.equal(tables[0], ctxans.normalise(torch.stack([mixed[2:].sum(0), mixed[0], mixed[1]])))
    assert torch.equal(tables[1], ctxans.normalise(flat.sum(0, keepdim=True)))
    assert torch.equal(tables[2], ctxans.normalise(mixed[:2]))
    assert all(int(t.sum(1).unique()) == ctxans.TOTAL for t in tables)
