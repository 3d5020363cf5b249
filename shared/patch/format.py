"""The patch container (normative spec: docs/patch-format.md).

    0      8  magic b"SCPATCH\\0"
    8      2  format version, u16 little-endian (1)
    10     2  reserved, 0
    12     4  H = length of the JSON header, u32 little-endian
    16     H  JSON header, UTF-8
    16+H  32  sha256 of the JSON header
    48+H      data region: the concatenated streams (zstd; rANS for `ctxans`), cut into chunks of
              `chunk_bytes` (the last one shorter), each with its own sha256 in the header's chunk table.

All offsets in the header are relative to the start of the data region.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from math import prod
from typing import Any

from .errors import CorruptPatchError, FormatError, TruncatedPatchError
from .fingerprint import FINGERPRINT_PREFIX, chunk_checksum

MAGIC = b"SCPATCH\0"
FORMAT_VERSION = 1
PREFIX_BYTES = 16
HEADER_DIGEST_BYTES = 32
# Cap on H, checked before the header is read: a flipped byte in the length field would otherwise
# have a ranged reader fetch up to 4 GiB before any checksum runs. 16 MiB holds ~150k chunk
# entries (a header is ~200 bytes per tensor and ~100 per chunk).
MAX_HEADER_BYTES = 16 << 20
MAX_INT = (1 << 63) - 1  # every header integer fits a signed 64-bit integer
_FINGERPRINT = re.compile(re.escape(FINGERPRINT_PREFIX) + r"[0-9a-f]{32}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
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
    encoding: str  # "values" | "bitdelta" | "ctxans"
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


@dataclass
class EncodedTensor:
    """One tensor's streams (codec.entropy_code makes them), ready to be laid out by write_patch."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    encoding: str
    count: int
    index: bytes
    index_raw_length: int
    payload: bytes
    payload_raw_length: int


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
    if len(body) > MAX_HEADER_BYTES:
        raise FormatError(f"header of {len(body)} bytes exceeds {MAX_HEADER_BYTES}: use larger chunk_bytes")
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
    if body_len > MAX_HEADER_BYTES:
        raise FormatError(f"header length {body_len} exceeds the format's cap of {MAX_HEADER_BYTES} bytes")
    return PREFIX_BYTES + body_len + HEADER_DIGEST_BYTES


def _get(d: dict, key: str, kind: type | tuple[type, ...]) -> Any:
    value = d.get(key)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise FormatError(f"header field {key!r} missing or not {getattr(kind, '__name__', kind)}")
    if isinstance(value, int) and not 0 <= value <= MAX_INT:
        raise FormatError(f"header field {key!r} is negative or beyond a signed 64-bit integer")
    return value


def _stream(d: dict, at: int, what: str) -> Stream:
    """A stream that starts where the previous one ended (the data region is their concatenation)."""
    s = Stream(_get(d, "offset", int), _get(d, "length", int), _get(d, "raw_length", int))
    if s.offset != at or s.length == 0:
        raise FormatError(f"{what} is not the next non-empty slice of the data region (offset {at})")
    return s


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    d = dict(pairs)
    if len(d) != len(pairs):
        raise FormatError("header repeats a key")  # readers could disagree on which one counts
    return d


def _refuse_constant(name: str) -> Any:
    raise FormatError(f"header holds {name}, which is not JSON")


def _check_utf8(value: Any) -> None:
    """Every string (keys too) must be encodable as UTF-8: no lone surrogates from \\u escapes."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as e:
                raise FormatError(f"header string is not valid Unicode: {e.reason}") from e
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _load_json(body: bytes) -> dict:
    try:
        text = body.decode("utf-8")  # json.loads(bytes) would also accept UTF-16 and UTF-32
        d = json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_refuse_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise FormatError(f"header is not UTF-8 JSON: {type(e).__name__}: {e}") from e
    _check_utf8(d)
    if not isinstance(d, dict) or d.get("format") != "sparsecast-patch":
        raise FormatError("header is not a sparsecast patch header")
    return d


def _fingerprint(d: dict, key: str) -> str:
    value = _get(d, key, str)
    if not _FINGERPRINT.fullmatch(value):
        raise FormatError(f"header field {key!r} is not a {FINGERPRINT_PREFIX} fingerprint")
    return value


def _parse(body: bytes) -> PatchHeader:
    """Check everything docs/patch-format.md §2 requires of a header, as a strict reader would."""
    d = _load_json(body)
    data_bytes = _get(d, "data_bytes", int)
    header = PatchHeader(
        run=_get(d, "run", str), base_version=_get(d, "base_version", int),
        base_fingerprint=_fingerprint(d, "base_fingerprint"), target_version=_get(d, "target_version", int),
        target_fingerprint=_fingerprint(d, "target_fingerprint"), dense_bytes=_get(d, "dense_bytes", int),
        numel=_get(d, "numel", int), changed=_get(d, "changed", int), chunk_bytes=_get(d, "chunk_bytes", int),
    )
    at = 0  # streams tile the data region in tensor order: index, payload, next tensor's index, ...
    for t in _get(d, "tensors", list):
        if not isinstance(t, dict):
            raise FormatError("tensor entry is not an object")
        shape = _get(t, "shape", list)
        if not all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= MAX_INT for n in shape):
            raise FormatError("tensor shape must be a list of non-negative 64-bit integers")
        name = _get(t, "name", str)
        index = _stream(_get(t, "index", dict), at, f"{name}: index stream")
        payload = _stream(_get(t, "payload", dict), index.offset + index.length, f"{name}: payload stream")
        at = payload.offset + payload.length
        entry = TensorEntry(
            name=name, shape=tuple(shape), dtype=_get(t, "dtype", str), encoding=_get(t, "encoding", str),
            count=_get(t, "count", int), index=index, payload=payload,
        )
        if header.tensors and not header.tensors[-1].name < entry.name:
            raise FormatError(f"tensor {entry.name!r} is out of name order or repeated")
        if entry.dtype not in WIDTHS or entry.encoding not in ("values", "bitdelta", "ctxans"):
            raise FormatError(f"{entry.name}: unknown dtype {entry.dtype!r} or encoding {entry.encoding!r}")
        if not 0 < entry.count <= prod(entry.shape):
            raise FormatError(f"{entry.name}: count {entry.count} out of range")
        if entry.encoding == "ctxans":  # rANS streams, stored as they are (§4.1)
            if entry.dtype != "bfloat16" or prod(entry.shape) >= 1 << 31:
                raise FormatError(f"{entry.name}: ctxans codes bfloat16 tensors below 2**31 elements only")
            stored = (entry.index.length, entry.payload.length)
            if (entry.index.raw_length, entry.payload.raw_length) != stored:
                raise FormatError(f"{entry.name}: a ctxans stream's raw_length must equal its length")
        elif entry.payload.raw_length != entry.count * WIDTHS[entry.dtype]:
            raise FormatError(f"{entry.name}: payload size does not match count and dtype")
        elif not entry.count <= entry.index.raw_length <= 9 * entry.count:
            raise FormatError(f"{entry.name}: index size does not match count")
        header.tensors.append(entry)
    if at != data_bytes:
        raise FormatError(f"the streams cover {at} bytes of a data region of {data_bytes}")
    if header.changed != sum(t.count for t in header.tensors):
        raise FormatError(f"changed={header.changed} is not the sum of the tensors' counts")
    if not header.tensors and header.base_fingerprint != header.target_fingerprint:
        raise FormatError("an empty patch must have equal base and target fingerprints")
    if header.chunk_bytes == 0:
        raise FormatError("chunk_bytes must be positive")
    expected = 0
    for c in _get(d, "chunks", list):
        if not isinstance(c, dict):
            raise FormatError("chunk entry is not an object")
        chunk = Chunk(_get(c, "offset", int), _get(c, "length", int), _get(c, "sha256", str))
        # Chunks are consecutive slices of chunk_bytes; only the last one may be shorter.
        if chunk.offset != expected or not 0 < chunk.length <= header.chunk_bytes:
            raise FormatError("chunk table does not tile the data region")
        if header.chunks and header.chunks[-1].length != header.chunk_bytes:
            raise FormatError("only the last chunk may be shorter than chunk_bytes")
        if not _SHA256.fullmatch(chunk.sha256):
            raise FormatError("chunk sha256 is not 64 lower-case hex digits")
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
