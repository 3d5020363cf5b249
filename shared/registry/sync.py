"""The one weight sync: bring weights from a version to another, verified, with a snapshot fallback.

Used by the trainer's resume, a worker's bootstrap and a worker's live sync. Patches are applied
in place, all-or-nothing each, with their target fingerprints checked. If any verification fails
(or an object of the path is gone), the snapshot path is taken instead; its tensors are verified
and checked against the weights' names, shapes and dtypes before a single weight is overwritten.
An empty state is filled from the snapshot. Errors that mean "the registry is unreachable now"
propagate as they are (callers wait those out, shared.retry); any other failure of the snapshot
path raises SyncError saying which version the (intact) weights hold.

Where the weights live is a `WeightTarget`: a plain tensor dict by default, with hooks a serving
engine overrides (services.rollout.sync): downloads and decoding run outside `writing()` (the
engine lock) so generation goes on; only the in-place writes hold it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import MutableMapping
from dataclasses import dataclass

import torch

from shared.patch import PatchError, apply_patch, commit_patch, load_snapshot, stage_patch
from shared.registry.client import RegistryClient
from shared.registry.errors import CorruptObjectError, RegistryHTTPError, SyncError
from shared.registry.wire import Plan, PlanKind
from shared.retry import transient

log = logging.getLogger(__name__)


@dataclass
class SyncResult:
    version: int
    fingerprint: str
    bytes: int  # bytes received over the network (retried and resumed bytes included)
    seconds: float
    path: PlanKind  # the path that reached the version ("snapshot" after a fallback)
    plan: Plan  # the first plan asked for (its kind and size, before any fallback)
    fell_back: bool = False  # the first path failed verification; the snapshot path was used


class WeightTarget:
    """Where synced weights land: `state()` is written in place while `writing()` is held;
    `updated` hears which tensors changed, `reached` each verified version, `phase` what the
    sync does ("downloading", "decoding", "applying")."""

    def __init__(self, state: MutableMapping[str, torch.Tensor] | None = None) -> None:
        self._state: MutableMapping[str, torch.Tensor] = {} if state is None else state

    def state(self) -> MutableMapping[str, torch.Tensor]:
        return self._state

    def writing(self) -> contextlib.AbstractAsyncContextManager[object]:
        return contextlib.nullcontext()

    def updated(self, names: set[str]) -> None:
        """The named tensors were written (a serving engine refreshes what it derives from them)."""

    def reached(self, version: int, fingerprint: str) -> None:
        """The weights now verifiably hold `version`."""

    def phase(self, phase: str) -> None:
        """What the sync does now (shown by a worker's status)."""


async def sync_weights(
    client: RegistryClient,
    weights: WeightTarget | MutableMapping[str, torch.Tensor],
    current_version: int | None,
    target: int | None = None,
) -> SyncResult:
    """Bring `weights` from current_version (None: no weights) to target (None: latest), in place."""
    into = weights if isinstance(weights, WeightTarget) else WeightTarget(weights)
    t0 = time.perf_counter()
    bytes0 = client.counters.bytes
    first = plan = await client.plan(current_version, target)
    version = current_version
    fell_back = False
    if plan.kind in ("merged", "chain"):
        into.phase("downloading")
        try:
            blobs = await client.download([step.object for step in plan.steps])
            version = await apply_patches(into, blobs, version)
        except (CorruptObjectError, PatchError, RegistryHTTPError) as exc:
            if transient(exc):  # the registry is down: the caller waits that out
                raise
            # incl. an object gone from storage (404)
            log.warning("patch path %s→%s failed (%s); falling back to a snapshot",
                        current_version, plan.to_version, exc)
            await _report(client, exc)
            fell_back = True
            plan = await client.plan(None, plan.to_version)
    for attempt in range(2):
        if plan.kind != "snapshot":
            break
        into.phase("downloading")
        try:
            await _install_snapshot(into, client, plan)
            break
        except (CorruptObjectError, PatchError, ValueError, RegistryHTTPError) as exc:
            if transient(exc):
                raise
            # A bad object the registry now quarantines: its next plan routes around it (or says
            # that nothing reaches the version until the trainer uploads a snapshot).
            if attempt == 0 and await _report(client, exc):
                try:
                    plan = await client.plan(None, plan.to_version)
                    continue
                except RegistryHTTPError as again:
                    if transient(again):
                        raise
                    exc = again
            raise SyncError(f"snapshot path to {plan.to_version} failed: {exc}", version) from exc
    return SyncResult(
        version=plan.to_version,
        fingerprint=plan.fingerprint,
        bytes=client.counters.bytes - bytes0,
        seconds=time.perf_counter() - t0,
        path=plan.kind,
        plan=first,
        fell_back=fell_back,
    )


async def _report(client: RegistryClient, exc: Exception) -> bool:
    """Tell the registry about an object that failed its sha256 here (it re-checks its copy);
    True when it quarantined it. Never raises: a report is a courtesy, the sync goes on."""
    if not isinstance(exc, CorruptObjectError) or exc.key is None:
        return False
    try:
        verdict = await client.report_corrupt(exc.key)
    except Exception as report_error:  # noqa: BLE001 - an old registry, an outage: sync as before
        log.warning("reporting corrupt %s to the registry failed: %s", exc.key, report_error)
        return False
    log.warning("reported corrupt %s: the registry %s", exc.key,
                "quarantined it" if verdict.quarantined else "found its copy good")
    return verdict.quarantined


async def apply_patches(into: WeightTarget, blobs: list[memoryview], version: int | None) -> int | None:
    """Each patch is staged (verified and decoded against the live weights, which it only reads)
    while generation goes on, then written under `writing()`: the engine pauses only for the
    in-place write and its read-back check (shared.patch.apply). Only the sync writes weights, so
    they cannot change between a patch's staging and its write."""
    sums: dict[str, int] | None = None  # the weights' fingerprint sums after the last write
    state = into.state()  # read once, outside the pause (commit_patch refuses tensors that moved)
    for blob in blobs:
        into.phase("decoding")
        staged = await asyncio.to_thread(stage_patch, state, blob, verify=True, sums=sums)
        async with into.writing():  # a batch boundary: nothing reads the weights while they change
            into.phase("applying")
            try:
                sums = await asyncio.to_thread(commit_patch, state, staged)
            finally:
                into.updated({d.name for d in staged.decoded})  # also after a restore: it rewrote them
            version = staged.header.target_version
            into.reached(staged.header.target_version, staged.header.target_fingerprint)
    return version


async def _install_snapshot(into: WeightTarget, client: RegistryClient, plan: Plan) -> None:
    blobs = await client.download([step.object for step in plan.steps])

    def build() -> tuple[dict[str, torch.Tensor], str]:
        tensors, info = load_snapshot(blobs[0])  # checks the tensors against its fingerprint
        if info.fingerprint != plan.steps[0].fingerprint:
            raise CorruptObjectError(f"snapshot {plan.steps[0].object.key} holds {info.fingerprint}, "
                                     f"the plan expects {plan.steps[0].fingerprint}")
        fp = info.fingerprint
        for blob in blobs[1:]:
            fp = apply_patch(tensors, blob, verify=True).target_fingerprint
        return tensors, fp

    tensors, fp = await asyncio.to_thread(build)  # decoded off the lock, while generation goes on
    if fp != plan.fingerprint:
        raise CorruptObjectError(
            f"snapshot path ends at fingerprint {fp}, the plan promised {plan.fingerprint}"
        )
    async with into.writing():
        into.phase("applying")
        state = into.state()
        if state:
            if set(state) != set(tensors):
                missing, extra = sorted(set(tensors) - set(state)), sorted(set(state) - set(tensors))
                raise ValueError(f"snapshot tensors differ from the weights (missing {missing[:3]}, "
                                 f"extra {extra[:3]})")
            for name, tensor in tensors.items():  # check everything before the first write
                if state[name].shape != tensor.shape or state[name].dtype != tensor.dtype:
                    raise ValueError(
                        f"{name}: snapshot has {tensor.dtype}{list(tensor.shape)}, weights differ"
                    )
            with torch.no_grad():
                for name, tensor in tensors.items():
                    state[name].copy_(tensor)
        else:
            state.update(tensors)
        into.updated(set(tensors))
        into.reached(plan.to_version, fp)
