"""Merged patches: a→b built from the chain a→a+1→…→b, once, cached in the store, for plans
that ask (authenticated) or that plans wished for (built at the next publish)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import torch

from services.registry.metrics import RegistryMetrics
from services.registry.runs import SNAPSHOT_LAG, RunState, object_ref, stored
from services.registry.settings import RegistrySettings
from shared.patch import PatchError, merge_patches
from shared.registry.wire import ObjectRef
from shared.storage import ObjectStorage

log = logging.getLogger(__name__)


class Merger:
    """Builds and caches merged patches. `read_verified(run, ref)` reads a stored object with its
    piece hashes checked; `state_at(run, version)` gives full weights (the base a merge of mixed
    encodings needs); `write(run, state, key, data)` stores an object of the run."""

    def __init__(self, storage: ObjectStorage, settings: RegistrySettings, metrics: RegistryMetrics,
                 read_verified: Callable[[str, ObjectRef], Awaitable[bytes]],
                 state_at: Callable[[str, int], Awaitable[dict[str, torch.Tensor]]],
                 write: Callable[[str, RunState, str, bytes], Awaitable[None]]) -> None:
        self.storage = storage
        self.settings = settings
        self.metrics = metrics
        self.read_verified = read_verified
        self.state_at = state_at
        self.write = write
        self._locks: dict[tuple[str, int, int], asyncio.Lock] = {}
        # Merges are CPU-heavy (seconds for a 1.7B chain): one at a time, whoever asks.
        self._slot = asyncio.Semaphore(1)

    async def for_plan(
        self, run: str, state: RunState, a: int, b: int, wish: int, build: bool
    ) -> ObjectRef | None:
        """The merged a→b patch for a plan: built now only if `build` (an authenticated plan);
        else the stored one, or None with the wish noted for the next publish."""
        if build or (a, b) in state.merged:
            return await self.merged(run, state, a, b)
        state.wanted[wish] = time.monotonic()
        return None

    async def wanted(self, run: str, state: RunState, version: int) -> None:
        """After publishing `version`: build the merges plans wanted lately, ending at it, so that
        workers asking anonymously find them (at most max_publish_merges, most recent wishes first)."""
        now = time.monotonic()
        recent = {k: t for k, t in state.wanted.items() if now - t <= self.settings.merge_demand_s}
        state.wanted = recent
        limit = self.settings.max_publish_merges
        for wish in sorted(recent, key=lambda k: (-recent[k], k))[:limit]:
            if wish == SNAPSHOT_LAG:
                a = max((v for v in state.snapshots() if v <= version), default=None)
            else:
                a = version - wish
            if a is not None and 2 <= version - a <= self.settings.max_merge_lag and state.head == version:
                await self.merged(run, state, a, version)

    async def merged(self, run: str, state: RunState, a: int, b: int) -> ObjectRef | None:
        """The merged a→b patch, built once and cached in the store; None if it cannot be built."""
        if (a, b) in state.merged:
            return state.merged[(a, b)]
        lock = self._locks.setdefault((run, a, b), asyncio.Lock())
        async with lock, self._slot:
            if (a, b) in state.merged:
                return state.merged[(a, b)]
            t0 = time.perf_counter()
            try:
                chain = state.chain(a, b)
                if chain is None:
                    return None
                blobs = [await self.read_verified(run, stored(m.patch, 'patch')) for m in chain]
                try:
                    data = await asyncio.to_thread(merge_patches, blobs)
                except PatchError:
                    # Chains mixing `values` and `bitdelta` tensors merge only against the base.
                    base = await self.state_at(run, a)
                    data = await asyncio.to_thread(merge_patches, blobs, base)
            except Exception as exc:  # noqa: BLE001 - the chain and snapshot paths still exist
                log.warning("merging %s %d→%d failed: %s", run, a, b, exc)
                return None
            key = f"merged/{a}-{b}.patch"
            ref = object_ref(key, data, self.settings.piece_bytes)
            try:
                await self.write(run, state, key, data)
                await self.write(run, state, f"merged/{a}-{b}.json", ref.model_dump_json().encode())
            except Exception as exc:  # noqa: BLE001 - e.g. a full store: plans use the chain meanwhile
                log.warning("storing merged %s %d→%d failed: %s", run, a, b, exc)
                return None
            state.merged[(a, b)] = ref
            self.metrics.merge_seconds.observe(time.perf_counter() - t0)
            return ref
