"""An independent decoder written from docs/patch-format.md alone (plain Python, no shared.patch
internals) must read what shared.patch writes: the spec is complete and the code follows it."""

import hashlib
import json
import struct

import numpy as np
import torch
import zstandard

from shared.patch import extract_patch, fingerprint

M64 = (1 << 64) - 1
WIDTH = {"bfloat16": 2, "float16": 2, "float32": 4}


def _signed64(v: int) -> int:
    v &= M64
    return v - (1 << 64) if v >> 63 else v


def spec_fingerprint(tensors: dict[str, tuple[str, tuple[int, ...], bytes]]) -> str:
    a = [int(x) for x in np.random.default_rng(0x5EEDCA57).integers(0, 2**63, size=1024, dtype=np.int64) | 1]
    h = hashlib.blake2b(digest_size=16, person=b"sparsecast-fp1")
    for name in sorted(tensors):
        dtype, shape, raw = tensors[name]
        raw += b"\0" * (-len(raw) % 8)
        s = 0
        for j in range(len(raw) // 8):
            w = struct.unpack_from("<q", raw, 8 * j)[0]
            x = _signed64(w ^ (w >> 29))
            z = _signed64((j // 1024 + 1) * -7046029254386353131)
            b = (z ^ (z >> 29)) | 1
            s = (s + x * a[j % 1024] * b) & M64
        h.update(f"{name}\0{dtype}\0{shape}\0".encode())
        h.update(s.to_bytes(8, "little"))
    return "fp1-" + h.hexdigest()


def spec_apply(patch: bytes, tensors: dict[str, tuple[str, tuple[int, ...], bytes]]) -> dict:
    magic, version, reserved, hlen = struct.unpack_from("<8sHHI", patch)
    assert (magic, version, reserved) == (b"SCPATCH\0", 1, 0)
    body = patch[16 : 16 + hlen]
    assert hashlib.sha256(body).digest() == patch[16 + hlen : 48 + hlen]
    header = json.loads(body)
    data = patch[48 + hlen :]
    assert len(data) == header["data_bytes"]
    for c in header["chunks"]:
        assert hashlib.sha256(data[c["offset"] : c["offset"] + c["length"]]).hexdigest() == c["sha256"]
    assert spec_fingerprint(tensors) == header["base_fingerprint"]
    out = dict(tensors)
    for t in header["tensors"]:
        w = WIDTH[t["dtype"]]
        index = zstandard.ZstdDecompressor().decompress(data[t["index"]["offset"] :][: t["index"]["length"]])
        payload = zstandard.ZstdDecompressor().decompress(
            data[t["payload"]["offset"] :][: t["payload"]["length"]]
        )
        gaps, value, shift = [], 0, 0
        for byte in index:
            value |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                gaps.append(value)
                value, shift = 0, 0
        positions, pos = [], -1
        for g in gaps:
            pos += g + 1
            positions.append(pos)
        n = t["count"]
        us = [sum(payload[k * n + i] << (8 * k) for k in range(w)) for i in range(n)]
        dtype, shape, raw = out[t["name"]]
        buf = bytearray(raw)
        for p, u in zip(positions, us, strict=True):
            if t["encoding"] == "bitdelta":
                d = (u >> 1) ^ -(u & 1)
                u = (int.from_bytes(buf[p * w : (p + 1) * w], "little") + d) % (1 << (8 * w))
            buf[p * w : (p + 1) * w] = u.to_bytes(w, "little")
        out[t["name"]] = (dtype, shape, bytes(buf))
    assert spec_fingerprint(out) == header["target_fingerprint"]
    return out


def _as_spec(state: dict[str, torch.Tensor]) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    return {
        k: (
            str(v.dtype).removeprefix("torch."),
            tuple(v.shape),
            v.view(-1).view(torch.uint8).numpy().tobytes(),
        )
        for k, v in state.items()
    }


def test_a_decoder_written_from_the_spec_reads_our_patches():
    g = torch.Generator().manual_seed(3)
    old = {"emb": torch.randn(40, 70, generator=g).bfloat16(), "norm": torch.randn(9, generator=g).half(),
           "head": torch.randn(3, 5, generator=g)}
    new = {k: v.clone() for k, v in old.items()}
    flat = new["emb"].view(-1)
    flat[::37] = flat[::37] * 1.01
    flat[5] = -flat[5]
    new["norm"][[0, 8]] = torch.tensor([float("nan"), -0.0]).half()
    new["head"][1, 2] = float("inf")
    for encoding in ("values", "bitdelta", "auto"):
        patch = extract_patch(
            old, new, run="r", base_version=0, target_version=1, encoding=encoding, chunk_bytes=100
        )
        assert spec_apply(patch, _as_spec(old)) == _as_spec(new)
    assert spec_fingerprint(_as_spec(new)) == fingerprint(new)
