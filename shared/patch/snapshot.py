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
    meta = {"format": "pt", "sparsecast.run": run, "sparsecast.version": str(version), "sparsecast.fingerprint": fp}
    return save(host, metadata=meta)


def snapshot_info(data: bytes) -> SnapshotInfo:
    """Run, version and fingerprint from a snapshot's safetensors header (tensors not read)."""
    if len(data) < 8:
        raise TruncatedPatchError("snapshot shorter than its 8-byte header length")
    (n,) = struct.unpack("<Q", data[:8])
    if len(data) < 8 + n:
        raise TruncatedPatchError("snapshot shorter than its header")
    try:
        meta = json.loads(data[8 : 8 + n]).get("__metadata__") or {}
        return SnapshotInfo(meta["sparsecast.run"], int(meta["sparsecast.version"]), meta["sparsecast.fingerprint"])
    except (ValueError, KeyError, AttributeError, TypeError) as e:
        raise FormatError(f"not a sparsecast snapshot: {e}") from e


def load_snapshot(data: bytes | memoryview, *, verify: bool = True) -> tuple[dict[str, torch.Tensor], SnapshotInfo]:
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
