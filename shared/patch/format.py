"""The patch container (normative spec: docs/patch-format.md).

    0      8  magic b"SCPATCH\\0"
    8      2  format version, u16 little-endian (1)
    10     2  reserved, 0
    12     4  H = length of the JSON header, u32 little-endian
    16     H  JSON header, UTF-8
    16+H  32  sha256 of the JSON header
    48+H      data region: the concatenated zstd streams, cut into chunks of `chunk_bytes`
              (the last one shorter), each with its own sha256 in the header's chunk table.

All offsets in the header are relative to the start of the data region.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from math import prod
from typing import TYPE_CHECKING, Any

from .errors import CorruptPatchError, FormatError, TruncatedPatchError
from .fingerprint import chunk_checksum

if TYPE_CHECKING:
    from .codec import EncodedTensor

MAGIC = b"SCPATCH\0"
FORMAT_VERSION = 1
PREFIX_BYTES = 16
HEADER_DIGEST_BYTES = 32
_PREFIX = struct.Struct("<8sHHI")
WIDTHS = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "int8": 1, "uint8": 1,
           "int16": 2, "int32": 4, "int64": 8}
_POOL = ThreadPoolExecutor(max_workers=8, thread_name_prefix="sparsecast-sha")


@dataclass(frozen=True)
class Stream:
    offset: int  # in the data region
    length: int  # stored (zstd) bytes
    raw_length: int  # bytes after zstd decompression


@dataclass(frozen=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]
    dtype: str
    encoding: str  # "values" | "bitdelta"
    count: int  # changed elements
    index: Stream
    payload: Stream


@dataclass(frozen=True)
class Chunk:
    offset: int  # in the data region
    length: int
    sha256: str


@dataclass
class PatchHeader:
    run: str
    base_version: int
    base_fingerprint: str
    target_version: int
    target_fingerprint: str
    dense_bytes: int  # bytes of the whole target model, dense
    numel: int  # elements of the whole target model
    changed: int  # changed elements in this patch
    chunk_bytes: int
    tensors: list[TensorEntry] = field(default_factory=list)
    chunks: list[Chunk] = field(default_factory=list)
    header_bytes: int = 0  # start of the data region = prefix + JSON + digest
    total_size: int = 0

    def to_json(self) -> bytes:
        d = asdict(self)
        del d["header_bytes"], d["total_size"]
        d["data_bytes"] = sum(c.length for c in self.chunks)
        d["format"] = "sparsecast-patch"
        return json.dumps(d, separators=(",", ":"), ensure_ascii=True).encode()


def write_patch(header: PatchHeader, encoded: Sequence[EncodedTensor]) -> bytes:
    """Lay out the streams, cut them into checksummed chunks, prepend the header."""
    if header.chunk_bytes <= 0:
        raise FormatError("chunk_bytes must be positive")
    parts: list[bytes] = []
    offset = 0
    tensors = []
    for e in encoded:
        index = Stream(offset, len(e.index), e.index_raw_length)
        payload = Stream(offset + len(e.index), len(e.payload), e.payload_raw_length)
        offset += len(e.index) + len(e.payload)
        parts += [e.index, e.payload]
        tensors.append(TensorEntry(e.name, tuple(e.shape), e.dtype, e.encoding, e.count, index, payload))
    data = b"".join(parts)
    spans = [(o, min(header.chunk_bytes, len(data) - o)) for o in range(0, len(data), header.chunk_bytes)]
    view = memoryview(data)
    digests = _POOL.map(lambda s: chunk_checksum(view[s[0] : s[0] + s[1]]), spans)
    header.tensors = tensors
    header.chunks = [Chunk(o, n, d) for (o, n), d in zip(spans, digests, strict=True)]
    body = header.to_json()
    header.header_bytes = PREFIX_BYTES + len(body) + HEADER_DIGEST_BYTES
    header.total_size = header.header_bytes + len(data)
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, 0, len(body))
    return b"".join([prefix, body, hashlib.sha256(body).digest(), data])


def header_size(prefix: bytes | memoryview) -> int:
    """Bytes needed to parse the header, from the first 16 bytes of a patch."""
    if len(prefix) < PREFIX_BYTES:
        raise TruncatedPatchError(f"need {PREFIX_BYTES} bytes to read the prefix, got {len(prefix)}")
    magic, version, reserved, body_len = _PREFIX.unpack(bytes(prefix[:PREFIX_BYTES]))
    if magic != MAGIC:
        raise FormatError("not a sparsecast patch (bad magic)")
    if version != FORMAT_VERSION:
        raise FormatError(f"unsupported patch format version {version} (this reader knows {FORMAT_VERSION})")
    if reserved != 0:
        raise FormatError("reserved prefix field is not zero")
    return PREFIX_BYTES + body_len + HEADER_DIGEST_BYTES


def _get(d: dict, key: str, kind: type | tuple[type, ...]) -> Any:
    value = d.get(key)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise FormatError(f"header field {key!r} missing or not {getattr(kind, '__name__', kind)}")
    if isinstance(value, int) and value < 0:
        raise FormatError(f"header field {key!r} is negative")
    return value


def _stream(d: dict, data_bytes: int, what: str) -> Stream:
    s = Stream(_get(d, "offset", int), _get(d, "length", int), _get(d, "raw_length", int))
    if s.offset + s.length > data_bytes:
        raise FormatError(f"{what} lies beyond the data region")
    return s


def _parse(body: bytes) -> PatchHeader:
    try:
        d = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FormatError(f"header is not JSON: {e}") from e
    if not isinstance(d, dict) or d.get("format") != "sparsecast-patch":
        raise FormatError("header is not a sparsecast patch header")
    data_bytes = _get(d, "data_bytes", int)
    header = PatchHeader(
        run=_get(d, "run", str), base_version=_get(d, "base_version", int),
        base_fingerprint=_get(d, "base_fingerprint", str), target_version=_get(d, "target_version", int),
        target_fingerprint=_get(d, "target_fingerprint", str), dense_bytes=_get(d, "dense_bytes", int),
        numel=_get(d, "numel", int), changed=_get(d, "changed", int), chunk_bytes=_get(d, "chunk_bytes", int),
    )
    names = set()
    for t in _get(d, "tensors", list):
        if not isinstance(t, dict):
            raise FormatError("tensor entry is not an object")
        shape = _get(t, "shape", list)
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
            raise FormatError("tensor shape must be a list of non-negative integers")
        entry = TensorEntry(
            name=_get(t, "name", str), shape=tuple(shape), dtype=_get(t, "dtype", str),
            encoding=_get(t, "encoding", str), count=_get(t, "count", int),
            index=_stream(_get(t, "index", dict), data_bytes, "index stream"),
            payload=_stream(_get(t, "payload", dict), data_bytes, "payload stream"),
        )
        if entry.name in names:
            raise FormatError(f"tensor {entry.name!r} appears twice")
        names.add(entry.name)
        if entry.dtype not in WIDTHS or entry.encoding not in ("values", "bitdelta"):
            raise FormatError(f"{entry.name}: unknown dtype {entry.dtype!r} or encoding {entry.encoding!r}")
        if not 0 < entry.count <= prod(entry.shape):
            raise FormatError(f"{entry.name}: count {entry.count} out of range")
        if entry.payload.raw_length != entry.count * WIDTHS[entry.dtype]:
            raise FormatError(f"{entry.name}: payload size does not match count and dtype")
        if not entry.count <= entry.index.raw_length <= 9 * entry.count:
            raise FormatError(f"{entry.name}: index size does not match count")
        header.tensors.append(entry)
    expected = 0
    for c in _get(d, "chunks", list):
        if not isinstance(c, dict):
            raise FormatError("chunk entry is not an object")
        chunk = Chunk(_get(c, "offset", int), _get(c, "length", int), _get(c, "sha256", str))
        if chunk.offset != expected or chunk.length == 0:
            raise FormatError("chunk table does not tile the data region")
        expected += chunk.length
        header.chunks.append(chunk)
    if expected != data_bytes:
        raise FormatError("chunk table does not cover the data region")
    return header


def read_header(data: bytes | memoryview) -> PatchHeader:
    """Parse and check the header (needs header_size(data[:16]) bytes, not the data region)."""
    size = header_size(data)
    if len(data) < size:
        raise TruncatedPatchError(f"header needs {size} bytes, got {len(data)}")
    body = bytes(data[PREFIX_BYTES : size - HEADER_DIGEST_BYTES])
    if hashlib.sha256(body).digest() != bytes(data[size - HEADER_DIGEST_BYTES : size]):
        raise CorruptPatchError("header checksum mismatch")
    header = _parse(body)
    header.header_bytes = size
    header.total_size = size + sum(c.length for c in header.chunks)
    return header


def verify_chunk(chunk_data: bytes | memoryview, chunk: Chunk, index: int) -> None:
    """Check one chunk fetched on its own (e.g. by a ranged GET)."""
    if len(chunk_data) != chunk.length:
        raise TruncatedPatchError(f"chunk {index}: {len(chunk_data)} bytes, expected {chunk.length}")
    if chunk_checksum(chunk_data) != chunk.sha256:
        raise CorruptPatchError(f"chunk {index} checksum mismatch")


def verify_chunks(data: bytes | memoryview, header: PatchHeader) -> None:
    """Check the length of a whole patch and every chunk's sha256 (in parallel)."""
    if len(data) < header.total_size:
        raise TruncatedPatchError(f"patch has {len(data)} bytes, header says {header.total_size}")
    if len(data) > header.total_size:
        raise CorruptPatchError(f"patch has {len(data) - header.total_size} trailing bytes")
    view = memoryview(data)
    base = header.header_bytes

    def check(item: tuple[int, Chunk]) -> None:
        i, c = item
        verify_chunk(view[base + c.offset : base + c.offset + c.length], c, i)

    list(_POOL.map(check, enumerate(header.chunks)))


def parse_patch(data: bytes | memoryview) -> PatchHeader:
    """read_header + verify_chunks: the whole patch is intact."""
    header = read_header(data)
    verify_chunks(data, header)
    return header
