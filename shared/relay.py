"""Relay fan-out: workers serve the pieces they verified to peers, and fetch from peers first.

Every worker downloading from the registry makes the registry's uplink carry the whole payload
once per worker. With a Relay on its client (`client.downloader.relay = Relay(...)`), a worker instead:

1. announces to the registry the objects it holds or is fetching (`PUT /v1/runs/{run}/peers/{id}`,
   with the token); the answer lists, per object, a peer to fetch from and a few fallbacks, never
   the worker itself. The registry hands each holder out as first choice to as few askers as it
   can (services/registry/peers.py): workers that ask together for a new version form a pipeline,
   registry → first asker → second → ..., so the registry sends one copy and every link carries
   the object once in each direction;
2. keeps each download in its `Holdings` from the start and serves it while still downloading
   (cut-through): `GET /v1/relay/{run}/pieces?key=&first=&last=` (`relay_app`) answers one stream
   of the pieces first..last-1 in order, their bytes sent from memory as they land here, before a
   piece is whole or verified (a wait, woken by each write, not a poll), ending early when no byte
   more comes within `wait_s`; 404 if the object (or a byte of its first piece within wait_s) is
   not held;
3. asks its first peer for all the pieces it lacks in one streamed request and checks each piece
   by its sha256 from the registry's plan as it lands, exactly as a piece from the registry. A
   peer that is slow (no byte within `piece_timeout_s`), dies, refuses (does not hold the object:
   behind on versions), stops early or lies (wrong bytes) is dropped for that object; the rest
   comes from the next peer listed, then from the registry. Connections to peers are kept open
   between requests (HTTP/1.1 keep-alive, up to `idle_connections` idle per peer), so the next
   version's stream does not pay a new TCP handshake; one the peer closed while idle is replaced,
   and a request that meets a connection closed just as it went out is sent once more on a new one.
4. measures each source it fetched an object from (`paths`: the round trip to a stream's headers,
   less the wait the peer reports in `Server-Timing`, and the stream's rate), smoothed per source,
   and reports them in its next announcement: the registry may then choose a tree by them
   (services/registry/peers.py, `peer_tree = "measured"`);
5. keeps its place in that order between versions (`keep_place`: the registry forgets a worker
   that has not announced for its TTL) and, if it starts from weights of its own, takes a place
   before the first version (`warm_up`: the first pieces of the newest snapshot, fetched through
   the pipeline as a new worker would fetch all of it), so the first patch runs on connections
   whose windows are already open.

Weights still change only after every byte is verified against the registry's hashes, so a peer
can cost time, never correctness. Peers serve anonymously: they hand out only what a plan from
the registry already lists, and nothing is trusted without its hash.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import re
import socket
import ssl
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Annotated, Any, cast
from urllib.parse import SplitResult, quote, urlencode, urlsplit

import httpx
from pydantic import BaseModel, Field, StringConstraints

from shared.registry.download import Downloader, PathTiming, _Download
from shared.registry.errors import CorruptObjectError, RegistryHTTPError
from shared.registry.wire import ObjectRef, Plan

log = logging.getLogger(__name__)

WORKER_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
MAX_ANNOUNCED_OBJECTS = 64  # a worker keeps a few versions' objects; more is not a relay
# How often a worker re-announces what it holds between downloads (`Relay.keep_place`): well under
# the registry's peer_ttl_s (60 s), after which it forgets the worker and its place in the order.
ANNOUNCE_EVERY_S = 20.0
# How much of the newest snapshot a worker that starts from weights of its own reads through the
# relay before its first version (`Relay.warm_up`): enough for a stream's window to grow to rate ×
# RTT (12.5 MB at 1 Gbit/s and 100 ms) on the connections the first patch's pipeline then uses.
WARM_UP_BYTES = 32 << 20
# What a failed announcement raises (`Relay.announce`): HTTP and socket errors, and ValueError for
# an answer that is no peer list. Its callers fall back or retry; none of these may end their loop.
ANNOUNCE_ERRORS = (httpx.HTTPError, RegistryHTTPError, OSError, ValueError)
# Measured paths (`Relay.paths`, `PeerAnnouncement.paths`): the key of the registry among the
# sources (every other key is a peer's URL); at most MAX_PATHS sources, the latest measured kept.
REGISTRY_SOURCE = "registry"
MAX_PATHS = 16
# A stream's rate is measured only over at least this many body bytes: less is mostly the ramp of
# the connection's window, not the path's rate.
MIN_RATE_BYTES = 1 << 20
# Weight of a new measurement in a source's smoothed figures: each one is already a whole
# object's stream, and versions are minutes apart, so a stall on one version counts half and a
# changed link shows within a few versions.
PATH_WEIGHT = 0.5
MAX_RTT_S = 600.0
MAX_RATE_BPS = 1e13  # 10 Tbit/s: beyond any link, a bound on what an announcement may claim


# --- wire types --------------------------------------------------------------------------------


PEER_URL = r"https?://[^\s/]+(/[^\s]*)?"


class PathSample(BaseModel):
    """A worker's smoothed measure of the path from one source it fetched from: the round trip
    (seconds) and the rate a stream got (bits per second)."""

    rtt_s: float = Field(ge=0, le=MAX_RTT_S, allow_inf_nan=False)
    rate_bps: float = Field(ge=0, le=MAX_RATE_BPS, allow_inf_nan=False)


Source = Annotated[str, StringConstraints(max_length=256, pattern=f"^({REGISTRY_SOURCE}|{PEER_URL})$")]


class PeerAnnouncement(BaseModel):
    """What a worker tells the registry: where it serves, the objects it holds or is fetching, and
    (optional: older workers send none) what it measured of the sources it fetched from, keyed by
    the peer's URL as the registry listed it, or REGISTRY_SOURCE."""

    url: str = Field(max_length=256, pattern=f"^{PEER_URL}$")
    objects: list[str] = Field(max_length=MAX_ANNOUNCED_OBJECTS)
    paths: dict[Source, PathSample] = Field(default_factory=dict, max_length=MAX_PATHS)


class PeerList(BaseModel):
    """Per object key, the base URLs of peers to try (best first)."""

    peers: dict[str, list[str]]


# --- the pieces a worker holds -------------------------------------------------------------------


class Holdings:
    """Downloads of this worker, newest last; their verified pieces are what it serves."""

    def __init__(self, keep: int = 8) -> None:
        self.keep = keep
        self._objects: OrderedDict[tuple[str, str], _Download] = OrderedDict()
        self.served_pieces = 0
        self.served_bytes = 0

    def add(self, run: str, download: _Download) -> None:
        self._objects[(run, download.ref.key)] = download
        self._objects.move_to_end((run, download.ref.key))
        while len(self._objects) > self.keep:
            self._objects.popitem(last=False)

    def keys(self, run: str) -> list[str]:
        return [key for (r, key) in self._objects if r == run]

    def find(self, run: str, key: str) -> _Download | None:
        return self._objects.get((run, key))

    async def stream(
        self, download: _Download, first: int, last: int, wait_s: float
    ) -> AsyncIterator[memoryview]:
        """Pieces first..last-1 in order, their bytes sent on as they land here, before the piece
        is whole or verified (cut-through: views of the receive buffer, no copy); stops when no
        byte more comes within wait_s. The asker verifies every piece against the registry's
        hashes, so bytes that fail here fail there too: that costs the asker this peer, never
        correctness."""
        view = memoryview(download.buffer)
        for i in range(first, last):
            start, end = download.piece_range(i)
            sent = 0
            while sent < end - start:
                if not await download.wait_bytes(i, sent, wait_s):
                    return
                have = download.available(i)
                self.served_bytes += have - sent
                self.served_pieces += have == end - start
                yield view[start + sent : start + have]
                sent = have


RELAY_PATH = "/v1/relay/{run}/pieces"


def relay_app(holdings: Holdings, wait_s: float = 5.0) -> Any:
    """The peer endpoint as a small ASGI app of its own (a rollout service adds relay_endpoint
    to its app instead)."""
    from starlette.applications import Starlette
    from starlette.routing import Route

    return Starlette(routes=[Route(RELAY_PATH, relay_endpoint(holdings, wait_s))])


def relay_endpoint(holdings: Holdings, wait_s: float = 5.0) -> Any:
    """GET RELAY_PATH?key=&first=&last=: pieces first..last-1 (last defaults to first + 1) as one
    stream, their bytes sent as they land here (cut-through); it ends early when no byte more
    comes within wait_s. 404 if the object, or a byte of its first piece within wait_s, is not
    held here; 416 for a first piece outside what is held (a range running past it gets the part held);
    422 for a malformed one."""
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse

    async def pieces(request: Request) -> Response:
        run, key = request.path_params["run"], request.query_params.get("key", "")
        try:
            first = int(request.query_params.get("first", ""))
            last = int(request.query_params.get("last", first + 1))
        except ValueError:
            return JSONResponse({"detail": "first and last must be integers"}, status_code=422)
        download = holdings.find(run, key)
        began = time.monotonic()
        if download is not None:
            if not (0 <= first < len(download.done) and first < last):
                detail = f"{key} has {len(download.done)} pieces here"
                return JSONResponse({"detail": detail}, status_code=416)
            # Only a prefix of the object may be held here (`Relay.warm_up`): serve that part; the
            # asker takes the rest from its next peer or the registry.
            last = min(last, len(download.done))
        if download is None or not await download.wait_bytes(first, 0, wait_s):
            return JSONResponse({"detail": f"piece {first} of {key!r} is not held here"}, status_code=404)
        # How long the answer waited for its first byte (the asker subtracts it from its round trip).
        waited = f"wait;dur={(time.monotonic() - began) * 1000:.1f}"
        return StreamingResponse(holdings.stream(download, first, last, wait_s),
                                 media_type="application/octet-stream", headers={"Server-Timing": waited})

    return pieces


# --- fetching through peers ----------------------------------------------------------------------


@dataclass
class RelayStats:
    peer_pieces: int = 0
    registry_pieces: int = 0
    dropped: dict[str, int] = field(default_factory=dict)  # reason → peers dropped for an object
    peers: dict[str, list[str]] = field(default_factory=dict)  # the latest fetch: key → peers listed

    def drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1


async def _all(jobs: list[Any]) -> None:
    """Run jobs together; the first failure cancels the rest and is raised as itself."""
    try:
        async with asyncio.TaskGroup() as group:
            for job in jobs:
                group.create_task(job)
    except ExceptionGroup as errors:
        raise errors.exceptions[0] from None


class PeerFailed(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _runs(done: list[bool]) -> list[tuple[int, int]]:
    """The runs [first, last) of pieces not yet verified."""
    runs, i, n = [], 0, len(done)
    while i < n:
        if done[i]:
            i += 1
            continue
        last = i + 1
        while last < n and not done[last]:
            last += 1
        runs.append((i, last))
        i = last
    return runs


class _PieceReader:
    """Reads one answer of a peer's relay endpoint (HTTP/1.1, chunked or with a length) straight
    into a download's buffer: the kernel copies body bytes to where they belong, with no
    intermediate buffers and no per-read parsing in Python beyond the framing lines (an HTTP
    client library copied every 64 KiB through three buffers, the largest CPU cost of relaying
    on a small host). The `_PeerConnection` carrying the answer hands it its bytes; `reusable`
    says whether that connection may carry the next request once the answer is done."""

    def __init__(self, download: _Download, start: int, end: int, on_bytes: Any) -> None:
        self.download, self.offset, self.end, self.on_bytes = download, start, end, on_bytes
        self.small = bytearray(16 << 10)  # for the status line, headers and chunk framing
        self.pending = bytearray()
        self.state = "head"  # head → size → data → crlf → size ... → done
        self.left = 0  # bytes of the current chunk (or of a whole length-framed body) to come
        self.chunked = False
        self.keep_alive = False  # HTTP/1.1: unless the peer answers "Connection: close"
        self.status = 0
        self.reusable = False  # the answer ended cleanly and the peer keeps the connection open
        self.received = 0  # bytes of this answer so far (none: a kept connection may be stale)
        self.last = 0.0  # loop time of the last bytes
        self.sent_at = 0.0  # loop time the request went out (`Relay._request`)
        self.headers_at: float | None = None  # ... the answer's headers were read
        self.waited_s = 0.0  # the peer's wait for its first byte before answering (Server-Timing)
        loop = asyncio.get_running_loop()
        self.headers: asyncio.Future[None] = loop.create_future()
        self.finished: asyncio.Future[None] = loop.create_future()
        self.transport: asyncio.BaseTransport | None = None

    def restart(self) -> None:
        """Ready for the same request again on another connection (only before any byte came)."""
        for future in (self.headers, self.finished):
            if future.done() and not future.cancelled():
                future.exception()  # reported: the request is being retried
        loop = asyncio.get_running_loop()
        self.headers, self.finished = loop.create_future(), loop.create_future()
        self.state, self.status, self.transport, self.headers_at = "head", 0, None, None
        self.pending.clear()

    def _fail(self, reason: str) -> None:
        for future in (self.headers, self.finished):
            if not future.done():
                future.set_exception(PeerFailed(reason))
        if self.transport is not None:
            self.transport.close()

    def start(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.last = asyncio.get_running_loop().time()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.state != "done":
            self._fail("unreachable: connection lost")

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.state == "data" and not self.pending:
            return memoryview(self.download.buffer)[self.offset : self.offset + self.left]
        return memoryview(self.small)

    def buffer_updated(self, nbytes: int) -> None:
        self.last = asyncio.get_running_loop().time()
        self.received += nbytes
        if self.state == "data" and not self.pending:
            self._body(nbytes)
        else:
            self.pending += self.small[:nbytes]
        try:
            self._parse()
        except (ValueError, IndexError):
            self._fail("bad answer")

    def _body(self, n: int) -> None:
        self.offset += n
        self.left -= n
        self.on_bytes(self.offset, n)
        if self.left == 0:
            self.state = "crlf" if self.chunked else "done"
            if self.state == "done":
                self._done()

    def _done(self, reusable: bool = False) -> None:
        self.state = "done"
        self.reusable = reusable and not self.pending  # no bytes beyond the answer
        if not self.finished.done():
            self.finished.set_result(None)
        if not self.reusable and self.transport is not None:
            self.transport.close()

    def _start_data(self, size: int) -> None:
        if self.offset + size > self.end:
            self._fail("wrong length")
            return
        self.left, self.state = size, "data"
        if self.pending:  # body bytes that came in with the framing
            take = min(len(self.pending), size)
            self.download.buffer[self.offset : self.offset + take] = self.pending[:take]
            del self.pending[:take]
            self._body(take)

    def _parse(self) -> None:
        while self.pending and self.state not in ("data", "done"):
            if self.state == "trailer":  # after the last chunk: trailer lines up to an empty one
                at = self.pending.find(b"\r\n")
                if at < 0:
                    return
                empty = at == 0
                del self.pending[: at + 2]
                if empty:
                    self._done(self.keep_alive)
                    return
                continue
            if self.state == "head":
                at = self.pending.find(b"\r\n\r\n")
                if at < 0:
                    if len(self.pending) > 64 << 10:
                        self._fail("bad answer")
                    return
                lines = bytes(self.pending[:at]).decode("latin-1").split("\r\n")
                del self.pending[: at + 4]
                self.status = int(lines[0].split()[1])
                fields = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
                self.keep_alive = "close" not in fields.get("connection", "").lower()
                self.headers_at, self.waited_s = self.last, _server_wait_s(fields.get("server-timing", ""))
                self.headers.set_result(None)
                if self.status != 200:
                    self._done()  # its body is not read: the connection is not reused
                    return
                self.chunked = fields.get("transfer-encoding", "").lower() == "chunked"
                if self.chunked:
                    self.state = "size"
                else:
                    self._start_data(int(fields["content-length"]))
            elif self.state in ("size", "crlf"):
                at = self.pending.find(b"\r\n")
                if at < 0:
                    return
                line = bytes(self.pending[:at])
                del self.pending[: at + 2]
                if self.state == "crlf":
                    self.state = "size"
                    continue
                size = int(line.split(b";")[0], 16)
                if size == 0:  # the last chunk (a peer's stream may end before `last`)
                    self.state = "trailer"
                    continue
                self._start_data(size)


_WAIT = re.compile(r"(?:^|,)\s*wait;dur=([0-9]+(?:\.[0-9]+)?)")


def _server_wait_s(header: str) -> float:
    """The `wait` duration of a Server-Timing header in seconds (0 when absent: an older peer)."""
    match = _WAIT.search(header)
    return float(match[1]) / 1000 if match else 0.0


# --- socket windows -----------------------------------------------------------------------------

SOCKET_BUFFER_BYTES = 32 << 20  # a window for 1 Gbit/s at up to ~250 ms round trip


@dataclass(frozen=True)
class KernelLimits:
    """The kernel's socket buffer limits in bytes: what SO_SNDBUF / SO_RCVBUF may be set to
    (net.core.wmem_max / rmem_max) and where TCP's own autotuning stops (the last field of
    net.ipv4.tcp_wmem / tcp_rmem)."""

    wmem_max: int
    rmem_max: int
    tcp_wmem_max: int
    tcp_rmem_max: int


def _proc_int(name: str, default: int) -> int:
    try:
        with open(f"/proc/sys/{name.replace('.', '/')}") as file:
            return int(file.read().split()[-1])
    except (OSError, ValueError, IndexError):
        return default


def kernel_limits() -> KernelLimits:
    return KernelLimits(_proc_int("net.core.wmem_max", 212992), _proc_int("net.core.rmem_max", 212992),
                        _proc_int("net.ipv4.tcp_wmem", 4 << 20), _proc_int("net.ipv4.tcp_rmem", 6 << 20))


def socket_buffers(want: int, limits: KernelLimits | None = None) -> dict[int, int]:
    """SO_SNDBUF / SO_RCVBUF values for a window of `want` bytes, set only where they raise what
    autotuning reaches: a value set turns autotuning off for that socket and is cut to
    net.core.*mem_max, so with the kernel's defaults (212992) setting one would shrink the window.
    One stream carries at most window ÷ RTT, and about half an autotuned buffer is window: 4 MiB
    (tcp_wmem's default) gives ~170 Mbit/s at 100 ms. A value set is doubled by the kernel for its
    bookkeeping, so `want` is about the window itself."""
    limits = limits or kernel_limits()
    chosen: dict[int, int] = {}
    for option, core_max, auto_max in ((socket.SO_SNDBUF, limits.wmem_max, limits.tcp_wmem_max),
                                       (socket.SO_RCVBUF, limits.rmem_max, limits.tcp_rmem_max)):
        size = min(want, core_max)
        if size > auto_max:
            chosen[option] = size
    return chosen


def apply_socket_buffers(sock: socket.socket, want: int) -> dict[int, int]:
    """Set socket_buffers(want) on `sock` (before it connects or listens: the receive window's
    scale is fixed by the handshake); returns what was set."""
    chosen = socket_buffers(want)
    for option, size in chosen.items():
        sock.setsockopt(socket.SOL_SOCKET, option, size)
    return chosen


# A hop forwards bytes as they land, so its sending rate is its upstream's. BBR (Linux's tcp_bbr,
# the default on some hosts) models the path from such app-limited delivery: a hop's estimate
# stays near the rate its upstream had, and rises by at most a quarter per ~8 round trips when the
# upstream speeds up, so a chain runs at the slowest rate any hop learned (with the head fetching
# at the link's rate, BBR hops took 1.62 s a version against cubic's 1.30: docs/registry.md, "The
# head in one request"). Cubic's window is not paced and kept across idle versions
# (tcp_slow_start_after_idle=0). Set on the peer listener, whose accepted sockets (the sending
# side of every hop) inherit it; "": the host's default. Where the kernel refuses it, the
# default stays, with a warning.
PEER_CONGESTION = "cubic"


def apply_congestion(sock: socket.socket, name: str) -> bool:
    """Set TCP congestion control `name` on `sock` (TCP_CONGESTION); False where the kernel has no
    such algorithm or does not allow it to this process (net.ipv4.tcp_allowed_congestion_control)."""
    option = getattr(socket, "TCP_CONGESTION", None)
    if not name or option is None:
        return False
    try:
        sock.setsockopt(socket.IPPROTO_TCP, option, name.encode())
    except OSError as exc:
        log.warning("peer sockets keep the host's congestion control (%s refused: %s)", name, exc)
        return False
    return True


def peer_listener(host: str, port: int, buffer_bytes: int = SOCKET_BUFFER_BYTES,
                  congestion: str = PEER_CONGESTION) -> socket.socket:
    """A listening socket for a worker's relay server (`uvicorn.Server(config).serve(sockets=[it])`)
    with socket_buffers and the congestion control set: the connections it accepts inherit them."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        apply_socket_buffers(sock, buffer_bytes)
        apply_congestion(sock, congestion)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


class _PeerConnection(asyncio.BufferedProtocol):
    """One TCP connection to a peer, kept open between requests (HTTP/1.1 keep-alive) so that a
    new version's stream starts on a connection whose handshake is long done: each answer is read
    by the `_PieceReader` set as `reader` while it comes in."""

    def __init__(self) -> None:
        self.transport: asyncio.BaseTransport | None = None
        self.reader: _PieceReader | None = None
        self.closed = False
        self.requests = 0
        self._spare = bytearray(1024)

    @property
    def usable(self) -> bool:
        return not self.closed and self.transport is not None and not self.transport.is_closing()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.reader is not None:
            self.reader.connection_lost(exc)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.reader.get_buffer(sizehint) if self.reader is not None else memoryview(self._spare)

    def buffer_updated(self, nbytes: int) -> None:
        if self.reader is not None and self.reader.state != "done":
            self.reader.buffer_updated(nbytes)
        else:  # bytes while no request is out: not a connection to trust again
            self.close()

    def eof_received(self) -> bool:
        return False  # close: an answer under way ends where the peer stopped


class Relay:
    """Peer-first fetching for one worker's downloads (set `client.downloader.relay`)."""

    def __init__(
        self,
        worker_id: str,
        url: str,
        holdings: Holdings | None = None,
        *,
        piece_timeout_s: float = 10.0,
        idle_connections: int = 4,
        socket_buffer_bytes: int = SOCKET_BUFFER_BYTES,
        announce_every_s: float = ANNOUNCE_EVERY_S,
        min_rate_bytes: int = MIN_RATE_BYTES,
    ) -> None:
        if not WORKER_ID.fullmatch(worker_id):
            raise ValueError(f"bad worker id {worker_id!r}")
        self.worker_id = worker_id
        self.url = url.rstrip("/")
        self.holdings = holdings or Holdings()
        self.piece_timeout_s = piece_timeout_s
        self.idle_connections = idle_connections  # kept open per peer between requests
        self.socket_buffer_bytes = socket_buffer_bytes  # window wanted on peer connections (0: kernel's)
        self.announce_every_s = announce_every_s
        self._announced_at: float | None = None  # monotonic time of the last accepted announcement
        self._announce_failing = False  # logged once per run of failures
        self.stats = RelayStats()
        self.min_rate_bytes = min_rate_bytes
        # Per source (a peer's URL, REGISTRY_SOURCE), smoothed; sent with each announcement.
        self.paths: OrderedDict[str, PathSample] = OrderedDict()
        self.connections_opened = 0
        self._idle: dict[str, list[_PeerConnection]] = {}  # peer (scheme://host:port) → open, unused

    async def aclose(self) -> None:
        """Close the connections kept open to peers."""
        for idle in self._idle.values():
            for connection in idle:
                connection.close()
        self._idle.clear()

    def _take_idle(self, peer: str) -> _PeerConnection | None:
        idle = self._idle.get(peer, [])
        while idle:
            connection = idle.pop()
            if connection.usable:
                return connection
        return None

    def _give_back(self, peer: str, connection: _PeerConnection) -> None:
        idle = self._idle.setdefault(peer, [])
        if connection.usable and len(idle) < self.idle_connections:
            connection.reader = None
            idle.append(connection)
        else:
            connection.close()

    async def announce(self, downloader: Downloader) -> dict[str, list[str]]:
        """Tell the registry what this worker holds; returns peers to try per object."""
        transport = downloader.transport
        body = PeerAnnouncement(
            url=self.url, objects=self.holdings.keys(transport.run)[-MAX_ANNOUNCED_OBJECTS:],
            paths=dict(self.paths),
        )

        async def action() -> Any:
            response = await transport._http.put(
                transport._path(f"peers/{self.worker_id}"),
                content=body.model_dump_json(),
                headers={"Content-Type": "application/json", **transport._auth()},
            )
            transport._raise_for(response)
            return response.json()

        peers = PeerList.model_validate(await transport._retrying(action, "PUT peers")).peers
        self._announced_at = time.monotonic()
        return peers

    async def keep_place(self, downloader: Downloader) -> bool:
        """Announce again what this worker holds once its last announcement is `announce_every_s` old.

        The registry forgets a worker that has not announced for its peer_ttl_s, and one that comes
        back joins at the end of the order: with steps longer than that, every version would form
        a new pipeline (a new head fetching from the registry, new neighbours) on new connections,
        which start from TCP's initial windows. Called between downloads (the weight sync's loop),
        this keeps the worker's place. A worker that has not announced yet has no place to keep
        (it takes one with its first download: an announcement holding nothing would rank it before
        workers it cannot fetch from). Returns whether it announced; a failure is logged once and
        left to the next call."""
        if self._announced_at is None or time.monotonic() - self._announced_at < self.announce_every_s:
            return False
        try:
            await self.announce(downloader)
        except ANNOUNCE_ERRORS as exc:
            if not self._announce_failing:
                log.warning("peer announcement failed (%s); trying again at each round", exc)
            self._announce_failing = True
            return False
        self._announce_failing = False
        return True

    async def warm_up(self, downloader: Downloader, plan: Plan, nbytes: int = WARM_UP_BYTES) -> bool:
        """Before the first version, take a place in the pipeline on warm connections: fetch the
        first `nbytes` of the snapshot in `plan` (a new worker's, `client.plan(None)`: what it would
        fetch whole) through the relay as any download, and keep serving them.

        A worker that starts from weights of its own would otherwise meet the first version on new
        connections everywhere: the head's to the registry and each hop's to its predecessor start
        from TCP's initial windows, which at 100 ms RTT cost the first version seconds (docs/
        registry.md, "A warm first version"). The prefix moves along the same pipeline, so its
        connections and its order (the registry ranks workers by first announcement, and holders
        of the base version's snapshot are waited for) are those of the next patch. Costs the
        registry `nbytes` once per run start. Only a worker with no place yet warms up (one that
        fetched anything took its place then). Returns whether it did; a failure is logged and
        leaves nothing to undo."""
        snapshot = snapshot_in(plan)
        if self._announced_at is not None or nbytes <= 0 or snapshot is None or not snapshot.pieces:
            return False
        pieces = min(len(snapshot.pieces), -(-nbytes // snapshot.piece_bytes))
        prefix = snapshot.model_copy(update={"pieces": snapshot.pieces[:pieces],
                                             "size": min(snapshot.size, pieces * snapshot.piece_bytes)})
        download = _Download(prefix, mmap.mmap(-1, max(1, prefix.size)), [False] * pieces)
        began = time.monotonic()
        try:
            await self.fetch(downloader, [download])
        except (httpx.HTTPError, RegistryHTTPError, OSError, CorruptObjectError) as exc:
            log.warning("relay warm-up on %s failed (%s); the first version comes on new connections",
                        snapshot.key, exc)
            return False
        source = (self.stats.peers.get(snapshot.key) or ["the registry"])[0]
        log.info("relay warm-up: %d bytes of %s from %s in %.2fs", prefix.size, snapshot.key, source,
                 time.monotonic() - began)
        return True

    async def fetch(self, downloader: Downloader, downloads: list[_Download]) -> None:
        """Fill `downloads` (every piece verified): from peers where the registry lists some,
        from the registry for the rest and for whatever a peer fails to deliver."""
        for download in downloads:
            self.holdings.add(downloader.transport.run, download)
        try:
            peers = await self.announce(downloader)
        except ANNOUNCE_ERRORS as exc:
            log.warning("peer announcement failed (%s); fetching from the registry", exc)
            peers = {}
        self.stats.peers = {d.ref.key: list(peers.get(d.ref.key, [])) for d in downloads}
        direct = [d for d in downloads if not peers.get(d.ref.key)]
        relayed = [d for d in downloads if peers.get(d.ref.key)]
        jobs = [self._fetch_relayed(downloader, d, list(peers[d.ref.key])) for d in relayed]
        timing = PathTiming()
        if direct:  # this worker heads the pipeline for these: peers stream from it as they verify
            jobs.append(downloader.fetch_direct(direct, in_order=True, timing=timing))
        await _all(jobs)
        self._note(REGISTRY_SOURCE, timing)

    def _note(self, source: str, timing: PathTiming) -> None:
        """Fold what fetches from `source` measured into its smoothed figures, when enough bytes
        passed to give a rate."""
        rate = timing.rate_bps()
        if timing.rtt_s is None or rate is None or timing.bytes < self.min_rate_bytes:
            return
        rtt, rate = min(timing.rtt_s, MAX_RTT_S), min(rate, MAX_RATE_BPS)
        old = self.paths.pop(source, None)
        if old is not None:
            rtt = PATH_WEIGHT * rtt + (1 - PATH_WEIGHT) * old.rtt_s
            rate = PATH_WEIGHT * rate + (1 - PATH_WEIGHT) * old.rate_bps
        self.paths[source] = PathSample(rtt_s=rtt, rate_bps=rate)  # the latest measured last
        while len(self.paths) > MAX_PATHS:
            self.paths.popitem(last=False)

    async def _fetch_relayed(self, downloader: Downloader, download: _Download, peers: list[str]) -> None:
        """Everything missing from the first peer in one stream; what it fails to deliver from the
        next, then from the registry."""
        for peer in peers:
            timing = PathTiming()
            try:
                for first, last in _runs(download.done):
                    await self._stream(downloader, peer, download, first, last, timing)
                return
            except PeerFailed as exc:
                log.warning("peer %s dropped for %s (%s)", peer, download.ref.key, exc.reason)
                self.stats.drop(exc.reason)
            finally:
                self._note(peer, timing)
        missing = download.done.count(False)
        if missing:
            timing = PathTiming()
            await downloader.fetch_direct([download], in_order=True, timing=timing)
            self._note(REGISTRY_SOURCE, timing)
            self.stats.registry_pieces += missing

    async def _stream(self, downloader: Downloader, peer: str, download: _Download, first: int,
                      last: int, timing: PathTiming) -> None:
        """Pieces first..last-1 from one peer's stream, straight into the buffer, each hashed in a
        thread as soon as its last byte lands while the stream keeps receiving; `timing` gets
        the round trip and the bytes of an answer that came (200)."""
        start, end = download.piece_range(first)[0], download.piece_range(last - 1)[1]
        checks: list[asyncio.Task[bool]] = []
        lied = False
        next_piece = first
        now = asyncio.get_running_loop().time

        def on_bytes(offset: int, n: int) -> None:
            nonlocal next_piece
            timing.landed(n, now())
            downloader.transport.counters.bytes += n
            download.landed(offset - n, offset)  # this worker's own askers may take them on
            while next_piece < last and download.piece_range(next_piece)[1] <= offset:
                check = asyncio.ensure_future(downloader._verify_piece(download, next_piece, refetch=False))
                check.add_done_callback(caught_lie)
                checks.append(check)
                next_piece += 1

        def caught_lie(check: asyncio.Future[bool]) -> None:
            nonlocal lied
            if not check.cancelled() and check.exception() is None and not check.result() and not lied:
                lied = True
                reader._fail("wrong piece")  # stop taking its bytes

        reader = _PieceReader(download, start, end, on_bytes)
        failure: str | None = None
        connection: _PeerConnection | None = None
        try:
            connection = await self._request(peer, downloader.transport.run, download.ref.key, first,
                                             last, reader)
            if reader.status != 200:
                raise PeerFailed(f"answered {reader.status}")
            loop = asyncio.get_running_loop()
            while not reader.finished.done():
                # "Slow" is no byte for piece_timeout_s, not a slow whole transfer.
                idle = loop.time() - reader.last
                if idle >= self.piece_timeout_s:
                    reader._fail("slow")
                    break
                await asyncio.wait([reader.finished], timeout=self.piece_timeout_s - idle)
            await reader.finished
        except PeerFailed as exc:
            failure = exc.reason
        finally:
            if connection is not None:  # kept for the next request if the answer ended cleanly
                if reader.state == "done" and reader.reusable:
                    self._give_back(_origin(peer), connection)
                else:
                    connection.close()
            for future in (reader.headers, reader.finished):  # failures are reported once, here
                if future.done() and not future.cancelled():
                    future.exception()
        if reader.status == 200 and reader.headers_at is not None:
            timing.answered(reader.headers_at - reader.sent_at - reader.waited_s)
        verified = await asyncio.gather(*checks)
        self.stats.peer_pieces += sum(verified)
        if not all(verified):
            failure = "wrong piece"
        elif failure is None and reader.offset < end:
            failure = "stopped early"  # the peer did not have a piece within its wait
        if failure is not None:
            raise PeerFailed(failure)

    async def _request(self, peer: str, run: str, key: str, first: int, last: int,
                       reader: _PieceReader) -> _PeerConnection:
        """Ask the peer for the pieces on a kept connection (a new one if none is open) and wait
        for the answer's headers. A kept connection the peer closed meanwhile (its idle timeout)
        fails before any byte of the answer: the request then goes once more, on a new one."""
        url = urlsplit(peer)
        query = urlencode({"key": key, "first": first, "last": last})
        path = f"{url.path.rstrip('/')}/v1/relay/{quote(run, safe='')}/pieces?{query}"
        request = f"GET {path} HTTP/1.1\r\nHost: {url.netloc}\r\n\r\n".encode("latin-1")
        while True:
            connection = self._take_idle(_origin(peer))
            kept = connection is not None
            if connection is None:
                connection = await self._connect(url)
            connection.reader, connection.requests = reader, connection.requests + 1
            reader.start(cast(asyncio.BaseTransport, connection.transport))
            transport = cast(asyncio.Transport, connection.transport)  # uvloop's is not a subclass
            reader.sent_at = asyncio.get_running_loop().time()
            transport.write(request)
            try:
                async with asyncio.timeout(self.piece_timeout_s):
                    await reader.headers
                return connection
            except TimeoutError as exc:
                connection.close()
                raise PeerFailed("slow") from exc
            except PeerFailed:
                if not (kept and reader.received == 0):
                    connection.close()
                    raise
                connection.reader = None  # stale: closed by the peer while idle here
                connection.close()
                reader.restart()

    async def _connect(self, url: SplitResult) -> _PeerConnection:
        port = url.port or (443 if url.scheme == "https" else 80)
        context = ssl.create_default_context() if url.scheme == "https" else None
        loop = asyncio.get_running_loop()
        host = url.hostname or ""
        sock: socket.socket | None = None
        try:
            async with asyncio.timeout(min(2.0, self.piece_timeout_s)):
                found = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
                family, kind, proto, _, address = found[0]
                sock = socket.socket(family, kind, proto)
                sock.setblocking(False)
                apply_socket_buffers(sock, self.socket_buffer_bytes)  # before the handshake
                await loop.sock_connect(sock, address)
                _, connection = await loop.create_connection(
                    _PeerConnection, sock=sock, ssl=context, server_hostname=host if context else None)
        except (OSError, TimeoutError, IndexError) as exc:
            if sock is not None:
                sock.close()
            raise PeerFailed("unreachable: ConnectError") from exc
        self.connections_opened += 1
        return connection


def snapshot_in(plan: Plan) -> ObjectRef | None:
    """The snapshot a plan starts from (a new worker's plan: the newest snapshot), if it has one:
    what `Relay.warm_up` reads the first pieces of."""
    return next((step.object for step in plan.steps if step.kind == "snapshot"), None)


def _origin(peer: str) -> str:
    url = urlsplit(peer)
    return f"{url.scheme}://{url.netloc}"
