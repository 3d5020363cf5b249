"""Parallel ranged downloads of registry objects, every piece verified against its sha256.

Downloads are split into the pieces listed in the plan, fetched by `streams` parallel ranged
requests; a dropped connection resumes at the byte it stopped, with exponential backoff, so a
registry restart mid-download costs only the retry wait. With `cache_dir`, verified pieces also
survive a client restart.
"""

from __future__ import annotations

import asyncio
import bisect
import hashlib
import logging
import mmap
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import httpx

from shared.registry.errors import CorruptObjectError, RegistryHTTPError
from shared.registry.transport import RegistryTransport
from shared.registry.wire import ObjectRef

log = logging.getLogger(__name__)

# Longest range one download request asks for: at 1 Gbit/s ~130 ms of transfer per request
# turnaround, while a dropped or slow stream still holds back little of the rest.
RUN_BYTES = 16 << 20
# PathTiming keeps at most this many arrivals, thinned to every other one when over: a rate's span
# then starts within 1/2,048 of the bytes of the middle, and a 3 GB fetch keeps ~100 kB of them.
MAX_ARRIVALS = 4096


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


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


@dataclass
class _Download:
    """One object being fetched: its buffer, which pieces are verified, and an optional part file."""

    ref: ObjectRef
    buffer: mmap.mmap
    done: list[bool]
    part: Path | None = None
    # Per piece, how many of its bytes have landed in the buffer from its start (every stream fills
    # its pieces in order): what a relay may forward before the piece is whole (cut-through).
    filled: list[int] = field(init=False)
    # Peers waiting for bytes or a verified piece (shared.relay), each on its own event loop: a
    # relay endpoint may serve from a server thread while this download runs on another loop.
    _waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.filled = [0] * len(self.done)

    def piece_range(self, i: int) -> tuple[int, int]:
        start = i * self.ref.piece_bytes
        return start, min(start + self.ref.piece_bytes, self.ref.size)

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for loop, future in waiters:
            if not loop.is_closed():
                loop.call_soon_threadsafe(_wake, future)

    def mark_done(self, i: int) -> None:
        """Piece i is verified: record it and wake whoever waits."""
        self.done[i] = True
        self._wake()

    def landed(self, start: int, end: int) -> None:
        """A stream wrote bytes [start, end) of the buffer, continuing where it stood: record how
        far each piece they touch is filled and wake whoever waits for bytes."""
        if end <= start:
            return
        for i in range(start // self.ref.piece_bytes, (end - 1) // self.ref.piece_bytes + 1):
            first, last = self.piece_range(i)
            self.filled[i] = max(self.filled[i], min(end, last) - first)
        self._wake()

    def available(self, i: int) -> int:
        """Bytes of piece i that can be sent on: all of it once verified, else what has landed."""
        start, end = self.piece_range(i)
        return end - start if self.done[i] else self.filled[i]

    async def wait_bytes(self, i: int, have: int, timeout_s: float) -> bool:
        """True once more than `have` bytes of piece i can be sent on; False if none more come
        within timeout_s."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.available(i) <= have:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            future = loop.create_future()
            self._waiters.append((loop, future))
            if self.available(i) > have:  # changed between the check and the append: no wake-up comes
                break
            try:
                await asyncio.wait_for(future, remaining)
            except TimeoutError:
                return False
        return True


@dataclass
class PathTiming:
    """What the fetches from one source saw of the path to it (shared.relay.Relay measures each
    source it fetches from): the shortest time from a request to its answer's headers, less what
    the source said it waited before answering (a round trip), and the rate of the second half of
    everything the source sent, whatever the requests it came in. The second half because a
    relayed stream starts by draining what its source already holds, at whatever its own link
    allows, and only then flows at the rate the source receives and can send: the first half's
    rate says when the stream started, not what the path carries. Of all the source's bytes, not
    per request: a source may answer in several requests (the registry sent the head one piece per
    request until it took each object in one), and each request's second half over the span from
    the first to the last read half the rate (measured then: the registry → head path at 103-200
    Mbit/s where every hop after it read 300-500)."""

    rtt_s: float | None = None
    bytes: int = 0
    # (loop time, bytes so far) as bytes land; the last one always kept (MAX_ARRIVALS).
    arrivals: list[tuple[float, int]] = field(default_factory=list)

    def answered(self, rtt_s: float) -> None:
        self.rtt_s = max(0.0, rtt_s if self.rtt_s is None else min(self.rtt_s, rtt_s))

    def landed(self, nbytes: int, at: float) -> None:
        self.bytes += nbytes
        self.arrivals.append((at, self.bytes))
        if len(self.arrivals) > MAX_ARRIVALS:
            self.arrivals = self.arrivals[(len(self.arrivals) - 1) % 2 :: 2]

    def rate_bps(self) -> float | None:
        """Bits per second from the arrival that passed half the bytes to the last one (the one
        before it when the last passed half: a chunk that brought most of a small answer), None
        without a span to divide by."""
        if len(self.arrivals) < 2:
            return None
        middle = bisect.bisect_left(self.arrivals, self.bytes / 2, key=lambda arrival: arrival[1])
        middle = min(middle, len(self.arrivals) - 2)
        (since, before), last = self.arrivals[middle], self.arrivals[-1][0]
        if last <= since:
            return None
        return (self.bytes - before) * 8 / (last - since)


def _sha256(data: bytes | memoryview | bytearray) -> str:
    return hashlib.sha256(data).hexdigest()


class PieceSource(Protocol):
    """Another way to fill downloads (shared.relay.Relay: from peers, the registry for the rest)."""

    async def fetch(self, downloader: Downloader, downloads: list[_Download]) -> None: ...


class Downloader:
    """Fetches objects of the transport's run; `bandwidth_bps` in bits per second (None: uncapped)."""

    def __init__(self, transport: RegistryTransport, *, bandwidth_bps: float | None = None,
                 cache_dir: str | os.PathLike[str] | None = None) -> None:
        self.transport = transport
        self.bucket = TokenBucket(bandwidth_bps) if bandwidth_bps else None
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.relay: PieceSource | None = None  # shared.relay.Relay: peers first (set by the owner)

    def _open_download(self, ref: ObjectRef) -> _Download:
        n = len(ref.pieces)
        # Anonymous memory: pages are zeroed by the kernel as bytes land in them, spread over the
        # transfer, where a bytearray is zero-filled up front (~15 ms per 20 MB before any byte moves).
        download = _Download(ref, mmap.mmap(-1, max(1, ref.size)), [False] * n)
        if self.cache_dir is None:
            return download
        # Named by content (the piece hashes): a stale part of another object can never match.
        ident = hashlib.sha256("".join(ref.pieces).encode()).hexdigest()[:24]
        folder = self.cache_dir / self.transport.run
        folder.mkdir(parents=True, exist_ok=True)
        download.part = folder / f"{ref.key.replace('/', '_')}.{ident}.part"
        if download.part.exists():
            existing = download.part.read_bytes()[: ref.size]
            download.buffer[: len(existing)] = existing
            for i in range(n):
                start, end = download.piece_range(i)
                if end <= len(existing) and _sha256(memoryview(download.buffer)[start:end]) == ref.pieces[i]:
                    download.done[i] = True
                    self.transport.counters.resumed_pieces += 1
        else:
            with open(download.part, "wb") as f:
                f.truncate(ref.size)
        return download

    async def _receive(self, download: _Download, first: int, last: int,
                       on_piece: Callable[[int], None] | None = None,
                       timing: PathTiming | None = None) -> None:
        """Fetch pieces first..last-1 with one ranged request into the buffer, calling on_piece(i)
        as each one is complete; a dropped stream resumes at the byte it stopped. `timing` notes
        each answer's round trip and bytes (the registry answers at once: no wait to subtract)."""
        start, end = download.piece_range(first)[0], download.piece_range(last - 1)[1]
        url = self.transport._path(f"objects/{download.ref.key}")
        offset, attempt, next_piece = start, 0, first
        loop = asyncio.get_running_loop()
        while offset < end:
            try:
                headers = {"Range": f"bytes={offset}-{end - 1}"}
                sent = loop.time()
                async with self.transport._http.stream("GET", url, headers=headers) as response:
                    if response.status_code != 206:
                        await response.aread()
                        self.transport._raise_for(response)
                        raise RegistryHTTPError(response.status_code, "expected a 206 range answer")
                    if timing is not None:
                        timing.answered(loop.time() - sent)
                        timing.landed(0, loop.time())  # the body starts: an answer in one chunk has a span
                    # Chunks as the socket delivers them (no re-chunking copies).
                    async for chunk in response.aiter_raw():
                        if self.bucket:
                            await self.bucket.take(len(chunk))
                        take = min(len(chunk), end - offset)
                        download.buffer[offset : offset + take] = memoryview(chunk)[:take]
                        offset += take
                        if timing is not None:
                            timing.landed(take, loop.time())
                        download.landed(offset - take, offset)
                        self.transport.counters.bytes += len(chunk)
                        while next_piece < last and download.piece_range(next_piece)[1] <= offset:
                            if on_piece is not None:
                                on_piece(next_piece)
                            next_piece += 1
                if offset < end:
                    raise httpx.RemoteProtocolError("range answer ended early")
            except (httpx.TransportError, RegistryHTTPError) as exc:
                if isinstance(exc, RegistryHTTPError) and exc.status < 500:
                    raise
                if attempt >= self.transport.retries:
                    raise
                log.info("pieces %d-%d of %s interrupted at byte %d (%s); resuming",
                         first, last - 1, download.ref.key, offset, exc)
                await self.transport._backoff(attempt)
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
                download.mark_done(i)
                self.transport.counters.pieces += 1
                return True
            log.warning("piece %d of %s failed its sha256 (try %d)", i, download.ref.key, verification + 1)
        if not refetch:
            return False
        raise CorruptObjectError(f"{download.ref.key}: piece {i} (bytes {start}-{end}) fails its sha256",
                                 download.ref.key)

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
            await self.relay.fetch(self, downloads)  # peers first, the registry for the rest
        else:
            await self.fetch_direct(downloads)
        for download in downloads:
            if download.part is not None:
                download.part.unlink(missing_ok=True)
        return [memoryview(d.buffer)[: d.ref.size] for d in downloads]

    async def fetch_direct(self, downloads: Sequence[_Download], *, in_order: bool = False,
                           timing: PathTiming | None = None) -> None:
        """Fill downloads from the registry (the body of download()). `in_order`: each run of
        missing pieces in one ranged request, runs one after another on one stream, so pieces land
        in index order at the link's rate (a relay serving peers while it downloads: they stream in
        order, and would wait on a piece at the start of another stream's run; one piece per
        request on several streams instead leaves each stream idle a round trip per piece, ~0.56 of
        1 Gbit/s at 100 ms: docs/registry.md, "The head in one request"). `timing`: what the
        requests saw of the path (PathTiming)."""
        pending = sum(d.done.count(False) for d in downloads)
        share = -(-pending // self.transport.streams)
        queue: asyncio.Queue[tuple[_Download, int, int]] = asyncio.Queue()
        for download in downloads:
            i, n = 0, len(download.done)
            most = n if in_order else max(1, min(share, RUN_BYTES // download.ref.piece_bytes))
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
                def verify(i: int, d: _Download = download) -> None:
                    group.create_task(self._verify_piece(d, i))

                await self._receive(download, first, last, verify, timing)

        try:
            async with asyncio.TaskGroup() as group:
                for _ in range(1 if in_order else min(self.transport.streams, max(1, queue.qsize()))):
                    group.create_task(stream(group))
        except ExceptionGroup as errors:
            # The first failure cancels the other streams; callers handle plain exceptions.
            raise errors.exceptions[0] from None
