"""Self-repair of the registry's store: checking stored objects against their manifests' piece
hashes (a reader's report, the periodic scrub, a merge or snapshot build), the quarantine record
of bad ones, and the store-full outage. The Registry (core.py) decides what a bad object means
(plans route around it, the trainer is asked for a snapshot, docs/registry.md); this module
only checks, records and paces."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable

from services.registry.metrics import RegistryMetrics
from shared.registry.wire import ObjectRef, QuarantinedObject
from shared.storage import ObjectNotFound, ObjectStorage, StoreFull

log = logging.getLogger(__name__)

GONE = "gone from the store"
# Where a run's quarantine records live: one small JSON per bad object, so a restart remembers
# (outside the readable folders: GET objects/ never serves them).
QUARANTINE_FOLDER = "quarantine/"

Pace = Callable[[int], Awaitable[None]]


def record_key(run: str, key: str) -> str:
    """Store key of the quarantine record of a run's object (patches/3-4.patch →
    <run>/quarantine/patches.3-4.patch.json: folder names hold no dots, so this is one-to-one)."""
    return f"{run}/{QUARANTINE_FOLDER}{key.replace('/', '.')}.json"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


async def verify_object(storage: ObjectStorage, store_key: str, ref: ObjectRef,
                        pace: Pace | None = None) -> str | None:
    """None when the stored object is the one `ref` describes, else what is wrong with it. Read
    one piece at a time (a snapshot is GBs), each followed by `pace(bytes)` (the scrub's rate
    limit). Store outages raise (the caller waits them out), a missing object is GONE."""
    try:
        size = await storage.size(store_key)
    except ObjectNotFound:
        return GONE
    if size != ref.size:
        return f"{size} bytes stored, the manifest says {ref.size}"
    for i, expected in enumerate(ref.pieces):
        start = i * ref.piece_bytes
        end = min(ref.size, start + ref.piece_bytes)
        try:
            piece = await storage.get_range(store_key, start, end)
        except ObjectNotFound:
            return GONE
        if await asyncio.to_thread(_sha256, piece) != expected:
            return f"piece {i} (bytes {start}-{end}) fails its sha256"
        if pace is not None:
            await pace(len(piece))
    return None


def quarantined(key: str, reason: str, found_by: str) -> QuarantinedObject:
    return QuarantinedObject.model_validate({"key": key, "reason": reason, "found_by": found_by,
                                             "at": time.time()})


class StoreSpace:
    """The store-full outage as the registry sees it: the first refused write of an outage logs
    one warning, every refusal is counted, the first write that succeeds after it logs one line."""

    def __init__(self, metrics: RegistryMetrics) -> None:
        self.metrics = metrics
        self.full_since: float | None = None  # time.time() of the outage's first refusal
        self.last_error: str | None = None

    def full(self, exc: StoreFull) -> None:
        self.metrics.store_full_refusals.inc()
        self.last_error = str(exc)
        if self.full_since is None:
            self.full_since = time.time()
            self.metrics.store_full.set(1)
            log.warning("the store is full (%s): writes answer 507 until space is freed", exc)

    def ok(self) -> None:
        if self.full_since is not None:
            log.info("the store takes writes again after %.1f s full", time.time() - self.full_since)
            self.full_since = None
            self.metrics.store_full.set(0)


class Pacer:
    """At most `bytes_per_s` read by the scrub, so that it never competes with serving."""

    def __init__(self, bytes_per_s: float, metrics: RegistryMetrics) -> None:
        self.bytes_per_s = bytes_per_s
        self.metrics = metrics

    async def __call__(self, n: int) -> None:
        self.metrics.scrubbed_bytes.inc(n)
        await asyncio.sleep(n / self.bytes_per_s)
