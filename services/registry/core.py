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
import json
import logging
import re
import time
from collections.abc import Awaitable
from typing import Any

import torch

from services.registry.errors import Conflict, Invalid, NotFound
from services.registry.merge import Merger
from services.registry.metrics import RegistryMetrics
from services.registry.peers import PeerDirectory
from services.registry.planner import cheapest_plan
from services.registry.retention import retain
from services.registry.runs import RunState, object_ref, piece_hashes, stored
from services.registry.settings import RegistrySettings
from shared.coord.keys import Keys
from shared.patch import apply_patch, dense_bytes, load_snapshot, read_header, save_snapshot, verify_chunks
from shared.registry.wire import MODEL_FILES, Manifest, ObjectRef, Plan, RolloutDirective
from shared.relay import WORKER_ID, PeerAnnouncement, PeerList
from shared.storage import ObjectNotFound, ObjectStorage

log = logging.getLogger(__name__)

RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
OBJECT_FOLDERS = ("patches/", "snapshots/", "manifests/", "merged/", "model/")
KEY_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")  # every name the registry writes


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
        self._runs: dict[str, RunState] = {}
        self.peers = PeerDirectory(settings.peer_ttl_s, settings.peer_max_listed)
        self._loading = asyncio.Lock()
        self.merger = Merger(storage, settings, self.metrics, self._read_verified, self.state_at)
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
        async with self._loading:
            if run not in self._runs:
                state = RunState()
                for info in await self.storage.list(f"{run}/manifests/"):
                    manifest = Manifest.model_validate_json(await self.storage.get(info.key))
                    state.manifests[manifest.version] = manifest
                for info in await self.storage.list(f"{run}/merged/"):
                    if info.key.endswith(".json"):
                        ref = ObjectRef.model_validate_json(await self.storage.get(info.key))
                        a, b = (int(x) for x in ref.key.rsplit("/", 1)[1].split(".")[0].split("-"))
                        state.merged[(a, b)] = ref
                self._runs[run] = state
                if state.head is not None:
                    self.metrics.head.labels(run).set(manifest.version if state.head is None else state.head)
        return self._runs[run]

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

    async def _commit(self, run: str, state: RunState, manifest: Manifest) -> None:
        await self.storage.put(
            f"{run}/manifests/{manifest.version}.json", manifest.model_dump_json().encode()
        )
        state.manifests[manifest.version] = manifest
        self.metrics.head.labels(run).set(max(state.manifests))

    async def publish_patch(self, run: str, version: int, data: bytes, metrics: dict[str, Any],
                            rollout: RolloutDirective | None = None) -> Manifest:
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
            await self.storage.put(f"{run}/{key}", data)
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
            await self.storage.put(f"{run}/{key}", data)
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
        data = await self.storage.get(f"{run}/{ref.key}")
        if piece_hashes(data, ref.piece_bytes) != ref.pieces:
            raise Invalid(f"stored object {ref.key} of run {run!r} is corrupt")
        return data

    async def state_at(self, run: str, version: int) -> dict[str, torch.Tensor]:
        """Full weights at `version`: the nearest snapshot at or below it, plus the chain."""
        state = await self._run(run)
        base = max((s for s in state.snapshots() if s <= version), default=None)
        if base is None:
            raise NotFound(f"no snapshot at or below version {version} of run {run!r}")
        snapshot = await self._read_verified(run, stored(state.manifests[base].snapshot, 'snapshot'))
        tensors, _ = await asyncio.to_thread(load_snapshot, snapshot)
        for v in range(base + 1, version + 1):
            blob = await self._read_verified(run, stored(state.manifests[v].patch, 'patch'))
            await asyncio.to_thread(apply_patch, tensors, blob, verify=True)
        return tensors

    # -- model files --

    async def put_model_file(self, run: str, name: str, data: bytes) -> None:
        await self._run(run)
        if name not in MODEL_FILES:
            raise Invalid(f"model file {name!r} not accepted: one of {', '.join(MODEL_FILES)}")
        try:
            json.loads(data)
        except ValueError as exc:
            raise Invalid(f"{name} is not valid JSON: {exc}") from exc
        await self.storage.put(f"{run}/model/{name}", data)

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
        await self._run(run)
        if not WORKER_ID.fullmatch(worker):
            raise Invalid(f"bad worker id {worker!r}")
        for key in body.objects:
            self.object_key(run, key)  # refuses keys outside the run's folders
        return PeerList(peers=self.peers.announce(run, worker, body.url, body.objects))

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

        plan = await cheapest_plan(run, state, target, from_version, self.settings, merged_for)
        self.metrics.plans.labels(plan.kind).inc()
        peers = {st.object.key: self.peers.holders(run, st.object.key, exclude=peer) for st in plan.steps}
        return plan.model_copy(update={"peers": {k: v for k, v in peers.items() if v}})

    async def retain(self, run: str) -> int:
        """Delete what retention no longer keeps (services.registry.retention); returns the count."""
        deleted = await retain(self.storage, run, await self._run(run), self.settings, self._started)
        self.metrics.deleted.inc(deleted)
        return deleted
