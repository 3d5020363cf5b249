"""Apply a patch in place, all-or-nothing.

Order: check every chunk's sha256, the base fingerprint, and decode + validate every tensor
against the model; only then write. If the target fingerprint does not match after writing, the
old bit patterns (gathered while decoding) are written back before raising.
"""

from __future__ import annotations

from collections.abc import MutableMapping

import torch

from .codec import DecodedTensor, bits, decode_patch
from .errors import TargetMismatchError, WrongBaseError
from .fingerprint import fingerprint
from .format import PatchHeader, parse_patch


def _write(state: MutableMapping[str, torch.Tensor], decoded: list[DecodedTensor], restore: bool) -> None:
    # Restoring walks backwards so that aliased tensors (e.g. tied embeddings) end at their old bits.
    for d in reversed(decoded) if restore else decoded:
        bits(state[d.name])[d.indices] = d.old_bits if restore else d.new_bits


def apply_patch(
    state: MutableMapping[str, torch.Tensor], patch: bytes | memoryview, *, verify: bool = True
) -> PatchHeader:
    """Patch `state` in place (CPU or CUDA tensors). With verify, check base and target fingerprints."""
    header = parse_patch(patch)
    with torch.no_grad():
        if verify:
            actual = fingerprint(state)
            if actual != header.base_fingerprint:
                raise WrongBaseError(
                    f"weights are {actual}, patch {header.base_version}->{header.target_version} "
                    f"of run {header.run!r} needs base {header.base_fingerprint}"
                )
        decoded = decode_patch(patch, header, state)
        _write(state, decoded, restore=False)
        if verify:
            actual = fingerprint(state)
            if actual != header.target_fingerprint:
                _write(state, decoded, restore=True)
                raise TargetMismatchError(
                    f"after patching, weights are {actual}, expected {header.target_fingerprint}; restored"
                )
    return header
