"""Which workers hold which objects (relay fan-out, shared.relay), kept in the registry's memory.

A worker announces the objects it holds or is fetching; the answer lists, per object, up to
`max_listed` other live peers. The first is the one the worker fetches from (the others are
fallbacks): the holder handed out first least often for that object, the newest to announce it
on a tie. Workers that ask together for a new version so form a pipeline (registry → first asker
→ second → ...): each holder serves one peer, so the registry sends one copy and no worker's
uplink carries the object more than once, while each forwards pieces as they verify. Fallbacks
are the next holders in the same order. Announcements expire after `ttl_s`: a worker that stops
announcing (dead, gone) drops out. A restart forgets everything; workers then fetch from the
registry until they announce again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Peer:
    url: str
    objects: dict[str, float]  # key → when first announced
    seen: float


@dataclass
class _RunPeers:
    peers: dict[str, Peer] = field(default_factory=dict)
    handed: dict[tuple[str, str], int] = field(default_factory=dict)  # (key, worker) → times listed first


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

    def _candidates(self, state: _RunPeers, key: str, exclude: str | None) -> list[str]:
        holders = [(w, p) for w, p in state.peers.items() if key in p.objects and w != exclude]
        holders.sort(key=lambda wp: (state.handed.get((key, wp[0]), 0), -wp[1].objects[key]))
        return [w for w, _ in holders[: self.max_listed]]

    def announce(self, run: str, worker: str, url: str, objects: list[str]) -> dict[str, list[str]]:
        """Record what `worker` holds; answer the peers it should try for each of those objects
        (listed before it is recorded, so a worker never gets itself)."""
        state = self._live(run)
        answer: dict[str, list[str]] = {}
        for key in objects:
            chosen = self._candidates(state, key, worker)
            if chosen:  # only the first is fetched from; the others are fallbacks
                state.handed[(key, chosen[0])] = state.handed.get((key, chosen[0]), 0) + 1
            answer[key] = [state.peers[w].url for w in chosen]
        now = self._clock()
        old = state.peers.get(worker)
        first = old.objects if old is not None else {}
        state.peers[worker] = Peer(url, {k: first.get(k, now) for k in objects}, now)
        keys = {k for p in state.peers.values() for k in p.objects}
        state.handed = {kw: n for kw, n in state.handed.items() if kw[0] in keys}
        return answer

    def holders(self, run: str, key: str, exclude: str | None = None) -> list[str]:
        """Peers holding `key` (a read: nothing is counted)."""
        state = self._live(run)
        return [state.peers[w].url for w in self._candidates(state, key, exclude)]

    def leave(self, run: str, worker: str) -> bool:
        return self._runs.get(run, _RunPeers()).peers.pop(worker, None) is not None
