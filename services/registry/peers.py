"""Which workers hold which objects (relay fan-out, shared.relay), kept in the registry's memory.

A worker announces the objects it holds or is fetching; the answer lists, per object, up to
`max_listed` other live peers. The first is the one the worker fetches from (the others are
fallbacks). Workers keep their place in one order, the order in which they first announced
(`rank`), and for a new version they form a pipeline in that order: registry → first worker →
second → ... Each worker is listed its predecessors in that order that hold the object, nearest
first, and never a worker after it (which may be fetching the object through it), so each holder
serves one peer, the registry sends one copy, no worker's uplink carries the object more than once,
and every pair of neighbours is the same from one version to the next. That last part is what
keeps the pipeline fast over long round trips: the head's connections to the registry and each
hop's connection to its predecessor are kept open between versions (keep-alive) and keep the
congestion and receive windows they grew on the previous version, where a new pairing would start
a new connection from TCP's initial window (docs/registry.md, "Relays built for latency").

The order holds although workers learn of a version at slightly different times: a worker that
announces a new single-version patch while a predecessor that is at the patch's base version has
not announced it yet waits for that predecessor (`awaited`, then `wait`), for at most the
service's `peer_order_wait_s`; a predecessor that does not come in time is passed over for that
object. Announcements expire after `ttl_s`: a worker that stops announcing (dead, gone) drops
out, and if it comes back it joins at the end. A restart forgets everything; workers then fetch
from the registry until they announce again.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

_PATCH = re.compile(r"^patches/(\d+)-(\d+)\.patch$")
_TARGET = re.compile(r"^(?:patches|merged)/\d+-(\d+)\.patch$|^snapshots/(\d+)\.safetensors$")


def _base_of_next_patch(key: str) -> int | None:
    """The base version of a single-version patch (what a worker at that version fetches next)."""
    match = _PATCH.match(key)
    if match is None or int(match[2]) != int(match[1]) + 1:
        return None
    return int(match[1])


def _version_of(key: str) -> int | None:
    """The version an object brings its holder to (a patch's or merge's target, a snapshot's)."""
    match = _TARGET.match(key)
    return None if match is None else int(match[1] or match[2])


@dataclass
class Peer:
    url: str
    objects: dict[str, float]  # key → when first announced
    seen: float
    rank: int  # place in the run's order: first announcement, earliest first


@dataclass
class _RunPeers:
    peers: dict[str, Peer] = field(default_factory=dict)
    handed: dict[tuple[str, str], int] = field(default_factory=dict)  # (key, worker) → times listed first
    passed_over: set[tuple[str, str]] = field(default_factory=set)  # (key, worker) not waited for again
    next_rank: int = 0
    changed: asyncio.Event | None = None  # set on every announcement (waiters re-check)


class PeerDirectory:
    def __init__(self, ttl_s: float = 60.0, max_listed: int = 3,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.max_listed = max_listed
        self._clock = clock
        self._runs: dict[str, _RunPeers] = {}

    def _live(self, run: str) -> _RunPeers:
        state = self._runs.setdefault(run, _RunPeers())
        now = self._clock()
        for worker, peer in list(state.peers.items()):
            if now - peer.seen > self.ttl_s:
                del state.peers[worker]
        return state

    def _candidates(self, state: _RunPeers, key: str, exclude: str | None,
                    pipeline: bool = False) -> list[str]:
        """Holders of `key` other than `exclude`. In the `pipeline` (an announcing worker's
        answer): its predecessors in the order that hold it, nearest first, and no one after it
        (they may be fetching it through this worker: listing them would make a cycle). Otherwise
        (a plan's list): every holder, least often listed first, newest on a tie."""
        asker = state.peers.get(exclude) if exclude is not None else None
        holders = [(w, p) for w, p in state.peers.items() if key in p.objects and w != exclude]
        if pipeline and asker is not None:
            holders = sorted(((w, p) for w, p in holders if p.rank < asker.rank), key=lambda wp: -wp[1].rank)
        else:
            holders.sort(key=lambda wp: (state.handed.get((key, wp[0]), 0), -wp[1].objects[key]))
        return [w for w, _ in holders[: self.max_listed]]

    def record(self, run: str, worker: str, url: str, objects: list[str]) -> list[str]:
        """Note that `worker` serves `objects` at `url` (it keeps its place in the order); returns
        the objects it had not announced before (what it is starting to fetch)."""
        state = self._live(run)
        now = self._clock()
        old = state.peers.get(worker)
        first = old.objects if old is not None else {}
        if old is None:
            rank, state.next_rank = state.next_rank, state.next_rank + 1
        else:
            rank = old.rank
        state.peers[worker] = Peer(url, {k: first.get(k, now) for k in objects}, now, rank)
        keys = {k for p in state.peers.values() for k in p.objects}
        state.handed = {kw: n for kw, n in state.handed.items() if kw[0] in keys}
        state.passed_over = {kw for kw in state.passed_over if kw[0] in keys}
        if state.changed is not None:
            state.changed.set()
            state.changed = None
        return [k for k in objects if k not in first]

    def awaited(self, run: str, worker: str, objects: list[str]) -> dict[str, list[str]]:
        """Per single-version patch among `objects` (those `worker` starts to fetch), the live
        predecessors of `worker` at the patch's base version that have not announced it yet: the
        pipeline waits for them."""
        state = self._live(run)
        me = state.peers.get(worker)
        if me is None:
            return {}
        waiting: dict[str, list[str]] = {}
        for key in objects:
            base = _base_of_next_patch(key)
            if base is None:
                continue
            late = [w for w, p in state.peers.items()
                    if p.rank < me.rank and key not in p.objects and (key, w) not in state.passed_over
                    and any(_version_of(k) == base for k in p.objects)]
            if late:
                waiting[key] = late
        return waiting

    async def wait(self, run: str, timeout_s: float) -> None:
        """Until the next announcement in `run`, or timeout_s."""
        state = self._live(run)
        if state.changed is None:
            state.changed = asyncio.Event()
        try:
            await asyncio.wait_for(state.changed.wait(), timeout_s)
        except TimeoutError:
            pass

    def pass_over(self, run: str, late: dict[str, list[str]]) -> None:
        """Stop waiting for these predecessors on these objects (they did not come in time)."""
        state = self._live(run)
        state.passed_over |= {(key, w) for key, workers in late.items() for w in workers}

    def answer(self, run: str, worker: str, objects: list[str]) -> dict[str, list[str]]:
        """The peers `worker` should try for each of `objects`, never itself; the first listed is
        counted as handed out."""
        state = self._live(run)
        result: dict[str, list[str]] = {}
        for key in objects:
            chosen = self._candidates(state, key, worker, pipeline=True)
            if chosen:  # only the first is fetched from; the others are fallbacks
                state.handed[(key, chosen[0])] = state.handed.get((key, chosen[0]), 0) + 1
            result[key] = [state.peers[w].url for w in chosen]
        return result

    def announce(self, run: str, worker: str, url: str, objects: list[str]) -> dict[str, list[str]]:
        """record, then answer, without waiting for late predecessors (`announce_ordered` waits)."""
        self.record(run, worker, url, objects)
        return self.answer(run, worker, objects)

    async def announce_ordered(self, run: str, worker: str, url: str, objects: list[str],
                               wait_s: float) -> dict[str, list[str]]:
        """record, wait up to wait_s for the predecessors expected on a patch it starts to fetch
        (each announcement wakes the wait), pass over those still missing, then answer."""
        new = self.record(run, worker, url, objects)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while late := self.awaited(run, worker, new):
            remaining = deadline - loop.time()
            if remaining <= 0:
                self.pass_over(run, late)
                break
            await self.wait(run, remaining)
        return self.answer(run, worker, objects)

    def holders(self, run: str, key: str, exclude: str | None = None) -> list[str]:
        """Peers holding `key` (a read: nothing is counted)."""
        state = self._live(run)
        return [state.peers[w].url for w in self._candidates(state, key, exclude)]

    def leave(self, run: str, worker: str) -> bool:
        return self._runs.get(run, _RunPeers()).peers.pop(worker, None) is not None
