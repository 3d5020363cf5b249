"""Async client of the weight-patch registry (services/registry), and the registry's wire types.

A rollout worker needs only the registry URL:

    async with RegistryClient("http://registry:8100", "run1", streams=4) as client:
        await client.fetch_model_files("model/")          # config + tokenizer
        state: dict[str, Tensor] = {}
        result = await client.sync_to(state, None)        # snapshot + chain → latest
        ...
        v = await client.wait_for_version(result.version, timeout=60)
        result = await client.sync_to(engine.state_dict(), result.version)   # in place

Downloads are split into the pieces listed in the plan (each with its sha256), fetched by
`streams` parallel ranged requests; a dropped connection resumes at the byte it stopped, with
exponential backoff, so a registry restart mid-download costs only the retry wait. With
`cache_dir`, verified pieces also survive a client restart. Weights change only after every byte
is verified; any verification failure falls back to the snapshot path.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import mmap
import os
import random
import time
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import httpx
import torch
from pydantic import BaseModel

from shared.coord.keys import Keys
from shared.patch import PatchError, apply_patch, load_snapshot

if TYPE_CHECKING:
    from shared.relay import Relay

log = logging.getLogger(__name__)

MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)
METRICS_HEADER = "X-Sparsecast-Metrics"
# Longest range one download request asks for: at 1 Gbit/s ~130 ms of transfer per request
# turnaround, while a dropped or slow stream still holds back little of the rest.
RUN_BYTES = 16 << 20


# --- wire types (the registry's JSON) --------------------------------------------------------


class ObjectRef(BaseModel):
    """A stored object of a run, with the sha256 of each `piece_bytes` piece for verification."""

    key: str  # relative to the run: "patches/3-4.patch", "snapshots/0.safetensors", "merged/2-6.patch"
    size: int
    piece_bytes: int
    pieces: list[str]


class Manifest(BaseModel):
    run: str
    version: int
    fingerprint: str  # of the weights at this version
    base_version: int | None = None  # None for a first snapshot
    base_fingerprint: str | None = None
    patch: ObjectRef | None = None  # base_version → version
    snapshot: ObjectRef | None = None
    dense_bytes: int  # bytes of the full weights
    changed: int | None = None  # elements the patch changes
    created_at: float
    metrics: dict[str, Any] = {}

    @property
    def payload_ratio(self) -> float | None:
        """Dense bytes per patch byte (how much smaller than a full sync)."""
        return self.dense_bytes / self.patch.size if self.patch else None


class PlanStep(BaseModel):
    kind: Literal["snapshot", "patch"]
    object: ObjectRef
    base_version: int | None  # None for a snapshot
    target_version: int
    fingerprint: str  # weights after this step


class Plan(BaseModel):
    run: str
    from_version: int | None
    to_version: int
    kind: Literal["none", "merged", "chain", "snapshot"]
    fingerprint: str
    total_bytes: int
    steps: list[PlanStep]
    lease_s: float  # the registry keeps the plan's objects at least this long
    peers: dict[str, list[str]] = {}  # object key → peers holding it (shared.relay), best first


# --- errors ----------------------------------------------------------------------------------


class RegistryHTTPError(Exception):
    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"registry answered {status}: {detail}")
        self.status = status
        self.detail = detail


class CorruptObjectError(Exception):
    """A downloaded piece does not match its sha256, even after a refetch."""


class SyncError(Exception):
    """sync_to could not reach the target; `version` is the version the weights hold (intact)."""

    def __init__(self, message: str, version: int | None) -> None:
        super().__init__(message)
        self.version = version


@dataclass
class SyncResult:
    version: int
    fingerprint: str
    bytes: int  # bytes received over the network (retried and resumed bytes included)
    seconds: float
    path: Literal["none", "merged", "chain", "snapshot"]
    fell_back: bool = False  # the first path failed verification; the snapshot path was used


# --- transport pieces ------------------------------------------------------------------------


class TokenBucket:
    """Caps the aggregate rate of all streams (emulates one slow link for benchmarks).

    Debt-based: a taker subtracts its bytes and sleeps off any deficit while holding the lock, so
    streams queue fairly and the long-run rate is exact. The bucket starts empty, as a link has no
    head start, and banks at most about 10 ms of traffic while idle (request turnarounds), so a
    capped run is never faster than bytes ÷ rate.
    """

    def __init__(
        self,
        bits_per_s: float,
        burst_bytes: int | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        if bits_per_s <= 0:
            raise ValueError("bandwidth must be positive")
        self.rate = bits_per_s / 8  # bytes per second
        self.capacity = burst_bytes if burst_bytes is not None else max(16 << 10, int(self.rate / 100))
        self._clock = clock
        self._sleep = sleep
        self._tokens = 0.0
        self._last = clock()
        self._lock = asyncio.Lock()

    async def take(self, n: int) -> None:
        async with self._lock:
            now = self._clock()
            self._tokens = min(self.capacity, self._tokens + (now - self._last) * self.rate)
            self._last = now
            self._tokens -= n
            if self._tokens < 0:
                await self._sleep(-self._tokens / self.rate)


@dataclass
class _Download:
    """One object being fetched: its buffer, which pieces are verified, and an optional part file."""

    ref: ObjectRef
    buffer: mmap.mmap
    done: list[bool]
    part: Path | None = None

    def piece_range(self, i: int) -> tuple[int, int]:
        start = i * self.ref.piece_bytes
        return start, min(start + self.ref.piece_bytes, self.ref.size)


@dataclass
class _Counters:
    """What this client has moved since it was made (read by benchmarks and tests)."""

    bytes: int = 0
    retries: int = 0
    resumed_pieces: int = 0
    pieces: int = 0


def _sha256(data: bytes | memoryview | bytearray) -> str:
    return hashlib.sha256(data).hexdigest()


# --- client ----------------------------------------------------------------------------------


class RegistryClient:
    """Client of one run. `bandwidth_bps` is in bits per second (None: uncapped)."""

    def __init__(
        self,
        base_url: str,
        run: str,
        *,
        token: str | None = None,
        streams: int = 4,
        bandwidth_bps: float | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        redis_url: str | None = None,
        redis_prefix: str = "sparsecast",
        retries: int = 8,
        backoff_s: float = 0.2,
        max_backoff_s: float = 4.0,
        timeout_s: float = 120.0,
    ) -> None:
        if streams < 1:
            raise ValueError("streams must be >= 1")
        self.base_url = base_url.rstrip("/")
        self.run = run
        self.token = token
        self.streams = streams
        self.bucket = TokenBucket(bandwidth_bps) if bandwidth_bps else None
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.redis_url = redis_url
        self.redis_prefix = redis_prefix
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.counters = _Counters()
        self.relay: Relay | None = None  # shared.relay: fetch from peers first (set by the owner)
        # Plans may merge patches on demand: reads get a long timeout, connects fail fast (retried).
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=httpx.Timeout(timeout_s, connect=5.0),
            limits=httpx.Limits(max_connections=streams + 2, max_keepalive_connections=streams + 2),
        )

    async def __aenter__(self) -> RegistryClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    # -- plumbing --

    def _path(self, suffix: str) -> str:
        return f"/v1/runs/{self.run}/{suffix}"

    def _auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    async def _backoff(self, attempt: int) -> None:
        self.counters.retries += 1
        delay = min(self.max_backoff_s, self.backoff_s * 2**attempt)
        await asyncio.sleep(delay * (0.5 + random.random() / 2))

    async def _retrying(self, action: Callable[[], Awaitable[Any]], what: str) -> Any:
        """Run action, retrying transport errors and 5xx answers with exponential backoff."""
        for attempt in range(self.retries + 1):
            try:
                return await action()
            except httpx.TransportError as exc:
                error: Exception = exc
            except RegistryHTTPError as exc:
                if exc.status < 500:
                    raise
                error = exc
            if attempt == self.retries:
                raise error
            # debug: callers that ride out outages log those once (shared.retry)
            log.debug("%s failed (%s), retrying", what, error)
            await self._backoff(attempt)
        raise AssertionError("unreachable")

    @staticmethod
    def _raise_for(response: httpx.Response) -> None:
        if response.status_code >= 400:
            try:
                detail = response.json().get("detail", response.text)
            except ValueError:
                detail = response.text
            raise RegistryHTTPError(response.status_code, str(detail))

    async def _get_json(self, suffix: str, params: dict[str, Any] | None = None) -> Any:
        async def action() -> Any:
            # The token also lets a plan have a missing merged patch built at once (docs/registry.md).
            response = await self._http.get(self._path(suffix), params=params, headers=self._auth())
            self._raise_for(response)
            return response.json()

        return await self._retrying(action, f"GET {suffix}")

    async def _put(self, suffix: str, data: bytes, headers: dict[str, str] | None = None) -> Any:
        # Only a refused connection is retried: the request never reached the registry, so a
        # retry cannot publish twice (a lost answer to a sent upload is reported, not retried).
        async def action() -> Any:
            try:
                response = await self._http.put(
                    self._path(suffix),
                    content=data,
                    headers={"Content-Type": "application/octet-stream", **self._auth(), **(headers or {})},
                )
            except httpx.ConnectError:
                raise
            except httpx.TransportError as exc:
                raise RegistryHTTPError(0, f"upload interrupted: {exc}") from exc
            self._raise_for(response)
            return response.json()

        return await self._retrying(action, f"PUT {suffix}")

    # -- reads --

    async def ping(self, timeout_s: float = 2.0) -> None:
        """Raise unless the registry says it is ready (its store answers) within timeout_s; one
        try, for readiness probes."""
        response = await self._http.get("/readyz", timeout=timeout_s)
        self._raise_for(response)

    async def latest(self) -> Manifest | None:
        """The head manifest, or None while the run has no version."""
        try:
            return Manifest.model_validate(await self._get_json("latest"))
        except RegistryHTTPError as exc:
            if exc.status == 404:
                return None
            raise

    async def versions(self) -> list[Manifest]:
        return [Manifest.model_validate(m) for m in await self._get_json("versions")]

    async def manifest(self, version: int) -> Manifest:
        return Manifest.model_validate(await self._get_json(f"manifests/{version}"))

    async def plan(self, from_version: int | None, to_version: int | None = None) -> Plan:
        """Cheapest way from from_version (None: no weights) to to_version (None: latest)."""
        params: dict[str, int] = {"from": -1 if from_version is None else from_version}
        if to_version is not None:
            params["to"] = to_version
        return Plan.model_validate(await self._get_json("plan", params))

    # -- downloads --

    def _open_download(self, ref: ObjectRef) -> _Download:
        n = len(ref.pieces)
        # Anonymous memory: pages are zeroed by the kernel as bytes land in them, spread over the
        # transfer, where a bytearray is zero-filled up front (~15 ms per 20 MB before any byte moves).
        download = _Download(ref, mmap.mmap(-1, max(1, ref.size)), [False] * n)
        if self.cache_dir is None:
            return download
        # Named by content (the piece hashes): a stale part of another object can never match.
        ident = hashlib.sha256("".join(ref.pieces).encode()).hexdigest()[:24]
        folder = self.cache_dir / self.run
        folder.mkdir(parents=True, exist_ok=True)
        download.part = folder / f"{ref.key.replace('/', '_')}.{ident}.part"
        if download.part.exists():
            existing = download.part.read_bytes()[: ref.size]
            download.buffer[: len(existing)] = existing
            for i in range(n):
                start, end = download.piece_range(i)
                if end <= len(existing) and _sha256(memoryview(download.buffer)[start:end]) == ref.pieces[i]:
                    download.done[i] = True
                    self.counters.resumed_pieces += 1
        else:
            with open(download.part, "wb") as f:
                f.truncate(ref.size)
        return download

    async def _receive(self, download: _Download, first: int, last: int,
                       on_piece: Callable[[int], None] | None = None) -> None:
        """Fetch pieces first..last-1 with one ranged request into the buffer, calling on_piece(i)
        as each one is complete; a dropped stream resumes at the byte it stopped."""
        start, end = download.piece_range(first)[0], download.piece_range(last - 1)[1]
        url = self._path(f"objects/{download.ref.key}")
        offset, attempt, next_piece = start, 0, first
        while offset < end:
            try:
                headers = {"Range": f"bytes={offset}-{end - 1}"}
                async with self._http.stream("GET", url, headers=headers) as response:
                    if response.status_code != 206:
                        await response.aread()
                        self._raise_for(response)
                        raise RegistryHTTPError(response.status_code, "expected a 206 range answer")
                    # Chunks as the socket delivers them (no re-chunking copies).
                    async for chunk in response.aiter_raw():
                        if self.bucket:
                            await self.bucket.take(len(chunk))
                        take = min(len(chunk), end - offset)
                        download.buffer[offset : offset + take] = memoryview(chunk)[:take]
                        offset += take
                        self.counters.bytes += len(chunk)
                        while next_piece < last and download.piece_range(next_piece)[1] <= offset:
                            if on_piece is not None:
                                on_piece(next_piece)
                            next_piece += 1
                if offset < end:
                    raise httpx.RemoteProtocolError("range answer ended early")
            except (httpx.TransportError, RegistryHTTPError) as exc:
                if isinstance(exc, RegistryHTTPError) and exc.status < 500:
                    raise
                if attempt >= self.retries:
                    raise
                log.info("pieces %d-%d of %s interrupted at byte %d (%s); resuming",
                         first, last - 1, download.ref.key, offset, exc)
                await self._backoff(attempt)
                attempt += 1

    async def _verify_piece(self, download: _Download, i: int, *, refetch: bool = True) -> bool:
        """Check piece i against its sha256, refetching it once on a mismatch; keep it in the part
        file. Without `refetch` a mismatch returns False (a relay then asks the registry)."""
        start, end = download.piece_range(i)
        piece = memoryview(download.buffer)[start:end]
        for verification in range(2 if refetch else 1):
            if verification:
                await self._receive(download, i, i + 1)
            # hashlib drops the GIL: a thread hashes while the loop keeps every stream receiving.
            if await asyncio.to_thread(_sha256, piece) == download.ref.pieces[i]:
                if download.part is not None:
                    fd = os.open(download.part, os.O_WRONLY)
                    try:
                        os.pwrite(fd, piece, start)
                    finally:
                        os.close(fd)
                download.done[i] = True
                self.counters.pieces += 1
                return True
            log.warning("piece %d of %s failed its sha256 (try %d)", i, download.ref.key, verification + 1)
        if not refetch:
            return False
        raise CorruptObjectError(f"{download.ref.key}: piece {i} (bytes {start}-{end}) fails its sha256")

    async def download(self, refs: Sequence[ObjectRef]) -> list[memoryview]:
        """Fetch objects with `streams` parallel ranged requests; every piece verified.

        Work is split into runs of contiguous pending pieces, one request each: about an equal
        share per stream, at most RUN_BYTES, so a single stream does not leave the link idle for a
        request turnaround every piece. Each piece is hashed in a thread as soon as its last byte
        lands, while the stream keeps receiving. Returns views of the receive buffers (copying a
        large chain again would cost more than hashing it).
        """
        downloads = [self._open_download(ref) for ref in refs]
        if self.relay is not None:
            await self.relay.fetch(self, downloads)  # peers first, this registry for the rest
        else:
            await self.fetch_direct(downloads)
        for download in downloads:
            if download.part is not None:
                download.part.unlink(missing_ok=True)
        return [memoryview(d.buffer)[: d.ref.size] for d in downloads]

    async def fetch_direct(self, downloads: Sequence[_Download]) -> None:
        """Fill downloads from the registry (the body of download())."""
        pending = sum(d.done.count(False) for d in downloads)
        share = -(-pending // self.streams)
        queue: asyncio.Queue[tuple[_Download, int, int]] = asyncio.Queue()
        for download in downloads:
            most = max(1, min(share, RUN_BYTES // download.ref.piece_bytes))
            i, n = 0, len(download.done)
            while i < n:
                if download.done[i]:
                    i += 1
                    continue
                last = i + 1
                while last < n and last - i < most and not download.done[last]:
                    last += 1
                queue.put_nowait((download, i, last))
                i = last

        async def stream(group: asyncio.TaskGroup) -> None:
            while True:
                try:
                    download, first, last = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                await self._receive(download, first, last,
                                    lambda i, d=download: group.create_task(self._verify_piece(d, i)))

        try:
            async with asyncio.TaskGroup() as group:
                for _ in range(min(self.streams, max(1, queue.qsize()))):
                    group.create_task(stream(group))
        except ExceptionGroup as errors:
            # The first failure cancels the other streams; callers handle plain exceptions.
            raise errors.exceptions[0] from None

    # -- sync --

    async def sync_to(
        self,
        state: MutableMapping[str, torch.Tensor],
        current_version: int | None,
        target: int | None = None,
    ) -> SyncResult:
        """Bring `state` from current_version (None: no weights) to target (None: latest), in place.

        Patches are applied in place (all-or-nothing each, target fingerprint verified). If any
        verification fails, the snapshot path is taken instead; its tensors are verified before a
        single weight is overwritten. An empty `state` is filled from the snapshot. On failure a
        SyncError says which version the (intact) weights hold.
        """
        t0 = time.perf_counter()
        bytes0 = self.counters.bytes
        plan = await self.plan(current_version, target)
        version = current_version
        fell_back = False
        if plan.kind in ("merged", "chain"):
            try:
                blobs = await self.download([step.object for step in plan.steps])
                for blob in blobs:
                    header = await asyncio.to_thread(apply_patch, state, blob, verify=True)
                    version = header.target_version
            except (CorruptObjectError, PatchError, RegistryHTTPError) as exc:  # incl. an object gone (404)
                log.warning("patch path %s→%s failed (%s); falling back to a snapshot", current_version, plan.to_version, exc)
                fell_back = True
                plan = await self.plan(None, plan.to_version)
        if plan.kind == "snapshot":
            try:
                await self._sync_snapshot(state, plan)
            except (CorruptObjectError, PatchError, ValueError, RegistryHTTPError, httpx.TransportError) as exc:
                raise SyncError(f"snapshot path to {plan.to_version} failed: {exc}", version) from exc
        return SyncResult(
            version=plan.to_version,
            fingerprint=plan.fingerprint,
            bytes=self.counters.bytes - bytes0,
            seconds=time.perf_counter() - t0,
            path=plan.kind,
            fell_back=fell_back,
        )

    async def _sync_snapshot(self, state: MutableMapping[str, torch.Tensor], plan: Plan) -> None:
        blobs = await self.download([step.object for step in plan.steps])

        def build() -> dict[str, torch.Tensor]:
            tensors, info = load_snapshot(blobs[0])  # checks the tensors against its fingerprint
            if info.fingerprint != plan.steps[0].fingerprint:
                raise CorruptObjectError(
                    f"snapshot {plan.steps[0].object.key} holds {info.fingerprint}, the plan expects {plan.steps[0].fingerprint}"
                )
            for blob in blobs[1:]:
                apply_patch(tensors, blob, verify=True)
            return tensors

        tensors = await asyncio.to_thread(build)
        if not state:
            state.update(tensors)
            return
        if set(state) != set(tensors):
            missing, extra = sorted(set(tensors) - set(state)), sorted(set(state) - set(tensors))
            raise ValueError(f"snapshot tensors differ from the weights (missing {missing[:3]}, extra {extra[:3]})")
        for name, tensor in tensors.items():
            if state[name].shape != tensor.shape or state[name].dtype != tensor.dtype:
                raise ValueError(f"{name}: snapshot has {tensor.dtype}{list(tensor.shape)}, weights differ")
        with torch.no_grad():
            for name, tensor in tensors.items():
                state[name].copy_(tensor)

    async def wait_for_version(self, after: int, timeout: float, poll_s: float = 1.0) -> int | None:
        """The first version > after, or None at timeout. Woken by the registry's Redis
        announcement when redis_url is set; polls /latest otherwise (and as a safety net)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        pubsub = None
        redis_client = None
        if self.redis_url:
            import redis.asyncio as aioredis

            try:
                redis_client = aioredis.Redis.from_url(self.redis_url)
                pubsub = redis_client.pubsub()
                await pubsub.subscribe(Keys(self.redis_prefix, self.run).versions_channel)
                poll_s = max(poll_s, 5.0)  # announcements wake us; polling is only the safety net
            except Exception as exc:  # noqa: BLE001 - any Redis trouble means: poll instead
                log.debug("version announcements unavailable (%s); polling", exc)
                pubsub = None
        try:
            while True:
                latest = await self.latest()
                if latest is not None and latest.version > after:
                    return latest.version
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return None
                wait = min(poll_s, remaining)
                if pubsub is None:
                    await asyncio.sleep(wait)
                    continue
                try:
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=wait)
                except Exception as exc:  # noqa: BLE001 - Redis went away: poll for the rest of the wait
                    log.debug("version announcements lost (%s); polling", exc)
                    await pubsub.aclose()
                    pubsub = None
                    continue
                if message is not None:
                    event = json.loads(message["data"])
                    if event.get("run") == self.run and event.get("version", -1) > after:
                        return int(event["version"])
        finally:
            if pubsub is not None:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()
            if redis_client is not None:
                with contextlib.suppress(Exception):
                    await redis_client.aclose()

    # -- writes (the trainer's side) --

    async def publish_patch(self, version: int, data: bytes, metrics: dict[str, Any] | None = None) -> Manifest:
        headers = {METRICS_HEADER: json.dumps(metrics)} if metrics else {}
        return Manifest.model_validate(await self._put(f"patches/{version}", data, headers))

    async def publish_snapshot(self, version: int, data: bytes) -> Manifest:
        return Manifest.model_validate(await self._put(f"snapshots/{version}", data))

    async def put_model_file(self, name: str, data: bytes) -> None:
        await self._put(f"model/{name}", data)

    async def fetch_model_files(self, dest: str | os.PathLike[str]) -> list[Path]:
        """Download the run's config and tokenizer files into dest; returns the written paths."""
        dest = Path(dest)
        dest.mkdir(parents=True, exist_ok=True)
        written = []
        for name in await self._get_json("model"):

            async def action(name: str = name) -> bytes:
                response = await self._http.get(self._path(f"model/{name}"))
                self._raise_for(response)
                return response.content

            path = dest / name
            path.write_bytes(await self._retrying(action, f"GET model/{name}"))
            written.append(path)
        return written
