"""Apply a patch in place, all-or-nothing, in two steps: the weights are busy only for the write.

`stage_patch` reads the weights and writes nothing (a serving engine keeps generating meanwhile):
it checks every chunk's sha256 and the base fingerprint, decodes and validates every tensor
against the model (gathering the old bit patterns it will overwrite), and predicts the target
fingerprint: a tensor's fingerprint sum S is a sum over its 64-bit words (fingerprint.py), so
S after the write = S before + change_sum over the words that change. A patch whose predicted
fingerprint is not its header's target is refused there, before a single weight moves.

`commit_patch` is the write: the new bits go in (on a GPU one scatter over all tensors,
shared.patch.scatter), then every written element is read back and compared. Unwritten elements
still hold the base bits that were fingerprinted while staging, provided nothing else wrote the
weights in between (the caller's lock: only the sync writes weights), so "every written element
reads back as predicted" means the weights now have exactly the target fingerprint. Where two
tensors of the state share bytes (tied embeddings listed twice) the prediction per name does not
hold, and the commit fingerprints the whole state instead. On any mismatch the old bit patterns
are written back before raising. `apply_patch` is both steps back to back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass

import torch

from . import scatter
from .codec import DecodedTensor, bits, decode_patch
from .errors import TargetMismatchError, WrongBaseError
from .fingerprint import change_sum, digest, tensor_sums, words_at
from .format import PatchHeader, parse_patch


@dataclass
class StagedPatch:
    """A patch decoded and verified against the weights it will be written into; nothing written."""

    header: PatchHeader
    decoded: list[DecodedTensor]
    verify: bool
    # Each tensor's fingerprint sum once written (all tensors of the state), predicted; None
    # without verify, or where tensors share bytes (the commit then fingerprints the whole state).
    sums: dict[str, int] | None
    addresses: dict[str, int]  # where each patched tensor lived when staged (data_ptr)
    writes: list[scatter.FlatWrite]  # the one-scatter form of the write (CUDA); empty: per tensor


def _write(state: MutableMapping[str, torch.Tensor], decoded: list[DecodedTensor], restore: bool) -> None:
    # Restoring walks backwards so that aliased tensors (e.g. tied embeddings) end at their old bits.
    for d in reversed(decoded) if restore else decoded:
        bits(state[d.name])[d.indices] = d.old_bits if restore else d.new_bits


def _overlapping(state: MutableMapping[str, torch.Tensor], patched: set[str]) -> bool:
    """Whether a patched tensor shares a byte with another entry of `state` (a sweep by start:
    a span overlaps an earlier one iff it starts before that one's end)."""
    reach = reach_patched = 0  # the furthest end of the spans so far, of the patched ones so far
    for start, end, is_patched in sorted(
            (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), name in patched)
            for name, t in state.items() if t.numel()):
        if start < reach_patched or (is_patched and start < reach):
            return True
        reach = max(reach, end)
        if is_patched:
            reach_patched = max(reach_patched, end)
    return False


def _predicted_change(target: torch.Tensor, d: DecodedTensor) -> torch.Tensor:
    """change_sum of writing d.new_bits at d.indices of `target` (a gather of the words touched)."""
    elements = bits(target)
    per_word = 8 // target.element_size()
    words, slot = torch.unique_consecutive(d.indices // per_word, return_inverse=True)
    old = words_at(elements, words)
    new = old.clone()
    new.view(elements.dtype)[slot * per_word + d.indices % per_word] = d.new_bits
    total_words = -(-target.numel() * target.element_size() // 8)
    return change_sum(old, new, words, total_words)


@contextlib.contextmanager
def _side_stream(device: torch.device) -> Iterator[None]:
    """On a GPU, run on a stream of our own and wait for it at the end: staging's host syncs then
    wait for staging's kernels only, not for generation's queued on the default stream."""
    if device.type != "cuda":
        yield
        return
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        yield
    stream.synchronize()


def stage_patch(
    state: MutableMapping[str, torch.Tensor], patch: bytes | memoryview, *, verify: bool = True,
    sums: dict[str, int] | None = None,
) -> StagedPatch:
    """Everything before the write, reading `state` only. `sums`: the state's tensor_sums if known
    (a chain's previous commit returned them), else computed here."""
    header = parse_patch(patch)
    devices = {state[e.name].device for e in header.tensors if e.name in state}
    device = next(iter(devices)) if len(devices) == 1 else torch.device("cpu")
    with torch.no_grad(), _side_stream(device):
        predicted: dict[str, int] | None = None
        if verify:
            base = dict(sums) if sums is not None else tensor_sums(state)
            actual = digest(state, base)
            if actual != header.base_fingerprint:
                raise WrongBaseError(
                    f"weights are {actual}, patch {header.base_version}->{header.target_version} "
                    f"of run {header.run!r} needs base {header.base_fingerprint}"
                )
        decoded = decode_patch(patch, header, state)
        if verify and not _overlapping(state, {d.name for d in decoded}):
            changes = [_predicted_change(state[d.name], d) for d in decoded]
            predicted = base
            if changes:
                for d, change in zip(decoded, torch.stack(changes).cpu().tolist(), strict=True):
                    predicted[d.name] = (predicted[d.name] + change) & (2**64 - 1)
            expected = digest(state, predicted)
            if expected != header.target_fingerprint:
                raise TargetMismatchError(
                    f"patching would give weights {expected}, expected {header.target_fingerprint}; "
                    "nothing written"
                )
        writes: list[scatter.FlatWrite] = []
        if len(devices) == 1 and scatter.available(device):
            writes = scatter.flat_writes([(state[d.name], d.indices, d.new_bits) for d in decoded])
    return StagedPatch(header, decoded, verify, predicted,
                       {d.name: state[d.name].data_ptr() for d in decoded}, writes)


def commit_patch(state: MutableMapping[str, torch.Tensor], staged: StagedPatch) -> dict[str, int] | None:
    """Write a staged patch in place and check what landed; restore and raise on a mismatch.
    Returns the state's tensor_sums after the write (None if staged without verify)."""
    moved = [name for name, address in staged.addresses.items() if state[name].data_ptr() != address]
    if moved:
        raise ValueError(f"{moved[0]} moved since the patch was staged; stage it again")
    decoded, header = staged.decoded, staged.header
    with torch.no_grad():
        if staged.writes:
            scatter.write(staged.writes)
        else:
            _write(state, decoded, restore=False)
        if not staged.verify:
            return None
        if staged.sums is None:
            sums = tensor_sums(state)
            actual = digest(state, sums)
        else:
            if staged.writes:
                wrong = int(scatter.wrong_after_write(staged.writes).item())
            else:
                wrong = sum(int((bits(state[d.name])[d.indices] != d.new_bits).sum()) for d in decoded)
            sums = staged.sums
            actual = header.target_fingerprint if not wrong else f"{wrong} written elements differ"
        if actual != header.target_fingerprint:
            _write(state, decoded, restore=True)
            raise TargetMismatchError(
                f"after patching, weights are {actual}, expected {header.target_fingerprint}; restored"
            )
    return sums


def apply_patch(
    state: MutableMapping[str, torch.Tensor], patch: bytes | memoryview, *, verify: bool = True
) -> PatchHeader:
    """Patch `state` in place (CPU or CUDA tensors). With verify, check base and target fingerprints."""
    staged = stage_patch(state, patch, verify=verify)
    commit_patch(state, staged)
    return staged.header
