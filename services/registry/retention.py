"""Retention: which versions and merged patches of a run the store keeps (docs/registry.md)."""

from __future__ import annotations

import time
from collections.abc import Iterable

from services.registry.runs import RunState
from services.registry.settings import RegistrySettings
from shared.storage import ObjectStorage


def _leased(state: RunState, keys: Iterable[str], now: float) -> bool:
    return any(state.leases.get(k, 0.0) > now for k in keys)


async def retain(storage: ObjectStorage, run: str, state: RunState, settings: RegistrySettings,
                 started: float) -> int:
    """Keep the last `keep_snapshots` snapshots and every version from the oldest kept one;
    delete what lies below it, except objects a plan handed out within `plan_lease_s`.
    Manifests go first so no reader ever sees a version whose objects are gone. Nothing goes
    within one lease period of `started` (the process start): plans handed out before a
    restart stay served. Returns the objects deleted."""
    now = time.monotonic()
    if now < started + settings.plan_lease_s:
        return 0
    deleted = 0
    async with state.lock:
        snapshots = state.snapshots()
        if len(snapshots) <= settings.keep_snapshots:
            return 0
        floor = snapshots[-settings.keep_snapshots]
        state.leases = {k: t for k, t in state.leases.items() if t > now}
        for v in sorted(v for v in state.manifests if v < floor):
            m = state.manifests[v]
            keys = [ref.key for ref in (m.patch, m.snapshot) if ref is not None]
            if _leased(state, keys, now):
                continue
            await storage.delete(f"{run}/manifests/{v}.json")
            del state.manifests[v]
            for key in keys:
                await storage.delete(f"{run}/{key}")
            deleted += 1 + len(keys)
        for (a, b), ref in list(state.merged.items()):
            if a < floor and not _leased(state, [ref.key], now):
                await storage.delete(f"{run}/merged/{a}-{b}.json")
                await storage.delete(f"{run}/{ref.key}")
                del state.merged[(a, b)]
                deleted += 2
    return deleted
