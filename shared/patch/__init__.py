"""Lossless sparse weight patches: extract, encode, apply, merge, fingerprint, snapshot.

Public API (contract: docs/internals.md; byte format: docs/patch-format.md).
"""

from .apply import StagedPatch, apply_patch, commit_patch, stage_patch
from .codec import dense_bytes, extract_patch
from .errors import (
    CorruptPatchError,
    FormatError,
    PatchError,
    TargetMismatchError,
    TensorMismatchError,
    TruncatedPatchError,
    UnknownTensorError,
    WrongBaseError,
)
from .fingerprint import chunk_checksum, fingerprint
from .format import (
    MAGIC,
    Chunk,
    PatchHeader,
    Stream,
    TensorEntry,
    header_size,
    read_header,
    verify_chunk,
    verify_chunks,
)
from .merge import merge_patches
from .snapshot import (
    SnapshotInfo,
    load_snapshot,
    save_snapshot,
    snapshot_header_size,
    snapshot_info,
    snapshot_size,
)

__all__ = [
    "Chunk",
    "CorruptPatchError",
    "FormatError",
    "MAGIC",
    "PatchError",
    "PatchHeader",
    "SnapshotInfo",
    "StagedPatch",
    "Stream",
    "TargetMismatchError",
    "TensorEntry",
    "TensorMismatchError",
    "TruncatedPatchError",
    "UnknownTensorError",
    "WrongBaseError",
    "apply_patch",
    "chunk_checksum",
    "commit_patch",
    "dense_bytes",
    "extract_patch",
    "fingerprint",
    "header_size",
    "load_snapshot",
    "merge_patches",
    "read_header",
    "save_snapshot",
    "snapshot_header_size",
    "snapshot_info",
    "snapshot_size",
    "stage_patch",
    "verify_chunk",
    "verify_chunks",
]
