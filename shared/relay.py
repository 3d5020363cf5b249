"""Relay fan-out: workers serve the pieces they verified to peers, and fetch from peers first.

Every worker downloading from the registry makes the registry's uplink carry the whole payload
once per worker. With a Relay on its client (`client.downloader.relay = Relay(...)`), a worker instead:

1. announces to the registry the objects it holds or is fetching (`PUT /v1/runs/{run}/peers/{id}`,
   with the token); the answer lists, per object, up to a few peers that announced it earlier,
   the least used first (so no single peer serves everyone), never the worker itself;
2. keeps each download in its `Holdings` from the start: a peer asking for a piece gets it as soon
   as its sha256 has been verified here (`GET /v1/relay/{run}/piece?key=&index=`, answered by
   `relay_app`, waiting up to `wait_s` for a piece still on its way, 404 after that);
3. fetches each piece from one of the listed peers (spread by piece index) and checks it by its
   sha256 from the registry's plan, exactly as a piece from the registry. A peer that is slow (no
   answer within `piece_timeout_s`), dies, refuses (does not hold the object: behind on versions)
   or lies (wrong bytes) is dropped for that object, and the piece comes from the registry.

Weights still change only after every byte is verified against the registry's hashes, so a peer
can cost time, never correctness. Peers serve anonymously: they hand out only what a plan from
the registry already lists, and nothing is trusted without its hash.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

import httpx
from pydantic import BaseModel, Field

from shared.registry.download import Downloader, _Download
from shared.registry.errors import RegistryHTTPError

log = logging.getLogger(__name__)

WORKER_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
MAX_ANNOUNCED_OBJECTS = 64  # a worker keeps a few versions' objects; more is not a relay


# --- wire types --------------------------------------------------------------------------------


class PeerAnnouncement(BaseModel):
    """What a worker tells the registry: where it serves, and the objects it holds or is fetching."""

    url: str = Field(max_length=256, pattern=r"^https?://[^\s/]+(/[^\s]*)?$")
    objects: list[str] = Field(max_length=MAX_ANNOUNCED_OBJECTS)


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

    async def piece(self, run: str, key: str, index: int, wait_s: float) -> bytes | None:
        """Piece `index` of an object once verified here; None if not held or not in by wait_s.
        IndexError for an index outside the object."""
        download = self._objects.get((run, key))
        if download is None:
            return None
        if not 0 <= index < len(download.done):
            raise IndexError(f"{key} has {len(download.done)} pieces")
        deadline = time.monotonic() + wait_s
        # Polled: the download may run on another event loop (a server thread) than this request.
        while not download.done[index]:
            if time.monotonic() >= deadline or (run, key) not in self._objects:
                return None
            await asyncio.sleep(0.01)
        start, end = download.piece_range(index)
        data = bytes(download.buffer[start:end])
        self.served_pieces += 1
        self.served_bytes += len(data)
        return data


RELAY_PATH = "/v1/relay/{run}/piece"


def relay_app(holdings: Holdings, wait_s: float = 5.0) -> Any:
    """The peer endpoint as a small ASGI app of its own (a rollout service adds relay_endpoint
    to its app instead)."""
    from starlette.applications import Starlette
    from starlette.routing import Route

    return Starlette(routes=[Route(RELAY_PATH, relay_endpoint(holdings, wait_s))])


def relay_endpoint(holdings: Holdings, wait_s: float = 5.0) -> Any:
    """GET RELAY_PATH?key=&index=: a verified piece (200), 404 if not held here within wait_s,
    416 for an index outside the object, 422 for a malformed index."""
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response

    async def piece(request: Request) -> Response:
        run, key = request.path_params["run"], request.query_params.get("key", "")
        try:
            index = int(request.query_params.get("index", ""))
            data = await holdings.piece(run, key, index, wait_s)
        except ValueError:
            return JSONResponse({"detail": "index must be an integer"}, status_code=422)
        except IndexError as exc:
            return JSONResponse({"detail": str(exc)}, status_code=416)
        if data is None:
            return JSONResponse({"detail": f"piece {index} of {key!r} is not held here"}, status_code=404)
        return Response(data, media_type="application/octet-stream")

    return piece


# --- fetching through peers ----------------------------------------------------------------------


@dataclass
class RelayStats:
    peer_pieces: int = 0
    registry_pieces: int = 0
    dropped: dict[str, int] = field(default_factory=dict)  # reason → peers dropped for an object

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


class Relay:
    """Peer-first fetching for one worker's downloads (set `client.downloader.relay`)."""

    def __init__(
        self,
        worker_id: str,
        url: str,
        holdings: Holdings | None = None,
        *,
        piece_timeout_s: float = 10.0,
        http: httpx.AsyncClient | None = None,
    ) -> None:
        if not WORKER_ID.fullmatch(worker_id):
            raise ValueError(f"bad worker id {worker_id!r}")
        self.worker_id = worker_id
        self.url = url.rstrip("/")
        self.holdings = holdings or Holdings()
        self.piece_timeout_s = piece_timeout_s
        self.stats = RelayStats()
        self._http = http or httpx.AsyncClient(timeout=httpx.Timeout(piece_timeout_s, connect=2.0),
                                               limits=httpx.Limits(max_connections=32))

    async def aclose(self) -> None:
        await self._http.aclose()

    async def announce(self, downloader: Downloader) -> dict[str, list[str]]:
        """Tell the registry what this worker holds; returns peers to try per object."""
        transport = downloader.transport
        body = PeerAnnouncement(url=self.url, objects=self.holdings.keys(transport.run)[-MAX_ANNOUNCED_OBJECTS:])

        async def action() -> Any:
            response = await transport._http.put(transport._path(f"peers/{self.worker_id}"),
                                                 content=body.model_dump_json(),
                                                 headers={"Content-Type": "application/json", **transport._auth()})
            transport._raise_for(response)
            return response.json()

        return PeerList.model_validate(await transport._retrying(action, "PUT peers")).peers

    async def fetch(self, downloader: Downloader, downloads: list[_Download]) -> None:
        """Fill `downloads` (every piece verified): from peers where the registry lists some,
        from the registry for the rest and for whatever a peer fails to deliver."""
        for download in downloads:
            self.holdings.add(downloader.transport.run, download)
        try:
            peers = await self.announce(downloader)
        except (httpx.HTTPError, RegistryHTTPError) as exc:
            log.warning("peer announcement failed (%s); fetching from the registry", exc)
            peers = {}
        direct = [d for d in downloads if not peers.get(d.ref.key)]
        relayed = [d for d in downloads if peers.get(d.ref.key)]
        jobs = [self._fetch_relayed(downloader, d, list(peers[d.ref.key])) for d in relayed]
        if direct:
            jobs.append(downloader.fetch_direct(direct))
        await _all(jobs)

    async def _fetch_relayed(self, downloader: Downloader, download: _Download, peers: list[str]) -> None:
        pending = deque(i for i, done in enumerate(download.done) if not done)
        good = peers

        def drop(peer: str, reason: str) -> None:
            if peer in good:  # streams in flight to it at once report it once
                log.warning("peer %s dropped for %s (%s)", peer, download.ref.key, reason)
                self.stats.drop(reason)
                good.remove(peer)

        async def stream(k: int) -> None:
            while pending:
                i = pending.popleft()
                while good:
                    peer = good[(i + k) % len(good)]
                    try:
                        await self._from_peer(downloader, peer, download, i)
                    except PeerFailed as exc:
                        drop(peer, exc.reason)
                        continue
                    if await downloader._verify_piece(download, i, refetch=False):
                        self.stats.peer_pieces += 1
                        break
                    drop(peer, "wrong piece")
                else:
                    await downloader._receive(download, i, i + 1)
                    await downloader._verify_piece(download, i)
                    self.stats.registry_pieces += 1

        await _all([stream(k) for k in range(downloader.transport.streams)])

    async def _from_peer(self, downloader: Downloader, peer: str, download: _Download, i: int) -> None:
        start, end = download.piece_range(i)
        try:
            async with asyncio.timeout(self.piece_timeout_s):
                response = await self._http.get(f"{peer}/v1/relay/{downloader.transport.run}/piece",
                                                params={"key": download.ref.key, "index": i})
        except TimeoutError as exc:
            raise PeerFailed("slow") from exc
        except httpx.HTTPError as exc:
            raise PeerFailed(f"unreachable: {type(exc).__name__}") from exc
        if response.status_code != 200:
            raise PeerFailed(f"answered {response.status_code}")
        if len(response.content) != end - start:
            raise PeerFailed("wrong length")
        download.buffer[start:end] = response.content
        downloader.transport.counters.bytes += end - start
