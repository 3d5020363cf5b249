"""Registry logic over object storage, free of HTTP (app.py is a thin layer over this).

Layout of a run in the store (keys relative to the store root):

    <run>/patches/<base>-<target>.patch     sparse patch (shared.patch format)
    <run>/snapshots/<v>.safetensors         full weights (shared.patch.save_snapshot)
    <run>/manifests/<v>.json                commit marker: a version exists iff its manifest does
    <run>/merged/<a>-<b>.patch (+ .json)    merged a→b patches, built on demand, index written last
    <run>/model/<file>                      config and tokenizer files

Writes of a run are serialized by one asyncio lock (one registry process writes a run). Objects
go first, the manifest last: a crash mid-publish leaves an unreferenced object that the next
publish of that version overwrites. Head = highest manifest, found by listing on first use, so a
restart recovers. See docs/registry.md for the publish rules, planning and retention.

The planner (planner.py), merged patches (merge.py) and retention (retention.py) are modules
of their own over a run's in-memory state (runs.py); uploads are checked as they stream in
(uploads.py), and HTTP Range headers are parsed by the app (ranges.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import re
import time
from collections import OrderedDict
from collections.abc import Awaitable
from typing import Any

import torch
from pydantic import ValidationError

from services.registry.errors import Conflict, InsufficientStorage, Invalid, NotFound
from services.registry.merge import Merger
from services.registry.metrics import RegistryMetrics
from services.registry.peers import PeerDirectory, target_version
from services.registry.planner import cheapest_plan
from services.registry.repair import (
    GONE,
    QUARANTINE_FOLDER,
    Pacer,
    StoreSpace,
    quarantined,
    record_key,
    verify_object,
)
from services.registry.retention import retain
from services.registry.runs import RunState, object_ref, piece_hashes, stored
from services.registry.settings import RegistrySettings
from shared.coord.keys import Keys
from shared.patch import apply_patch, dense_bytes, load_snapshot, read_header, save_snapshot, verify_chunks
from shared.registry.wire import (
    MODEL_FILES,
    Manifest,
    ObjectRef,
    Plan,
    QuarantinedObject,
    RepairStatus,
    RolloutDirective,
    Verdict,
)
from shared.relay import WORKER_ID, PeerAnnouncement, PeerList
from shared.retry import Outage
from shared.schemas import one_line_error
from shared.storage import ObjectNotFound, ObjectStorage, StoreFull

log = logging.getLogger(__name__)

RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
OBJECT_FOLDERS = ("patches/", "snapshots/", "manifests/", "merged/", "model/")
KEY_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")  # every name the registry writes
# Runs without a version (typos, probes, 20,000 made-up names) are remembered only this many at a
# time, least recently asked first out; runs with versions stay (docs/registry.md).
EMPTY_RUNS_KEPT = 256
# A reader's report of an object the registry found good is not checked again for this long (a
# report costs the registry a read of the whole object).
REPORT_RECHECK_S = 60.0
# While the store is full, a small write tries it this often, so health recovers with no writer.
SPACE_PROBE_S = 5.0
SPACE_PROBE_KEY = "__space_probe__"


class RedisAnnouncer:
    """PUBLISH each new version on the run's channel and keep the run's head version in Redis
    (names: shared.coord.Keys)."""

    def __init__(self, redis_url: str, prefix: str) -> None:
        import redis.asyncio as aioredis

        self.redis = aioredis.Redis.from_url(redis_url)
        self.prefix = prefix

    async def announce(self, run: str, manifest: Manifest) -> None:
        event = {"run": run, "version": manifest.version, "fingerprint": manifest.fingerprint}
        keys = Keys(self.prefix, run)
        await self.redis.set(keys.registry_head, manifest.version)
        await self.redis.publish(keys.versions_channel, json.dumps(event))

    async def aclose(self) -> None:
        await self.redis.aclose()


class Registry:
    def __init__(
        self,
        storage: ObjectStorage,
        settings: RegistrySettings,
        metrics: RegistryMetrics | None = None,
        announce: Any = None,  # async callable(run, manifest), e.g. RedisAnnouncer.announce
    ) -> None:
        self.storage = storage
        self.settings = settings
        self.metrics = metrics or RegistryMetrics()
        self.announce = announce
        self._runs: dict[str, RunState] = {}  # runs with versions
        self._empty: OrderedDict[str, RunState] = OrderedDict()  # runs without, EMPTY_RUNS_KEPT at most
        self.peers = PeerDirectory(settings.peer_ttl_s, settings.peer_max_listed, tree=settings.peer_tree,
                                   piece_bytes=settings.piece_bytes)
        self._loading = asyncio.Lock()
        self.merger = Merger(storage, settings, self.metrics, self._read_verified, self.state_at,
                             self.write_object)
        self.space = StoreSpace(self.metrics)
        self.scrub_outage = Outage("the store (scrub)", log)
        self.scrub_state: dict[str, Any] = {"enabled": settings.scrub_every_s > 0, "passes": 0,
                                            "last_pass_at": None, "running_since": None,
                                            "last_error": None}
        self._checked: dict[tuple[str, str], float] = {}  # (run, key) → when a report found it good
        self._checking = asyncio.Lock()  # one report check at a time: each reads a whole object
        self._maintaining: bool | None = None  # maintain() runs; None: never started (a bare core)
        self._tasks: set[asyncio.Task[None]] = set()
        # Plan leases live in memory: after a restart nothing is deleted for one lease period, so
        # plans handed out by the previous process stay served (docs/registry.md, retention).
        self._started = time.monotonic()

    # -- loading --

    async def _run(self, run: str) -> RunState:
        if not RUN_NAME.fullmatch(run):
            raise Invalid(f"bad run name {run!r}: letters, digits, '.', '_', '-' (max 128)")
        if run in self._runs:
            return self._runs[run]
        if run in self._empty:
            self._empty.move_to_end(run)
            return self._empty[run]
        async with self._loading:
            if run in self._runs or run in self._empty:
                return self._runs.get(run) or self._empty[run]
            state = RunState()
            for info in await self.storage.list(f"{run}/manifests/"):
                try:
                    manifest = Manifest.model_validate_json(await self.storage.get(info.key))
                except ValidationError as exc:  # a corrupt manifest: that version is skipped
                    key = info.key.removeprefix(f"{run}/")
                    log.error("manifest %s of run %r is corrupt, its version skipped: %s", key, run,
                              one_line_error(exc))
                    state.quarantine[key] = quarantined(key, "not a valid manifest", "registry")
                    self.metrics.corrupt_found.labels("registry").inc()
                    continue
                state.manifests[manifest.version] = manifest
            for info in await self.storage.list(f"{run}/merged/"):
                if info.key.endswith(".json"):
                    ref = ObjectRef.model_validate_json(await self.storage.get(info.key))
                    a, b = (int(x) for x in ref.key.rsplit("/", 1)[1].split(".")[0].split("-"))
                    state.merged[(a, b)] = ref
            for info in await self.storage.list(f"{run}/{QUARANTINE_FOLDER}"):
                entry = QuarantinedObject.model_validate_json(await self.storage.get(info.key))
                state.quarantine[entry.key] = entry
            if state.head is None:
                self._keep_empty(run, state)
                return state
            self._runs[run] = state
            self.metrics.head.labels(run).set(state.head)
        return self._runs[run]

    def _keep_empty(self, run: str, state: RunState) -> None:
        """Remember a run without versions, forgetting the least recently asked beyond
        EMPTY_RUNS_KEPT (never one whose lock is held: its first publish is under way)."""
        self._empty[run] = state
        for name in list(self._empty):
            if len(self._empty) <= EMPTY_RUNS_KEPT:
                break
            if not self._empty[name].lock.locked() and name != run:
                del self._empty[name]

    def loaded_runs(self) -> list[str]:
        """Runs with versions this process has loaded (what the scrub checks)."""
        return list(self._runs)

    async def idle(self) -> None:
        """Wait for background jobs (snapshot materialization) to finish."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # -- reads --

    async def versions(self, run: str) -> list[Manifest]:
        state = await self._run(run)
        return [state.manifests[v] for v in sorted(state.manifests)]

    async def manifest(self, run: str, version: int | None = None) -> Manifest:
        state = await self._run(run)
        version = state.head if version is None else version
        if version is None:
            raise NotFound(f"run {run!r} has no versions yet")
        if version not in state.manifests:
            raise NotFound(f"version {version} of run {run!r} is not available (head {state.head})")
        return state.manifests[version]

    def object_key(self, run: str, key: str) -> str:
        """Store key of a run-relative object key; refuses anything outside the run's folders."""
        folder, _, name = key.partition("/")
        if f"{folder}/" not in OBJECT_FOLDERS or not KEY_PART.fullmatch(name):
            raise Invalid(f"bad object key {key!r}: expected e.g. patches/3-4.patch")
        return f"{run}/{key}"

    async def object_size(self, run: str, key: str) -> tuple[str, int]:
        """(store key, size) of a run's object, for GET objects/{key} (its Range: .ranges)."""
        await self._run(run)
        store_key = self.object_key(run, key)
        try:
            return store_key, await self.storage.size(store_key)
        except ObjectNotFound as exc:
            raise NotFound(f"no object {key!r} in run {run!r}") from exc

    # -- publishing --

    def _ref(self, key: str, data: bytes) -> ObjectRef:
        return object_ref(key, data, self.settings.piece_bytes)

    async def _write(self, store_key: str, data: bytes) -> None:
        """Every write of the registry: a full store is an outage (507), tracked by self.space."""
        try:
            await self.storage.put(store_key, data)
        except StoreFull as exc:
            self.space.full(exc)
            raise InsufficientStorage(f"the registry's store is full ({exc}); retry later") from exc
        self.space.ok()

    async def write_object(self, run: str, state: RunState, key: str, data: bytes) -> None:
        """Write a run's object (`key` relative to the run); written again, it is good again."""
        await self._write(f"{run}/{key}", data)
        if key in state.quarantine:
            del state.quarantine[key]
            log.info("%s of run %r written again: out of quarantine", key, run)
            try:
                await self.storage.delete(record_key(run, key))
            except Exception as exc:  # noqa: BLE001 - the record is re-checked at the next load
                log.warning("removing the quarantine record of %s failed: %s", key, exc)

    async def _commit(self, run: str, state: RunState, manifest: Manifest) -> None:
        await self._write(f"{run}/manifests/{manifest.version}.json", manifest.model_dump_json().encode())
        state.manifests[manifest.version] = manifest
        if run in self._empty:  # its first version: kept from now on
            self._runs[run] = self._empty.pop(run)
        self.metrics.head.labels(run).set(max(state.manifests))

    async def publish_patch(self, run: str, version: int, data: bytes, metrics: dict[str, Any],
                            rollout: RolloutDirective | None = None,
                            groups: list[str] | None = None) -> Manifest:
        state = await self._run(run)
        try:
            header = await asyncio.to_thread(self._check_patch, data)
        except Exception as exc:  # noqa: BLE001 - untrusted bytes: any parse failure is the body's fault
            raise Invalid(f"malformed patch: {type(exc).__name__}: {exc}") from exc
        async with state.lock:
            head = state.head
            if head is None:
                raise Conflict(f"run {run!r} is empty: its first version must be a snapshot")
            if version != head + 1:
                raise Conflict(f"version {version} is not the next one: head is {head}")
            if header.run != run or header.base_version != head or header.target_version != version:
                raise Conflict(
                    f"patch is {header.run}:{header.base_version}→{header.target_version}, "
                    f"expected {run}:{head}→{version}"
                )
            if header.base_fingerprint != state.manifests[head].fingerprint:
                raise Conflict(
                    f"patch base fingerprint {header.base_fingerprint} does not match "
                    f"head {head} ({state.manifests[head].fingerprint})"
                )
            key = f"patches/{head}-{version}.patch"
            await self.write_object(run, state, key, data)
            manifest = Manifest(
                run=run,
                version=version,
                fingerprint=header.target_fingerprint,
                base_version=head,
                base_fingerprint=header.base_fingerprint,
                patch=self._ref(key, data),
                dense_bytes=header.dense_bytes,
                changed=header.changed,
                created_at=time.time(),
                metrics=metrics,
                rollout=rollout or RolloutDirective(),
                groups=groups or [],
            )
            await self._commit(run, state, manifest)
        self.metrics.publishes.labels("patch").inc()
        await self._after_commit(run, manifest)
        await self.retain(run)
        every = self.settings.snapshot_every
        if every and version % every == 0:
            self._spawn(self._materialize(run, version))
        self._spawn(self.merger.wanted(run, state, version))
        return manifest

    @staticmethod
    def _check_patch(data: bytes) -> Any:
        header = read_header(data)
        verify_chunks(data, header)  # also refuses truncated or padded bodies
        return header

    async def publish_snapshot(
        self, run: str, version: int, data: bytes, *, kind: str = "snapshot",
        rollout: RolloutDirective | None = None,
    ) -> Manifest:
        """`rollout` is kept for a run's first version; a snapshot of a committed version keeps the
        directive published with it."""
        state = await self._run(run)
        try:
            # load_snapshot recomputes the fingerprint of the tensors and checks the metadata's.
            tensors, info = await asyncio.to_thread(load_snapshot, data)
        except Exception as exc:  # noqa: BLE001 - untrusted bytes
            raise Invalid(f"malformed snapshot: {type(exc).__name__}: {exc}") from exc
        if info.run != run or info.version != version:
            raise Conflict(f"snapshot is {info.run}:{info.version}, expected {run}:{version}")
        async with state.lock:
            existing = state.manifests.get(version)
            if state.head is not None and existing is None:
                raise Conflict(
                    f"a snapshot is accepted for a committed version or as the first one "
                    f"(head is {state.head}); versions advance through patches"
                )
            if existing is not None and existing.fingerprint != info.fingerprint:
                raise Conflict(
                    f"snapshot fingerprint {info.fingerprint} differs from version {version}'s "
                    f"{existing.fingerprint}"
                )
            key = f"snapshots/{version}.safetensors"
            await self.write_object(run, state, key, data)
            ref = self._ref(key, data)
            if existing is not None:
                manifest = existing.model_copy(update={"snapshot": ref})
            else:
                manifest = Manifest(
                    run=run, version=version, fingerprint=info.fingerprint, snapshot=ref,
                    dense_bytes=dense_bytes(tensors), created_at=time.time(),
                    rollout=rollout or RolloutDirective(),
                )
            await self._commit(run, state, manifest)
        self.metrics.publishes.labels(kind).inc()
        if existing is None:
            await self._after_commit(run, manifest)
        await self.retain(run)
        return manifest

    async def _after_commit(self, run: str, manifest: Manifest) -> None:
        if self.announce is not None:
            try:
                await self.announce(run, manifest)
            except Exception as exc:  # noqa: BLE001 - workers fall back to polling
                log.warning("announcing %s v%d failed: %s", run, manifest.version, exc)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _materialize(self, run: str, version: int) -> None:
        """Build the snapshot of `version` from the previous snapshot and the chain."""
        try:
            if self._runs[run].manifests[version].snapshot is not None:
                return
            tensors = await self.state_at(run, version)
            data = await asyncio.to_thread(save_snapshot, tensors, run=run, version=version)
            await self.publish_snapshot(run, version, data, kind="materialized")
        except Exception:  # noqa: BLE001 - a background job: log it, the trainer can still upload one
            log.exception("materializing snapshot %s v%d failed", run, version)

    async def _read_verified(self, run: str, ref: ObjectRef) -> bytes:
        """A stored object for a merge or a snapshot build, checked: a bad one is quarantined and
        nothing is built from it."""
        if (state := await self._run(run)).quarantine.get(ref.key):
            raise Invalid(f"stored object {ref.key} of run {run!r} is quarantined")
        data = await self.storage.get(f"{run}/{ref.key}")
        if piece_hashes(data, ref.piece_bytes) != ref.pieces:
            await self._quarantine(run, state, ref.key, "fails its piece hashes", "registry")
            raise Invalid(f"stored object {ref.key} of run {run!r} is corrupt")
        return data

    async def state_at(self, run: str, version: int) -> dict[str, torch.Tensor]:
        """Full weights at `version`: the newest good snapshot with good patches up to it."""
        state = await self._run(run)
        base = state.reachable_from(version)
        if base is None:
            raise NotFound(f"no good snapshot and chain reach version {version} of run {run!r}")
        snapshot = await self._read_verified(run, stored(state.manifests[base].snapshot, 'snapshot'))
        tensors, _ = await asyncio.to_thread(load_snapshot, snapshot)
        for m in state.chain(base, version) or []:
            blob = await self._read_verified(run, stored(m.patch, 'patch'))
            await asyncio.to_thread(apply_patch, tensors, blob, verify=True)
        return tensors

    # -- self-repair (services.registry.repair; docs/registry.md) --

    @staticmethod
    def _referenced(state: RunState, key: str) -> ObjectRef | None:
        """The reference to `key` held by a manifest or the merged index, if any."""
        for m in state.manifests.values():
            for ref in (m.patch, m.snapshot):
                if ref is not None and ref.key == key:
                    return ref
        return next((ref for ref in state.merged.values() if ref.key == key), None)

    async def _quarantine(self, run: str, state: RunState, key: str, reason: str, found_by: str) -> None:
        """Mark a stored object bad: plans route around it, nothing is built from it, and while no
        good snapshot and chain reach the head the trainer is asked for a snapshot."""
        if key in state.quarantine:
            return
        entry = quarantined(key, reason, found_by)
        state.quarantine[key] = entry
        self.metrics.corrupt_found.labels(found_by).inc()
        for ab, ref in list(state.merged.items()):
            if ref.key == key:  # a merge is rebuilt from good patches when wanted again
                del state.merged[ab]
                with contextlib.suppress(Exception):
                    await self.storage.delete(f"{run}/merged/{ab[0]}-{ab[1]}.json")
        wanted = state.snapshot_wanted()
        log.warning("quarantined %s of run %r (%s, found by %s)%s", key, run, reason, found_by,
                    "" if wanted is None else f"; a snapshot of v{wanted} is wanted from the trainer")
        try:
            await self.storage.put(record_key(run, key), entry.model_dump_json().encode())
        except Exception as exc:  # noqa: BLE001 - kept in memory; a restart finds it again
            log.warning("recording the quarantine of %s failed (%s): kept in memory only", key, exc)

    async def check_object(self, run: str, state: RunState, ref: ObjectRef, found_by: str,
                           pace: Pacer | None = None) -> str | None:
        """Re-hash a stored object; quarantine it if bad. Returns what is wrong, None if good (or
        if it went away because retention deleted it meanwhile)."""
        reason = await verify_object(self.storage, f"{run}/{ref.key}", ref, pace)
        if reason == GONE and self._referenced(state, ref.key) != ref:
            return None  # deleted by retention (or rewritten) while being checked
        if reason is not None:
            await self._quarantine(run, state, ref.key, reason, found_by)
        return reason

    async def report_corrupt(self, run: str, key: str) -> Verdict:
        """A reader found `key` failing its hashes. The report is a hint, not a verdict: the
        registry checks what it stores (a reader's bad network or disk quarantines nothing)."""
        state = await self._run(run)
        self.object_key(run, key)
        if (entry := state.quarantine.get(key)) is not None:
            return Verdict(key=key, corrupt=True, reason=entry.reason, quarantined=True)
        ref = self._referenced(state, key)
        if ref is None:
            raise NotFound(f"run {run!r} has no object {key!r} in a manifest or the merged index")
        now = time.monotonic()
        if now - self._checked.get((run, key), -REPORT_RECHECK_S) < REPORT_RECHECK_S:
            return Verdict(key=key, corrupt=False, quarantined=False)
        async with self._checking:
            reason = await self.check_object(run, state, ref, "reader")
        if reason is None:
            self._checked = {k: t for k, t in self._checked.items() if now - t < REPORT_RECHECK_S}
            self._checked[(run, key)] = now
        return Verdict(key=key, corrupt=reason is not None, reason=reason, quarantined=reason is not None)

    async def repair_status(self, run: str) -> RepairStatus:
        state = await self._run(run)
        return RepairStatus(run=run, head=state.head, snapshot_wanted=state.snapshot_wanted(),
                            quarantined=sorted(state.quarantine.values(), key=lambda q: q.at))

    async def scrub(self, stop: asyncio.Event) -> None:
        """One pass: every stored patch, snapshot and merged patch of every run in the store
        re-hashed at scrub_bytes_per_s. A store outage is waited out (logged once, shared.retry)
        and the pass goes on where it was."""
        pace = Pacer(self.settings.scrub_bytes_per_s, self.metrics)
        self.scrub_state["running_since"] = time.time()
        try:
            stored_runs = await self.scrub_outage.call(self.storage.folders, stop)
        except Exception:  # noqa: BLE001 - stopping, or a store that cannot list: the runs known
            stored_runs = []
        runs = dict.fromkeys([*self.loaded_runs(), *(r for r in stored_runs if RUN_NAME.fullmatch(r))])
        for run in runs:
            try:
                state = await self.scrub_outage.call(functools.partial(self._run, run), stop)
            except Exception as exc:  # noqa: BLE001 - stopping, or a run that cannot load: next one
                if stop.is_set():
                    return
                log.warning("scrub: cannot load run %r: %s", run, exc)
                continue
            refs = [ref for m in list(state.manifests.values()) for ref in (m.patch, m.snapshot) if ref]
            refs += list(state.merged.values())
            for ref in refs:
                while not stop.is_set() and ref.key not in state.quarantine:
                    try:
                        await self.check_object(run, state, ref, "scrub", pace)
                    except Exception as exc:  # noqa: BLE001 - the store is down: wait, then go on
                        await self.scrub_outage.failed(exc, stop)
                        continue
                    self.scrub_outage.ok()
                    break
                if stop.is_set():
                    return
        self.scrub_state |= {"running_since": None, "last_pass_at": time.time(),
                             "passes": self.scrub_state["passes"] + 1}
        self.metrics.scrub_passes.inc()

    async def maintain(self, stop: asyncio.Event) -> None:
        """The background loop: a scrub pass every scrub_every_s, and while the store is full a
        small probe write every SPACE_PROBE_S, so that health recovers when space returns."""
        every = self.settings.scrub_every_s
        next_scrub = time.monotonic() + every
        self._maintaining = True
        try:
            await self._maintain(stop, every, next_scrub)
        finally:
            self._maintaining = False

    async def _maintain(self, stop: asyncio.Event, every: float, next_scrub: float) -> None:
        while not stop.is_set():
            try:
                if self.space.full_since is not None:
                    with contextlib.suppress(InsufficientStorage):
                        await self._write(SPACE_PROBE_KEY, b"probe")
                    with contextlib.suppress(Exception):  # the store may be down too: next time
                        await self.storage.delete(SPACE_PROBE_KEY)
                if every and time.monotonic() >= next_scrub:
                    await self.scrub(stop)
                    next_scrub = time.monotonic() + every
            except Exception as exc:  # noqa: BLE001 - the loop must outlive any one failure
                self.scrub_state["last_error"] = f"{type(exc).__name__}: {exc}"
                log.exception("registry maintenance failed; going on")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=min(SPACE_PROBE_S, every or SPACE_PROBE_S))

    def health(self) -> dict[str, Any]:
        """What works now: `degraded` with its reasons while the store is full, the scrub cannot
        reach the store, or a run's head cannot be reached from a good snapshot."""
        reasons = []
        if self.space.full_since is not None:
            reasons.append(f"store full since {self.space.full_since:.0f}: writes answer 507")
        if self.scrub_outage.down:
            reasons.append(f"scrub: the store is unreachable ({self.scrub_outage.last_error})")
        if self._maintaining is False:
            reasons.append("the maintenance loop (scrub, store-full probe) is not running")
        quarantine = {}
        for run, state in self._runs.items():
            quarantine[run] = len(state.quarantine)
            self.metrics.quarantined.labels(run).set(len(state.quarantine))
            wanted = state.snapshot_wanted()
            self.metrics.snapshot_wanted.labels(run).set(wanted is not None)
            if wanted is not None:
                reasons.append(f"run {run!r}: no good snapshot and chain reach v{wanted} (snapshot wanted)")
        return {"status": "degraded" if reasons else "ok", "reasons": reasons,
                "store_full_since": self.space.full_since, "quarantined": quarantine,
                "scrub": self.scrub_state | {"store": self.scrub_outage.state()}}

    # -- model files --

    async def put_model_file(self, run: str, name: str, data: bytes) -> None:
        await self._run(run)
        if name not in MODEL_FILES:
            raise Invalid(f"model file {name!r} not accepted: one of {', '.join(MODEL_FILES)}")
        try:
            json.loads(data)
        except ValueError as exc:
            raise Invalid(f"{name} is not valid JSON: {exc}") from exc
        await self._write(f"{run}/model/{name}", data)

    async def model_files(self, run: str) -> list[str]:
        await self._run(run)
        return [info.key.rsplit("/", 1)[1] for info in await self.storage.list(f"{run}/model/")]

    async def get_model_file(self, run: str, name: str) -> bytes:
        await self._run(run)
        if name not in MODEL_FILES:
            raise NotFound(f"model file {name!r} is not one the registry keeps")
        try:
            return await self.storage.get(f"{run}/model/{name}")
        except ObjectNotFound as exc:
            raise NotFound(f"run {run!r} has no {name}") from exc

    # -- planning (services.registry.planner), merges (.merge), retention (.retention) --

    async def announce_peer(self, run: str, worker: str, body: PeerAnnouncement) -> PeerList:
        """A worker holds (or is fetching) these objects and serves them at body.url (shared.relay)."""
        state = await self._run(run)
        if not WORKER_ID.fullmatch(worker):
            raise Invalid(f"bad worker id {worker!r}")
        for key in body.objects:
            self.object_key(run, key)  # refuses keys outside the run's folders
        sizes: dict[str, int] = {}  # the patches announced: the measured tree's costs (the chain needs none)
        if self.peers.tree == "measured":
            for key in body.objects:
                target = target_version(key)
                manifest = None if target is None else state.manifests.get(target)
                if manifest is not None and manifest.patch is not None and manifest.patch.key == key:
                    sizes[key] = manifest.patch.size
        return PeerList(peers=await self.peers.announce_ordered(
            run, worker, body.url, body.objects, self.settings.peer_order_wait_s, body.paths, sizes))

    async def leave_peer(self, run: str, worker: str) -> None:
        await self._run(run)
        if not self.peers.leave(run, worker):
            raise NotFound(f"worker {worker!r} is not a peer of run {run!r}")

    async def plan(
        self, run: str, from_version: int | None, to_version: int | None, *, build_merges: bool = True,
        peer: str | None = None,
    ) -> Plan:
        """The cheapest way from `from_version` to `to_version`. Without `build_merges` (an
        unauthenticated read) a missing merged patch is not built: the plan uses what is stored,
        and the wish is noted so that the next publish builds it (reads never write)."""
        state = await self._run(run)
        target = await self.manifest(run, to_version)

        def merged_for(a: int, b: int, wish: int) -> Awaitable[ObjectRef | None]:
            return self.merger.for_plan(run, state, a, b, wish, build_merges)

        try:
            plan = await cheapest_plan(run, state, target, from_version, self.settings, merged_for)
        except NotFound as exc:
            if (wanted := state.snapshot_wanted()) is None:
                raise
            raise NotFound(f"{exc}: objects are quarantined and a snapshot of v{wanted} is wanted "
                           f"from the trainer (GET /v1/runs/{run}/quarantine); retry") from exc
        self.metrics.plans.labels(plan.kind).inc()
        peers = {st.object.key: self.peers.holders(run, st.object.key, exclude=peer) for st in plan.steps}
        return plan.model_copy(update={"peers": {k: v for k, v in peers.items() if v}})

    async def retain(self, run: str) -> int:
        """Delete what retention no longer keeps (services.registry.retention); returns the count."""
        state = await self._run(run)
        deleted = await retain(self.storage, run, state, self.settings, self._started)
        self.metrics.deleted.inc(deleted)
        if deleted:  # quarantined objects retention deleted are bad no more: nothing lists them
            for key in [k for k in state.quarantine if self._referenced(state, k) is None]:
                if not await self.storage.exists(f"{run}/{key}"):
                    del state.quarantine[key]
                    with contextlib.suppress(Exception):
                        await self.storage.delete(record_key(run, key))
        return deleted
