"""Self-repair of the registry (services.registry.repair): corrupt objects found by the scrub, a
reader or a build are quarantined and routed around; a full store is a 507 outage that ends by
itself; runs without versions cost bounded memory."""

from __future__ import annotations

import asyncio
import errno
import logging
import tracemalloc
from pathlib import Path

import pytest

import services.registry.core as registry_core
from services.registry.core import EMPTY_RUNS_KEPT, Registry
from services.registry.errors import InsufficientStorage, Invalid, NotFound
from services.registry.settings import RegistrySettings
from shared.storage import ObjectStorage, StoreFull, store_full
from tests.integration.registry_helpers import Chain, make_chain, publish, same

RUN = "r1"


@pytest.fixture(scope="module")
def chain() -> Chain:
    return make_chain(RUN, 8)


class FullableStore(ObjectStorage):
    """A real file store whose writes fail with ENOSPC while `full` is set, raised where obstore's
    own error would be (inside ObjectStorage's error mapping)."""

    full = False

    async def put(self, key: str, data: bytes | memoryview) -> None:
        if self.full:
            def refuse() -> None:
                raise OSError(errno.ENOSPC, "No space left on device")

            await self._call(key, refuse)
        await super().put(key, data)


def new_registry(storage: ObjectStorage, **overrides) -> Registry:
    values = {"store_url": "memory://", "piece_bytes": 4096, "snapshot_every": 0, "plan_lease_s": 0}
    return Registry(storage, RegistrySettings(**{**values, **overrides}))


def flip_byte(root: Path, key: str) -> None:
    path = root / RUN / key
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


async def test_scrub_quarantines_a_corrupt_patch_and_plans_route_around_it(tmp_path: Path,
                                                                           chain: Chain) -> None:
    storage = ObjectStorage(f"file://{tmp_path}")
    registry = new_registry(storage)
    await publish(registry, chain, 8)
    await registry.idle()
    flip_byte(tmp_path, "patches/3-4.patch")

    await registry.scrub(asyncio.Event())
    status = await registry.repair_status(RUN)
    assert [(q.key, q.found_by) for q in status.quarantined] == [("patches/3-4.patch", "scrub")]
    assert "sha256" in status.quarantined[0].reason
    # Nothing reaches the head now: no plan names the bad patch, no build reads it, a snapshot is wanted.
    assert status.snapshot_wanted == 8
    with pytest.raises(NotFound, match="no snapshot or chain .* a snapshot of v8 is wanted"):
        await registry.plan(RUN, 2, None)
    with pytest.raises(NotFound, match="no good snapshot and chain"):
        await registry.state_at(RUN, 8)
    assert await registry.merger.merged(RUN, await registry._run(RUN), 2, 5) is None
    assert (await registry.plan(RUN, 4, None)).kind in ("chain", "merged")  # past the bad patch: fine
    health = registry.health()
    assert health["status"] == "degraded" and "snapshot wanted" in health["reasons"][0]
    assert health["scrub"]["passes"] == 1 and health["quarantined"] == {RUN: 1}

    # The trainer's snapshot of the head repairs it: lagging and new workers reach the head.
    await registry.publish_snapshot(RUN, 8, chain.snapshot(8))
    assert (await registry.repair_status(RUN)).snapshot_wanted is None
    plan = await registry.plan(RUN, 2, None)
    assert plan.kind == "snapshot" and plan.steps[0].object.key == "snapshots/8.safetensors"
    assert registry.health()["status"] == "ok"
    assert registry.metrics.corrupt_found.labels("scrub")._value.get() == 1

    # A restart remembers the quarantine (its record is in the store).
    restarted = new_registry(storage)
    assert [q.key for q in (await restarted.repair_status(RUN)).quarantined] == ["patches/3-4.patch"]
    assert (await restarted.plan(RUN, 2, None)).kind == "snapshot"
    # The scrub covers every run in the store, also one nobody asked for since the restart.
    flip_byte(tmp_path, "patches/6-7.patch")
    fresh = new_registry(storage)
    await fresh.scrub(asyncio.Event())
    assert fresh.loaded_runs() == [RUN] and "patches/6-7.patch" in (await fresh._run(RUN)).quarantine


async def test_a_readers_report_is_checked_not_believed(tmp_path: Path, chain: Chain) -> None:
    registry = new_registry(ObjectStorage(f"file://{tmp_path}"))
    await publish(registry, chain, 4, snapshots=(0, 2))
    good = await registry.report_corrupt(RUN, "patches/1-2.patch")
    assert not good.corrupt and not good.quarantined
    flip_byte(tmp_path, "patches/1-2.patch")
    # A good verdict stands for REPORT_RECHECK_S: reports cannot make the registry re-read all day.
    assert not (await registry.report_corrupt(RUN, "patches/1-2.patch")).corrupt
    flip_byte(tmp_path, "patches/2-3.patch")
    bad = await registry.report_corrupt(RUN, "patches/2-3.patch")
    assert bad.corrupt and bad.quarantined and "sha256" in (bad.reason or "")
    assert (await registry.repair_status(RUN)).quarantined[0].found_by == "reader"
    # Snapshots 0 and 2 both lie before the bad patch: the head is unreachable, v4's snapshot wanted.
    assert (await registry.repair_status(RUN)).snapshot_wanted == 4
    with pytest.raises(NotFound, match="no object"):
        await registry.report_corrupt(RUN, "patches/7-8.patch")
    with pytest.raises(Invalid, match="bad object key"):
        await registry.report_corrupt(RUN, "../../etc/passwd")


async def test_a_build_quarantines_what_it_reads_and_a_rewrite_lifts_it(tmp_path: Path, chain: Chain) -> None:
    registry = new_registry(ObjectStorage(f"file://{tmp_path}"))
    await publish(registry, chain, 6, snapshots=(0, 3))
    flip_byte(tmp_path, "snapshots/3.safetensors")
    # Materializing v6 reads the newest snapshot: found bad, quarantined, never built from.
    with pytest.raises(Invalid, match="corrupt"):
        await registry.state_at(RUN, 6)
    state = await registry._run(RUN)
    assert "snapshots/3.safetensors" in state.quarantine
    assert state.quarantine["snapshots/3.safetensors"].found_by == "registry"
    assert same(await registry.state_at(RUN, 6), chain.states[6])  # from snapshot 0 and the chain
    assert (await registry.plan(RUN, None, None)).steps[0].object.key == "snapshots/0.safetensors"
    assert (await registry.repair_status(RUN)).snapshot_wanted is None  # snapshot 0 + chain reach v6
    # The trainer uploads v3 again: written again, the object is good again.
    await registry.publish_snapshot(RUN, 3, chain.snapshot(3))
    assert state.quarantine == {}
    assert not await registry.storage.exists(f"{RUN}/quarantine/snapshots.3.safetensors.json")
    assert (await registry.plan(RUN, None, None)).steps[0].object.key == "snapshots/3.safetensors"


async def test_scrub_waits_out_a_store_outage(tmp_path: Path, chain: Chain, monkeypatch) -> None:
    storage = ObjectStorage(f"file://{tmp_path}")
    registry = new_registry(storage)
    await publish(registry, chain, 3)
    flip_byte(tmp_path, "patches/2-3.patch")
    registry.scrub_outage.base_s = 0.01
    real = storage.get_range
    failures = 3

    async def flaky(key: str, start: int, end: int) -> bytes:
        nonlocal failures
        if failures:
            failures -= 1
            raise ConnectionError("store unreachable")
        return await real(key, start, end)

    monkeypatch.setattr(storage, "get_range", flaky)
    await registry.scrub(asyncio.Event())
    assert registry.scrub_outage.outages == 1 and registry.scrub_outage.failures == 3
    assert not registry.scrub_outage.down  # the pass went on once the store answered
    assert "patches/2-3.patch" in (await registry._run(RUN)).quarantine


async def test_a_full_store_is_an_outage_that_ends_by_itself(tmp_path: Path, chain: Chain, monkeypatch,
                                                               caplog) -> None:
    storage = FullableStore(f"file://{tmp_path}")
    registry = new_registry(storage)
    await publish(registry, chain, 2)
    storage.full = True
    with caplog.at_level(logging.WARNING, logger="services.registry.repair"):
        for _ in range(3):
            with pytest.raises(InsufficientStorage, match="full"):
                await registry.publish_patch(RUN, 3, chain.patches[3], {})
    assert len([r for r in caplog.records if "store is full" in r.getMessage()]) == 1  # once per outage
    assert registry.metrics.store_full_refusals._value.get() == 3
    assert registry.health()["status"] == "degraded" and registry.health()["store_full_since"]
    assert (await registry.manifest(RUN)).version == 2  # nothing committed

    # Space returns: the background probe notices with no writer about.
    monkeypatch.setattr(registry_core, "SPACE_PROBE_S", 0.05)
    stop = asyncio.Event()
    maintenance = asyncio.create_task(registry.maintain(stop))
    await asyncio.sleep(0.2)
    assert registry.space.full_since is not None  # still full: the probe failed too
    storage.full = False
    for _ in range(50):
        if registry.space.full_since is None:
            break
        await asyncio.sleep(0.05)
    assert registry.health()["status"] == "ok" and registry.metrics.store_full._value.get() == 0
    stop.set()
    await maintenance
    assert "maintenance loop" in registry.health()["reasons"][0]  # truthful once it has stopped
    assert not await storage.exists(registry_core.SPACE_PROBE_KEY)
    await registry.publish_patch(RUN, 3, chain.patches[3], {})


def test_store_full_is_told_from_other_store_errors() -> None:
    from obstore.exceptions import GenericError

    assert store_full(OSError(errno.ENOSPC, "No space left on device"))
    assert store_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert store_full(GenericError("Unable to copy data to file: No space left on device (os error 28)"))
    assert store_full(GenericError("Client error with status 507 Insufficient Storage"))
    assert store_full(GenericError("<Code>XMinioStorageFull</Code>"))
    assert not store_full(GenericError("connection refused while writing run/patches/507-508.patch"))
    assert not store_full(OSError(errno.EACCES, "Permission denied"))
    assert issubclass(StoreFull, OSError)


# Far more than the registry keeps (EMPTY_RUNS_KEPT): kept unbounded, they cost 5.4 MB (measured).
UNKNOWN_RUNS = 8_000


async def test_unknown_run_names_cost_bounded_memory() -> None:
    registry = new_registry(ObjectStorage("memory://"))
    tracemalloc.start()
    try:
        await registry.versions("warm-up")
        before, _ = tracemalloc.get_traced_memory()
        for i in range(UNKNOWN_RUNS):
            assert await registry.versions(f"nobody-{i}") == []
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert registry._runs == {} and len(registry._empty) == EMPTY_RUNS_KEPT
    # Unbounded, the 8,000 states fail this (5.4 MB); a bounded cache keeps a few hundred KB.
    assert after - before < 2 << 20, f"{(after - before) / 1e6:.1f} MB kept"


async def test_a_corrupt_manifest_skips_its_version_instead_of_failing_the_run(tmp_path: Path,
                                                                            chain: Chain) -> None:
    storage = ObjectStorage(f"file://{tmp_path}")
    await publish(new_registry(storage), chain, 5)
    (tmp_path / RUN / "manifests" / "3.json").write_bytes(b'{"run": "r1", "vers\x00')
    restarted = new_registry(storage)
    assert [m.version for m in await restarted.versions(RUN)] == [0, 1, 2, 4, 5]
    status = await restarted.repair_status(RUN)
    assert [(q.key, q.found_by) for q in status.quarantined] == [("manifests/3.json", "registry")]
    assert status.snapshot_wanted == 5  # nothing crosses v3: the trainer is asked for the head
    assert (await restarted.plan(RUN, 4, None)).kind in ("chain", "merged")


async def test_retention_forgets_the_quarantined_objects_it_deletes(tmp_path: Path, chain: Chain) -> None:
    registry = new_registry(ObjectStorage(f"file://{tmp_path}"), keep_snapshots=1)
    await publish(registry, chain, 4)
    flip_byte(tmp_path, "patches/1-2.patch")
    await registry.scrub(asyncio.Event())
    assert (await registry.repair_status(RUN)).snapshot_wanted == 4
    await registry.publish_snapshot(RUN, 4, chain.snapshot(4))  # the trainer's repair; retention: floor 4
    status = await registry.repair_status(RUN)
    assert status.quarantined == [] and status.snapshot_wanted is None
    assert not (tmp_path / RUN / "quarantine" / "patches.1-2.patch.json").exists()
