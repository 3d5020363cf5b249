"""The patch reader is as strict as a third-party reader written from docs/patch-format.md: each
malformed container below is refused with a typed error, checksums being otherwise intact."""

from __future__ import annotations

import hashlib
import json
import struct
import time
from dataclasses import replace

import pytest
import torch
import zstandard

from shared.patch import (
    CorruptPatchError,
    FormatError,
    PatchError,
    WrongBaseError,
    apply_patch,
    extract_patch,
    fingerprint,
    header_size,
    merge_patches,
    read_header,
)
from shared.patch.codec import EncodedTensor, bits, compress, decode_streams, stream_bytes
from shared.patch.format import MAX_HEADER_BYTES, PatchHeader, write_patch

torch.set_num_threads(1)


def _states() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    old = {
        "a.weight": torch.randn(32, 8, generator=g).bfloat16(),
        "b.weight": torch.randn(64, generator=g).bfloat16(),
    }
    new = {k: v.clone() for k, v in old.items()}
    bits(new["a.weight"])[[1, 5, 200, 255]] += 1
    bits(new["b.weight"])[[0, 63]] -= 1
    return old, new


@pytest.fixture(scope="module")
def patch() -> bytes:
    old, new = _states()
    return extract_patch(
        old, new, run="r", base_version=0, target_version=1, encoding="values", chunk_bytes=8
    )


def split(data: bytes) -> tuple[dict, bytes]:
    (h,) = struct.unpack_from("<I", data, 12)
    return json.loads(data[16 : 16 + h]), data[48 + h :]


def join(header: dict | bytes, data: bytes, *, rechunk: bool = True) -> bytes:
    """Container bytes with a correct header SHA-256 (and chunk hashes), whatever the header says."""
    if isinstance(header, dict):
        if rechunk:
            for c in header["chunks"]:
                c["sha256"] = hashlib.sha256(data[c["offset"] : c["offset"] + c["length"]]).hexdigest()
        body = json.dumps(header, separators=(",", ":")).encode()
    else:
        body = header
    return struct.pack("<8sHHI", b"SCPATCH\0", 1, 0, len(body)) + body + hashlib.sha256(body).digest() + data


def encoded(data: bytes) -> list[EncodedTensor]:
    """The tensors of a patch as the writer's input, to be laid out again with changes."""
    header = read_header(data)
    out = []
    for e in header.tensors:
        out.append(EncodedTensor(e.name, e.shape, e.dtype, e.encoding, e.count,
                                 bytes(stream_bytes(data, header, e.index)), e.index.raw_length,
                                 bytes(stream_bytes(data, header, e.payload)), e.payload.raw_length))
    return out


def rewrite(data: bytes, tensors: list[EncodedTensor]) -> bytes:
    h = read_header(data)
    header = PatchHeader(run=h.run, base_version=h.base_version, base_fingerprint=h.base_fingerprint,
                         target_version=h.target_version, target_fingerprint=h.target_fingerprint,
                         dense_bytes=h.dense_bytes, numel=h.numel, changed=sum(t.count for t in tensors),
                         chunk_bytes=h.chunk_bytes)
    return write_patch(header, tensors)


def refused(data: bytes, error: type[PatchError], match: str) -> None:
    """Refused by the reader and by apply, and the weights stay untouched."""
    old, _ = _states()
    state = {k: v.clone() for k, v in old.items()}
    with pytest.raises(error, match=match):
        apply_patch(state, data, verify=False)
    assert all(torch.equal(bits(state[k]), bits(old[k])) for k in old)


def test_the_untouched_patch_passes(patch: bytes) -> None:
    old, new = _states()
    header, data = split(patch)
    assert join(header, data) == patch  # the helpers rebuild the same bytes
    state = {k: v.clone() for k, v in old.items()}
    apply_patch(state, join(header, data))
    assert fingerprint(state) == fingerprint(new)


def test_header_length_is_capped_from_the_prefix_alone(patch: bytes) -> None:
    for flipped in (MAX_HEADER_BYTES + 1, 0x7FFF_FFFF, 0xFFFF_FFFF):
        prefix = patch[:12] + struct.pack("<I", flipped)
        with pytest.raises(FormatError, match="exceeds"):
            header_size(prefix)  # a ranged reader learns this from 16 bytes, before fetching more
        refused(prefix + patch[16:], FormatError, "exceeds")
    assert header_size(patch[:16]) < MAX_HEADER_BYTES


def test_writer_refuses_a_header_over_the_cap() -> None:
    g = torch.Generator().manual_seed(0)
    old = {"w": torch.randn(400_000, generator=g).bfloat16()}
    new = {"w": old["w"].clone()}
    bits(new["w"])[::2] += 1  # 200k changes: ~400 KB of streams, one chunk entry per byte
    t0 = time.perf_counter()
    with pytest.raises(FormatError, match="larger chunk_bytes"):
        extract_patch(old, new, run="r", base_version=0, target_version=1, encoding="values", chunk_bytes=1)
    assert time.perf_counter() - t0 < 60


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda h: h.update(changed=h["changed"] + 1), "sum of the tensors' counts"),
        (
            lambda h: h["tensors"][0]["payload"].update(offset=h["tensors"][0]["payload"]["offset"] + 1),
            "next",
        ),
        (lambda h: h["tensors"][1]["index"].update(offset=0), "next"),  # aliases tensor 0's stream
        (lambda h: h.update(data_bytes=h["data_bytes"] + 1), "cover"),
        (lambda h: h.update(chunk_bytes=0), "chunk_bytes"),
        (lambda h: h.update(chunk_bytes=h["chunk_bytes"] * 2), "tile|shorter"),
        (lambda h: h.update(base_fingerprint="fp1-XYZ"), "fingerprint"),
        (lambda h: h.update(target_fingerprint="md5-" + "0" * 32), "fingerprint"),
        (lambda h: h.update(base_version=1 << 63), "64-bit"),
        (lambda h: h["tensors"][0].update(shape=[1 << 63, 1]), "64-bit"),
        (lambda h: h.update(run="\ud800"), "Unicode"),
        (lambda h: h.update(note={"\udfff": 1}), "Unicode"),  # unknown fields are checked too
    ],
    ids=[
        "changed",
        "gap",
        "alias",
        "data_bytes",
        "chunk_zero",
        "chunk_tiling",
        "fingerprint",
        "fingerprint_kind",
        "int64",
        "shape_int64",
        "surrogate",
        "surrogate_key",
    ],
)
def test_header_inconsistencies_are_refused(patch: bytes, mutate, match: str) -> None:
    header, data = split(patch)
    mutate(header)
    refused(join(header, data), FormatError, match)


def test_tensors_out_of_name_order_or_repeated_are_refused(patch: bytes) -> None:
    a, b = encoded(patch)
    refused(rewrite(patch, [b, a]), FormatError, "out of name order")
    refused(rewrite(patch, [a, a]), FormatError, "repeated")


def test_chunks_of_unequal_sizes_are_refused(patch: bytes) -> None:
    header, data = split(patch)
    size = header["chunk_bytes"]
    assert len(data) > 3 * size
    # Consecutive and covering [0, D), each within chunk_bytes, but not slices of chunk_bytes.
    starts = [0, *range(size - 1, len(data), size)]
    header["chunks"] = [{"offset": o, "length": min(len(data), n) - o, "sha256": ""}
                        for o, n in zip(starts, [*starts[1:], len(data)], strict=True)]
    refused(join(header, data), FormatError, "shorter")


def test_header_must_be_utf8_json(patch: bytes) -> None:
    header, data = split(patch)
    text = json.dumps(header)
    cases = {
        "utf-16": text.encode("utf-16"),  # json.loads(bytes) alone would take it
        "utf-32": text.encode("utf-32-le"),
        "bom": b"\xef\xbb\xbf" + text.encode(),
        "bad utf-8": text.replace('"r"', '"\x00r"').encode().replace(b"\x00", b"\xff"),
        "NaN": text.replace('"numel": ', '"numel": NaN, "x": ').encode(),
        "repeated key": text.replace('"run": "r"', '"run": "r", "run": "other"').encode(),
        "nesting": b'{"format": "sparsecast-patch", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    }
    for body in cases.values():
        with pytest.raises(FormatError):
            read_header(join(body, data))
        refused(join(body, data), FormatError, "JSON|not a sparsecast|repeats")


def _with_stream(patch: bytes, index: bytes | None = None, payload: bytes | None = None,
                 index_raw_length: int | None = None) -> bytes:
    tensors = encoded(patch)
    first = tensors[0]
    tensors[0] = replace(
        first,
        index=first.index if index is None else index,
        payload=first.payload if payload is None else payload,
        index_raw_length=first.index_raw_length if index_raw_length is None else index_raw_length,
    )
    return rewrite(patch, tensors)


def _first_raw(patch: bytes) -> tuple[bytes, bytes]:
    header = read_header(patch)
    e = header.tensors[0]
    return decode_streams(e, stream_bytes(patch, header, e.index), stream_bytes(patch, header, e.payload))


def _trained_dictionary() -> zstandard.ZstdCompressionDict:
    rng = torch.Generator().manual_seed(0)
    samples = [
        bytes(torch.randint(0, 4, (200,), generator=rng, dtype=torch.uint8).tolist()) for _ in range(400)
    ]
    return zstandard.train_dictionary(1024, samples)


@pytest.mark.parametrize("case", ["no content size", "second frame", "trailing byte", "skippable frame",
                                  "dictionary", "not zstd"])
def test_a_stream_is_exactly_one_zstd_frame_with_its_size(patch: bytes, case: str) -> None:
    _, payload_raw = _first_raw(patch)
    frame = compress(payload_raw)
    stream = {
        "no content size": lambda: zstandard.ZstdCompressor(write_content_size=False).compress(payload_raw),
        "second frame": lambda: frame + compress(b""),
        "trailing byte": lambda: frame + b"\0",
        "skippable frame": lambda: struct.pack("<II", 0x184D2A50, 3) + b"abc" + frame,
        "dictionary": lambda: zstandard.ZstdCompressor(
            dict_data=_trained_dictionary(), write_content_size=True, write_dict_id=True
        ).compress(payload_raw),
        "not zstd": lambda: payload_raw,
    }[case]()
    bad = _with_stream(patch, payload=stream)
    read_header(bad)  # the container itself is well-formed; the stream is not
    refused(bad, CorruptPatchError, "zstd")


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda rest: b"\x81\x00" + rest, "over-long"),  # gap 1 in two bytes
        (lambda rest: b"\x81\x80\x00" + rest, "over-long"),  # gap 1 in three bytes
        (lambda rest: b"\xff" * 9 + b"\x01" + rest, "longer than 9"),
        (lambda rest: b"\x01" + rest + b"\x85", "ends inside"),
    ],
    ids=["two_bytes", "three_bytes", "ten_bytes", "unterminated"],
)
def test_non_minimal_leb128_is_refused(patch: bytes, build, match: str) -> None:
    index_raw, _ = _first_raw(patch)
    assert index_raw[0] == 1  # tensor a.weight changes flat index 1 first: gap 1, one byte
    raw = build(index_raw[1:])
    first = encoded(patch)[0]
    assert first.count <= len(raw) <= 9 * first.count  # the header's size bounds still hold
    refused(_with_stream(patch, index=compress(raw), index_raw_length=len(raw)), CorruptPatchError, match)


def test_the_minimal_form_of_the_same_gap_is_accepted(patch: bytes) -> None:
    # Control for the test above: the same rewrite with a canonical varint applies.
    index_raw, _ = _first_raw(patch)
    assert index_raw[0] == 1  # tensor a.weight changes flat index 1 first: gap 1
    old, new = _states()
    state = {k: v.clone() for k, v in old.items()}
    apply_patch(state, _with_stream(patch, index=compress(index_raw), index_raw_length=len(index_raw)))
    assert fingerprint(state) == fingerprint(new)


def test_index_sums_that_wrap_are_refused() -> None:
    # Gaps below prod(shape) each, whose running sum passes 2**63: the indices would go negative.
    count = 3
    leb = bytes([0x80] * 8 + [0x40]) * count  # three gaps of 2**62
    tensor = EncodedTensor("huge", (1 << 62, 4), "uint8", "values", count, compress(leb), len(leb),
                           compress(b"\1\2\3"), count)
    fp = "fp1-" + "0" * 32
    header = PatchHeader(
        run="r",
        base_version=0,
        base_fingerprint=fp,
        target_version=1,
        target_fingerprint=fp,
        dense_bytes=1 << 62,
        numel=1 << 62,
        changed=count,
        chunk_bytes=4096,
    )
    data = write_patch(header, [tensor])
    read_header(data)
    with pytest.raises(CorruptPatchError, match="overflow"):
        merge_patches([data])


def test_the_empty_patch() -> None:
    old, _ = _states()
    empty = extract_patch(old, old, run="r", base_version=3, target_version=4)
    header, data = split(empty)
    assert (header["tensors"], header["chunks"], header["changed"], header["data_bytes"], data) == (
        [],
        [],
        0,
        0,
        b"",
    )
    assert header["base_fingerprint"] == header["target_fingerprint"] == fingerprint(old)
    assert len(empty) == header_size(empty[:16])
    state = {k: v.clone() for k, v in old.items()}
    assert apply_patch(state, empty).changed == 0
    assert fingerprint(state) == fingerprint(old)
    header["target_fingerprint"] = "fp1-" + "1" * 32  # claims a change it does not carry
    refused(join(header, b""), FormatError, "empty patch")


def test_reapplying_needs_verify_false_and_only_values_patches_are_idempotent() -> None:
    old, new = _states()
    for encoding in ("values", "bitdelta"):
        patch = extract_patch(old, new, run="r", base_version=0, target_version=1, encoding=encoding)
        state = {k: v.clone() for k, v in old.items()}
        apply_patch(state, patch)
        with pytest.raises(WrongBaseError):
            apply_patch(state, patch)  # at the target now, not the base
        assert fingerprint(state) == fingerprint(new)
        apply_patch(state, patch, verify=False)
        if encoding == "values":
            assert fingerprint(state) == fingerprint(new)  # idempotent
        else:
            assert fingerprint(state) != fingerprint(new)  # the deltas were added twice
