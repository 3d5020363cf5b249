"""Full-weight snapshots: safetensors bytes whose metadata carries run, version and fingerprint."""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save

from .errors import CorruptPatchError, FormatError, TruncatedPatchError
from .fingerprint import fingerprint


@dataclass(frozen=True)
class SnapshotInfo:
    run: str
    version: int
    fingerprint: str


def save_snapshot(state: Mapping[str, torch.Tensor], *, run: str, version: int) -> bytes:
    """safetensors bytes of `state` (copied to the host) with sparsecast metadata."""
    fp = fingerprint(state)
    # Always copy to the host: safetensors refuses tensors sharing storage (tied embeddings).
    host = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in state.items()}
    meta = {
        "format": "pt",
        "sparsecast.run": run,
        "sparsecast.version": str(version),
        "sparsecast.fingerprint": fp,
    }
    return save(host, metadata=meta)


# safetensors' own cap on its JSON header: a larger length field is corrupt, not a big model.
MAX_SNAPSHOT_HEADER_BYTES = 100_000_000


def snapshot_header_size(prefix: bytes | bytearray) -> int:
    """Bytes up to the end of the safetensors JSON header, from the first 9 bytes of a snapshot,
    so that a reader (or a registry taking an upload) refuses junk before reading more."""
    if len(prefix) < 9:
        raise TruncatedPatchError("need 9 bytes to read a snapshot's header length")
    (n,) = struct.unpack("<Q", bytes(prefix[:8]))
    if n > MAX_SNAPSHOT_HEADER_BYTES:
        raise FormatError(f"snapshot header length {n} exceeds {MAX_SNAPSHOT_HEADER_BYTES}")
    if prefix[8] != ord("{"):
        raise FormatError("not a safetensors file (its header is not a JSON object)")
    return 8 + n


def snapshot_size(head: bytes | bytearray) -> int:
    """The file size a snapshot's header declares (header + the end of the last tensor's data),
    from its first snapshot_header_size() bytes."""
    size = snapshot_header_size(head)
    if len(head) < size:
        raise TruncatedPatchError("snapshot shorter than its header")
    try:
        entries = json.loads(bytes(head[8:size]).decode("utf-8"))
        ends = [int(v["data_offsets"][1]) for k, v in entries.items() if k != "__metadata__"]
    except (ValueError, KeyError, AttributeError, TypeError, IndexError, RecursionError) as e:
        raise FormatError(f"snapshot header does not parse: {type(e).__name__}: {e}") from e
    return size + max(ends, default=0)


def snapshot_info(data: bytes) -> SnapshotInfo:
    """Run, version and fingerprint from a snapshot's safetensors header (tensors not read)."""
    size = snapshot_header_size(data)
    if len(data) < size:
        raise TruncatedPatchError("snapshot shorter than its header")
    try:
        meta = json.loads(data[8:size]).get("__metadata__") or {}
        return SnapshotInfo(
            meta["sparsecast.run"], int(meta["sparsecast.version"]), meta["sparsecast.fingerprint"]
        )
    except (ValueError, KeyError, AttributeError, TypeError) as e:
        raise FormatError(f"not a sparsecast snapshot: {e}") from e


def load_snapshot(
    data: bytes | memoryview, *, verify: bool = True
) -> tuple[dict[str, torch.Tensor], SnapshotInfo]:
    """Tensors (on the host) and info; with verify, the tensors must have the recorded fingerprint."""
    if not isinstance(data, bytes):  # safetensors parses only bytes (a download is a memoryview)
        data = bytes(data)
    info = snapshot_info(data)
    try:
        state = load(data)
    except SafetensorError as e:
        raise CorruptPatchError(f"snapshot does not parse: {e}") from e
    if verify and fingerprint(state) != info.fingerprint:
        raise CorruptPatchError(f"snapshot tensors do not match fingerprint {info.fingerprint}")
    return state, info
