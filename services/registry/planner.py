"""The planner: the cheapest way for a worker from the weights it holds to a version."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from services.registry.errors import Invalid, NotFound
from services.registry.runs import SNAPSHOT_LAG, RunState, stored
from services.registry.settings import RegistrySettings
from shared.registry.wire import Manifest, ObjectRef, Plan, PlanStep

# merged(a, b, wish): the merged a→b patch, or None (the wish noted for the next publish).
MergedFor = Callable[[int, int, int], Awaitable[ObjectRef | None]]


async def cheapest_plan(run: str, state: RunState, target: Manifest, from_version: int | None,
                        settings: RegistrySettings, merged_for: MergedFor) -> Plan:
    """The cheapest way from `from_version` (None or -1: no weights) to `target`: no-op, chain,
    merged patch, or snapshot (+ chain or merged patch), by bytes then preference. `merged_for(a,
    b, wish)` gives the merged a→b patch if it may be had (else notes the wish, SNAPSHOT_LAG for
    the newest snapshot → head). The objects the plan names are leased for `plan_lease_s`."""
    b = target.version
    a = None if from_version is None or from_version == -1 else from_version
    if a is not None and (a < -1 or a > b):
        raise Invalid(f"cannot plan from version {a} to {b}: from must be -1 (no weights) or <= to")
    candidates: list[tuple[int, int, str, list[PlanStep]]] = []  # (bytes, preference, kind, steps)

    def patch_step(ref: ObjectRef, base: int, m: Manifest) -> PlanStep:
        return PlanStep(kind="patch", object=ref, base_version=base, target_version=m.version, fingerprint=m.fingerprint)

    if a == b:
        candidates.append((0, 0, "none", []))
    elif a is not None and (chain := state.chain(a, b)) is not None:
        steps = [patch_step(stored(m.patch, 'patch'), m.version - 1, m) for m in chain]
        candidates.append((sum(s.object.size for s in steps), 2, "chain", steps))
        if 2 <= b - a <= settings.max_merge_lag:
            merged = await merged_for(a, b, b - a)
            if merged is not None:
                candidates.append((merged.size, 1, "merged", [patch_step(merged, a, target)]))
    snapshots = [s for s in state.snapshots() if s <= b]
    for s in snapshots:
        if (chain := state.chain(s, b)) is None:
            continue
        snap = state.manifests[s]
        snapshot_ref = stored(snap.snapshot, 'snapshot')
        first = PlanStep(kind="snapshot", object=snapshot_ref, base_version=None, target_version=s, fingerprint=snap.fingerprint)
        steps = [first] + [patch_step(stored(m.patch, 'patch'), m.version - 1, m) for m in chain]
        candidates.append((sum(st.object.size for st in steps), 3, "snapshot", steps))
        # For a worker with no usable patch path, one merged patch from the newest snapshot
        # can replace the chain (fewer bytes, one apply). Not built otherwise: a patch path
        # is far smaller than any snapshot, so that merge would be wasted work.
        patch_path = any(c[2] != "snapshot" for c in candidates)
        if not patch_path and s == snapshots[-1] and 2 <= b - s <= settings.max_merge_lag:
            merged = await merged_for(s, b, SNAPSHOT_LAG)
            if merged is not None:
                candidates.append((snapshot_ref.size + merged.size, 3, "snapshot", [first, patch_step(merged, s, target)]))
    if not candidates:
        raise NotFound(f"no snapshot or chain reaches version {b} of run {run!r}")
    total, _, kind, steps = min(candidates, key=lambda c: (c[0], c[1]))
    expiry = time.monotonic() + settings.plan_lease_s
    for step in steps:
        state.leases[step.object.key] = max(state.leases.get(step.object.key, 0.0), expiry)
    return Plan(
        run=run, from_version=a, to_version=b, kind=kind, fingerprint=target.fingerprint,
        total_bytes=total, steps=steps, lease_s=settings.plan_lease_s,
    )
