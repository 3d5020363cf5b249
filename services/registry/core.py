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
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from services.registry.metrics import RegistryMetrics
from services.registry.peers import PeerDirectory
from services.registry.settings import RegistrySettings
from shared.coord.keys import Keys
from shared.patch import (
    MAGIC,
    PatchError,
    apply_patch,
    header_size,
    load_snapshot,
    merge_patches,
    read_header,
    save_snapshot,
    snapshot_header_size,
    snapshot_size,
    verify_chunks,
)
from shared.registry_client import MODEL_FILES, Manifest, ObjectRef, Plan, PlanStep
from shared.relay import WORKER_ID, PeerAnnouncement, PeerList
from shared.storage import ObjectNotFound, ObjectStorage

log = logging.getLogger(__name__)

RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
OBJECT_FOLDERS = ("patches/", "snapshots/", "manifests/", "merged/", "model/")
KEY_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")  # every name the registry writes
# Config and tokenizer JSON: the largest common tokenizer.json files are ~10-20 MB.
MAX_MODEL_FILE_BYTES = 64 << 20
UploadKind = Literal["patch", "snapshot", "model"]


class RegistryError(Exception):
    status = 400


class NotFound(RegistryError):
    status = 404


class Conflict(RegistryError):
    status = 409


class TooLarge(RegistryError):
    status = 413


class Invalid(RegistryError):
    status = 422


class BadRange(RegistryError):
    status = 416

    def __init__(self, message: str, size: int) -> None:
        super().__init__(message)
        self.size = size


def piece_hashes(data: bytes, piece_bytes: int) -> list[str]:
    view = memoryview(data)
    return [hashlib.sha256(view[i : i + piece_bytes]).hexdigest() for i in range(0, len(data), piece_bytes)]


class UploadCheck:
    """An upload checked as its bytes arrive: the size limit, then the magic bytes and the length
    its own header declares, so junk is refused after its first bytes instead of being held in
    memory up to the limit. The whole body is still needed to verify it (chunks, fingerprint)."""

    def __init__(self, kind: UploadKind, limit: int, declared: int | None = None) -> None:
        self.kind = kind
        self.limit = min(limit, MAX_MODEL_FILE_BYTES) if kind == "model" else limit
        self.declared = declared
        self.expected: int | None = None  # total size, once the header has arrived
        self.opened = False  # model files: the first non-blank byte was a '{'
        self.body = bytearray()
        if declared is not None and declared > self.limit:
            raise TooLarge(f"body of {declared} bytes exceeds the limit of {self.limit}")

    def feed(self, chunk: bytes) -> None:
        self.body += chunk
        if len(self.body) > self.limit:
            raise TooLarge(f"body exceeds the limit of {self.limit} bytes")
        if self.kind == "model":
            if not self.opened and (start := chunk.lstrip()[:1]):  # earlier chunks were all blank
                if start != b"{":
                    raise Invalid("a model file is a JSON object")
                self.opened = True
        elif self.expected is None:
            try:
                self.expected = self._declared_size()
            except PatchError as exc:
                raise Invalid(f"malformed {self.kind}: {type(exc).__name__}: {exc}") from exc
            if self.expected is not None:
                if self.expected > self.limit:
                    raise TooLarge(f"{self.kind} of {self.expected} bytes exceeds the limit of {self.limit}")
                if self.declared is not None and self.declared != self.expected:
                    raise Invalid(f"Content-Length is {self.declared}, the {self.kind} says {self.expected} bytes")
        if self.expected is not None and len(self.body) > self.expected:
            raise Invalid(f"{self.kind} is longer than the {self.expected} bytes its header declares")

    def _declared_size(self) -> int | None:
        """The total size a patch or snapshot declares once its header is in; None until then."""
        body = self.body
        if self.kind == "patch":
            if bytes(body[: len(MAGIC)]) != MAGIC[: len(body)]:
                raise Invalid("not a sparsecast patch (bad magic)")
            if len(body) < 16:
                return None
            size = header_size(bytes(body[:16]))  # refuses an oversized header length
            return read_header(bytes(body[:size])).total_size if len(body) >= size else None
        if len(body) < 9:
            return None
        size = snapshot_header_size(bytes(body[:9]))
        return snapshot_size(bytes(body[:size])) if len(body) >= size else None

    def finish(self) -> bytes:
        if not self.body:
            raise RegistryError("empty body")
        if self.expected is not None and len(self.body) < self.expected:
            raise Invalid(f"{self.kind} is truncated: {len(self.body)} of {self.expected} bytes")
        return bytes(self.body)


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """One `bytes=a-b`, `bytes=a-` or `bytes=-n` range → [start, end); None for the whole object."""
    if header is None:
        return None
    match = re.fullmatch(r"\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*", header)
    if not match or match.group(1) == match.group(2) == "":
        raise BadRange(f"unsupported Range {header!r}: one bytes=start-end range is served", size)
    first, last = match.groups()
    if first == "":
        start, end = max(0, size - int(last)), size
    else:
        start = int(first)
        end = min(size, int(last) + 1) if last else size
    if start >= size or start >= end:
        raise BadRange(f"Range {header!r} is outside the object of {size} bytes", size)
    return start, end


def dense_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


@dataclass
class RunState:
    manifests: dict[int, Manifest] = field(default_factory=dict)
    merged: dict[tuple[int, int], ObjectRef] = field(default_factory=dict)
    leases: dict[str, float] = field(default_factory=dict)  # object key → monotonic expiry
    # Merges that plans could not use because nobody may build them on a read: lag b−a → when a
    # plan last wanted it; SNAPSHOT_LAG stands for "newest snapshot → head" (fresh workers).
    wanted: dict[int, float] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def head(self) -> int | None:
        return max(self.manifests) if self.manifests else None

    def snapshots(self) -> list[int]:
        return sorted(v for v, m in self.manifests.items() if m.snapshot is not None)


SNAPSHOT_LAG = 0  # key of RunState.wanted for the snapshot s → head merge (real lags are >= 2)


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
        self._merge_locks: dict[tuple[str, int, int], asyncio.Lock] = {}
        # Merges are CPU-heavy (seconds for a 1.7B chain): one at a time, whoever asks.
        self._merge_slot = asyncio.Semaphore(1)
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
                    self.metrics.head.labels(run).set(state.head)
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

    async def object_range(self, run: str, key: str, range_header: str | None) -> tuple[str, int, int, int, bool]:
        """(store key, start, end, size, partial) for GET objects/{key}."""
        await self._run(run)
        store_key = self.object_key(run, key)
        try:
            size = await self.storage.size(store_key)
        except ObjectNotFound as exc:
            raise NotFound(f"no object {key!r} in run {run!r}") from exc
        span = parse_range(range_header, size)
        start, end = span if span else (0, size)
        return store_key, start, end, size, span is not None

    # -- publishing --

    def _ref(self, run: str, key: str, data: bytes) -> ObjectRef:
        pb = self.settings.piece_bytes
        return ObjectRef(key=key, size=len(data), piece_bytes=pb, pieces=piece_hashes(data, pb))

    async def _commit(self, run: str, state: RunState, manifest: Manifest) -> None:
        await self.storage.put(f"{run}/manifests/{manifest.version}.json", manifest.model_dump_json().encode())
        state.manifests[manifest.version] = manifest
        self.metrics.head.labels(run).set(state.head)

    async def publish_patch(self, run: str, version: int, data: bytes, metrics: dict[str, Any]) -> Manifest:
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
                patch=self._ref(run, key, data),
                dense_bytes=header.dense_bytes,
                changed=header.changed,
                created_at=time.time(),
                metrics=metrics,
            )
            await self._commit(run, state, manifest)
        self.metrics.publishes.labels("patch").inc()
        await self._after_commit(run, manifest)
        await self.retain(run)
        every = self.settings.snapshot_every
        if every and version % every == 0:
            self._spawn(self._materialize(run, version))
        self._spawn(self._merge_wanted(run, version))
        return manifest

    @staticmethod
    def _check_patch(data: bytes) -> Any:
        header = read_header(data)
        verify_chunks(data, header)  # also refuses truncated or padded bodies
        return header

    async def publish_snapshot(self, run: str, version: int, data: bytes, *, kind: str = "snapshot") -> Manifest:
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
                raise Conflict(f"snapshot fingerprint {info.fingerprint} differs from version {version}'s {existing.fingerprint}")
            key = f"snapshots/{version}.safetensors"
            await self.storage.put(f"{run}/{key}", data)
            ref = self._ref(run, key, data)
            if existing is not None:
                manifest = existing.model_copy(update={"snapshot": ref})
            else:
                manifest = Manifest(
                    run=run, version=version, fingerprint=info.fingerprint, snapshot=ref,
                    dense_bytes=dense_bytes(tensors), created_at=time.time(),
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
        snapshot = await self._read_verified(run, state.manifests[base].snapshot)
        tensors, _ = await asyncio.to_thread(load_snapshot, snapshot)
        for v in range(base + 1, version + 1):
            blob = await self._read_verified(run, state.manifests[v].patch)
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

    # -- planning --

    def _chain(self, state: RunState, a: int, b: int) -> list[Manifest] | None:
        if b - a > len(state.manifests):  # cannot all be retained: answer without walking b−a
            return None
        chain = [state.manifests.get(v) for v in range(a + 1, b + 1)]
        return chain if all(m is not None and m.patch is not None for m in chain) else None  # type: ignore[misc]

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
        b = target.version
        a = None if from_version is None or from_version == -1 else from_version
        if a is not None and (a < -1 or a > b):
            raise Invalid(f"cannot plan from version {a} to {b}: from must be -1 (no weights) or <= to")
        candidates: list[tuple[int, int, str, list[PlanStep]]] = []  # (bytes, preference, kind, steps)

        def patch_step(ref: ObjectRef, base: int, m: Manifest) -> PlanStep:
            return PlanStep(kind="patch", object=ref, base_version=base, target_version=m.version, fingerprint=m.fingerprint)

        if a == b:
            candidates.append((0, 0, "none", []))
        elif a is not None and (chain := self._chain(state, a, b)) is not None:
            steps = [patch_step(m.patch, m.version - 1, m) for m in chain]
            candidates.append((sum(s.object.size for s in steps), 2, "chain", steps))
            if 2 <= b - a <= self.settings.max_merge_lag:
                merged = await self._merged_for_plan(run, state, a, b, b - a, build_merges)
                if merged is not None:
                    candidates.append((merged.size, 1, "merged", [patch_step(merged, a, target)]))
        snapshots = [s for s in state.snapshots() if s <= b]
        for s in snapshots:
            if (chain := self._chain(state, s, b)) is None:
                continue
            snap = state.manifests[s]
            first = PlanStep(kind="snapshot", object=snap.snapshot, base_version=None, target_version=s, fingerprint=snap.fingerprint)
            steps = [first] + [patch_step(m.patch, m.version - 1, m) for m in chain]
            candidates.append((sum(st.object.size for st in steps), 3, "snapshot", steps))
            # For a worker with no usable patch path, one merged patch from the newest snapshot
            # can replace the chain (fewer bytes, one apply). Not built otherwise: a patch path
            # is far smaller than any snapshot, so that merge would be wasted work.
            patch_path = any(c[2] != "snapshot" for c in candidates)
            if not patch_path and s == snapshots[-1] and 2 <= b - s <= self.settings.max_merge_lag:
                merged = await self._merged_for_plan(run, state, s, b, SNAPSHOT_LAG, build_merges)
                if merged is not None:
                    candidates.append((snap.snapshot.size + merged.size, 3, "snapshot", [first, patch_step(merged, s, target)]))
        if not candidates:
            raise NotFound(f"no snapshot or chain reaches version {b} of run {run!r}")
        total, _, kind, steps = min(candidates, key=lambda c: (c[0], c[1]))
        expiry = time.monotonic() + self.settings.plan_lease_s
        for step in steps:
            state.leases[step.object.key] = max(state.leases.get(step.object.key, 0.0), expiry)
        self.metrics.plans.labels(kind).inc()
        peers = {st.object.key: self.peers.holders(run, st.object.key, exclude=peer) for st in steps}
        return Plan(
            run=run, from_version=a, to_version=b, kind=kind, fingerprint=target.fingerprint,  # type: ignore[arg-type]
            total_bytes=total, steps=steps, lease_s=self.settings.plan_lease_s,
            peers={k: v for k, v in peers.items() if v},
        )

    async def _merged_for_plan(
        self, run: str, state: RunState, a: int, b: int, wish: int, build: bool
    ) -> ObjectRef | None:
        if build or (a, b) in state.merged:
            return await self._merged(run, state, a, b)
        state.wanted[wish] = time.monotonic()
        return None

    async def _merge_wanted(self, run: str, version: int) -> None:
        """After publishing `version`: build the merges plans wanted lately, ending at it, so that
        workers asking anonymously find them (at most max_publish_merges, most recent wishes first)."""
        state = self._runs[run]
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
                await self._merged(run, state, a, version)

    async def _merged(self, run: str, state: RunState, a: int, b: int) -> ObjectRef | None:
        """The merged a→b patch, built once and cached in the store; None if it cannot be built."""
        if (a, b) in state.merged:
            return state.merged[(a, b)]
        lock = self._merge_locks.setdefault((run, a, b), asyncio.Lock())
        async with lock, self._merge_slot:
            if (a, b) in state.merged:
                return state.merged[(a, b)]
            t0 = time.perf_counter()
            try:
                chain = self._chain(state, a, b)
                if chain is None:
                    return None
                blobs = [await self._read_verified(run, m.patch) for m in chain]
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
            ref = self._ref(run, key, data)
            await self.storage.put(f"{run}/{key}", data)
            await self.storage.put(f"{run}/merged/{a}-{b}.json", ref.model_dump_json().encode())
            state.merged[(a, b)] = ref
            self.metrics.merge_seconds.observe(time.perf_counter() - t0)
            return ref

    # -- retention --

    def _leased(self, state: RunState, keys: Iterable[str], now: float) -> bool:
        return any(state.leases.get(k, 0.0) > now for k in keys)

    async def retain(self, run: str) -> int:
        """Keep the last `keep_snapshots` snapshots and every version from the oldest kept one;
        delete what lies below it, except objects a plan handed out within `plan_lease_s`.
        Manifests go first so no reader ever sees a version whose objects are gone."""
        state = await self._run(run)
        now = time.monotonic()
        if now < self._started + self.settings.plan_lease_s:
            return 0
        deleted = 0
        async with state.lock:
            snapshots = state.snapshots()
            if len(snapshots) <= self.settings.keep_snapshots:
                return 0
            floor = snapshots[-self.settings.keep_snapshots]
            state.leases = {k: t for k, t in state.leases.items() if t > now}
            for v in sorted(v for v in state.manifests if v < floor):
                m = state.manifests[v]
                keys = [ref.key for ref in (m.patch, m.snapshot) if ref is not None]
                if self._leased(state, keys, now):
                    continue
                await self.storage.delete(f"{run}/manifests/{v}.json")
                del state.manifests[v]
                for key in keys:
                    await self.storage.delete(f"{run}/{key}")
                deleted += 1 + len(keys)
            for (a, b), ref in list(state.merged.items()):
                if a < floor and not self._leased(state, [ref.key], now):
                    await self.storage.delete(f"{run}/merged/{a}-{b}.json")
                    await self.storage.delete(f"{run}/{ref.key}")
                    del state.merged[(a, b)]
                    deleted += 2
        self.metrics.deleted.inc(deleted)
        return deleted
