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

With `tree="measured"` the chain gives way to a tree where measurements say it pays. Workers
report, per source they fetched from, a smoothed round trip and stream rate (shared.relay
`PathSample`); the directory keeps them per pair of workers (holder → asker, the registry as
REGISTRY) for as long as both are live. On the first announcement of a single-version patch it
plans the patch's tree for every live worker at the patch's base (`_plan`), by a cost model:

- a node's first byte comes at its parent's + the pair's RTT / 2 + one piece ÷ the pair's rate,
  and the object flows into it at the slowest rate on its path from the registry; its finish is
  first byte + size ÷ that rate. A pair that was not holder → asker on the last version streams
  on a new connection: its first byte also waits out slow start, RTT × log2(rate × RTT ÷ TCP's
  initial window) (~1 s at 100 ms and 1 Gbit/s), so a tree moves only where it gains more;
- a pair not measured is estimated from its ends: the holder's uplink share, and the mean of the
  two ends' round trips. A holder's uplink is the most it was measured to deliver (one
  stream, or its children of the last version together). Cut-through caps a stream at what its
  holder receives, so a holder that delivered about what it received from its own last parent
  (HELD_BACK) was not seen to limit anything: its uplink counts as at least the target rate,
  unless it was once seen delivering less than it received: then that figure stands (`limits`)
  until it is measured delivering more;
- the target rate is what the registry delivers to its child, the rate the object enters the
  tree at (the most measured); a head not yet measured is costed at the least measured, so the
  head moves only for a measured gain. A holder serves at most uplink ÷ target children (`cap`),
  one if never measured (the chain), none if it delivers less than half the target (a leaf); the
  registry serves one;
- greedy earliest finish: from the registry, repeatedly attach the worker whose finish under some
  attached node with room is the smallest (ties by rank), never filling the last room while
  workers remain. If caps leave no room for everyone (with caps of one, a chain has room for one
  leaf: its end), the fastest leaves may serve one, as few as it takes, or as many of the
  fastest other workers one child more, whichever finishes sooner.

Hysteresis keeps connections warm: the tree of the last version's parents (`parent`) is costed
the same way, and the new plan replaces it only if its last finish is more than `gain` sooner. The
new plan is the sooner of the greedy tree from scratch and the greedy tree that keeps the last
tree's pairs but those of its leaves (a leaf goes last; its children choose again).
Without a registry measurement, or the patch's size, the patch gets the chain. Each asker is
listed its planned parent first, then other holders placed before it in the plan (its ancestors
first): the plan's order is one in which every holder listed comes before the asker, so no cycle.
A worker that joins after the plan is placed under the best node with room (or, with none, the
best that forwards at all). A worker waits only for its planned parent, not for every
predecessor. A version's measurements reach the plan of the version after the next at the latest
(they ride on the next announcement). Planning costs O(workers²) pair costs, once per version:
~15 ms for 64 workers, ~0.1 s for 200, on the registry's loop.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import math
import re
import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from shared.relay import REGISTRY_SOURCE, PathSample

_PATCH = re.compile(r"^patches/(\d+)-(\d+)\.patch$")
_TARGET = re.compile(r"^(?:patches|merged)/\d+-(\d+)\.patch$|^snapshots/(\d+)\.safetensors$")

log = logging.getLogger(__name__)

REGISTRY = ""  # the registry as a holder in measured pairs and plans (a worker id is never empty)
# A holder whose streams carried at least this share of what it received was held back by its own
# inflow (cut-through), not by its uplink: the measurement bounds its uplink from below only.
HELD_BACK = 0.8
# A holder measured delivering less than this share of the target rate serves nobody (a leaf);
# above it, one stream's noise (a fresh connection's ramp) must not cost a fine holder its child.
LEAF_BELOW = 0.5
# A new plan replaces the last version's tree only if everyone holds the patch this much sooner.
GAIN = 0.2
# TCP's initial window (RFC 6928: 10 segments): a pair that was not holder → asker on the last
# version streams on a new (or long idle) connection, whose window doubles each round trip from
# here until it holds the pair's rate × round trip: log2 of their ratio round trips lost.
INITIAL_WINDOW_BYTES = 10 * 1448
TreeKind = Literal["chain", "measured"]


def _base_of_next_patch(key: str) -> int | None:
    """The base version of a single-version patch (what a worker at that version fetches next)."""
    match = _PATCH.match(key)
    if match is None or int(match[2]) != int(match[1]) + 1:
        return None
    return int(match[1])


def target_version(key: str) -> int | None:
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
class _Tree:
    """A planned tree: its nodes in the order they were attached (every parent before its
    children), each node's parent, and per node its first byte, inflow rate and finish (seconds
    from the start, bits per second)."""

    order: list[str] = field(default_factory=list)
    parent: dict[str, str] = field(default_factory=dict)
    flow: dict[str, tuple[float, float]] = field(default_factory=lambda: {REGISTRY: (0.0, math.inf)})
    finish: dict[str, float] = field(default_factory=dict)
    children: dict[str, int] = field(default_factory=lambda: {REGISTRY: 0})
    index: dict[str, int] = field(default_factory=dict)

    @property
    def makespan(self) -> float:
        return max(self.finish.values(), default=0.0)

    def attach(self, worker: str, parent: str | None, first: float, rate: float, finish: float) -> None:
        self.index[worker] = len(self.order)
        self.order.append(worker)
        self.flow[worker] = (first, rate)
        self.finish[worker] = finish
        self.children[worker] = 0
        if parent is not None:
            self.parent[worker] = parent
            self.children[parent] += 1


_Option = tuple[float, int, str, float, float]  # finish, holder's rank, holder, first byte, inflow


class _Costs:
    """The cost model over one run's measured pairs (module docstring); None from `of` without a
    registry measurement or a size."""

    def __init__(self, pairs: Mapping[tuple[str, str], PathSample], parents: Mapping[str, str],
                 target: float, piece_bytes: int, size: int, limits: Mapping[str, float] | None = None,
                 ) -> None:
        self.pairs, self.target = dict(pairs), target  # as they were when planned
        self.parents = dict(parents)  # the last version's tree: its pairs' connections are warm
        # A new head's first stream is measured on a cold connection: were an unmeasured head
        # costed at the target, every version would move the head to one never measured, and each
        # move costs the next version a cold start (measured: the head changed every other version).
        self.slowest_head = min(m.rate_bps for (holder, _), m in pairs.items() if holder == REGISTRY)
        self.piece_bits, self.bits = piece_bytes * 8, size * 8
        ends: dict[str, list[float]] = {}
        self.inflow: dict[str, float] = {}
        current: dict[str, float] = {}  # what flows into a worker from its present parent
        sent: dict[str, list[tuple[str, float]]] = {}
        for (holder, asker), m in pairs.items():
            ends.setdefault(holder, []).append(m.rtt_s)
            ends.setdefault(asker, []).append(m.rtt_s)
            self.inflow[asker] = max(self.inflow.get(asker, 0.0), m.rate_bps)
            if parents.get(asker) == holder:
                current[asker] = m.rate_bps
            if holder != REGISTRY:
                sent.setdefault(holder, []).append((asker, m.rate_bps))
        # A pair is kept until either end leaves, so an older one may date from another tree (a
        # parent whose own inflow was slower then): where the present tree is measured, it decides.
        self.inflow.update(current)
        self.end_rtt = {node: statistics.fmean(rtts) for node, rtts in ends.items()}
        self.typical_rtt = statistics.median(m.rtt_s for m in pairs.values())
        self.uplink: dict[str, float] = {}
        # A holder once seen limited by its own uplink (delivering less than it received) keeps that
        # figure (`limits`: the last plan's, updated here; the directory keeps them across
        # versions) until it delivers more: moved behind another slow worker it receives slowly too,
        # and its old measure would then read as held back by its inflow (measured: two slow
        # uplinks took turns at the chain's end).
        self.limits = dict(limits or {})
        for holder, samples in sent.items():
            most = max(rate for _, rate in samples)
            uplink = max(most, sum(rate for asker, rate in samples if parents.get(asker) == holder))
            if limited := [rate for _, rate in samples if not self._held_back(holder, rate)]:
                self.limits[holder] = max(limited)
            elif most > self.limits.get(holder, 0.0):
                self.limits.pop(holder, None)  # it has since delivered more: the old limit is gone
            if holder not in self.limits:  # every sample held back, and never seen limited
                uplink = max(uplink, target)
            self.uplink[holder] = uplink

    @classmethod
    def of(cls, pairs: Mapping[tuple[str, str], PathSample], parents: Mapping[str, str], piece_bytes: int,
           size: int | None, limits: Mapping[str, float] | None = None) -> _Costs | None:
        target = max((m.rate_bps for (holder, _), m in pairs.items() if holder == REGISTRY), default=0.0)
        if target <= 0 or not size:
            return None
        return cls(pairs, parents, target, piece_bytes, size, limits)

    def _held_back(self, holder: str, rate: float) -> bool:
        return rate >= HELD_BACK * self.inflow.get(holder, math.inf)

    def cap(self, node: str) -> int:
        """Children a node may serve: its uplink ÷ the target rate, none under LEAF_BELOW of it
        (one unmeasured; the registry one)."""
        if node == REGISTRY or node not in self.uplink:
            return 1
        share = self.uplink[node] / self.target
        return max(math.floor(share + 1e-9), 1 if share >= LEAF_BELOW else 0)

    def rate(self, holder: str, asker: str) -> float:
        """What a stream holder → asker is expected to carry: its measurement where it was not held
        back, else the holder's uplink shared among the children it may serve."""
        measured = self.pairs.get((holder, asker))
        if holder == REGISTRY:  # a head not yet measured: as the slowest measured one
            return measured.rate_bps if measured is not None else self.slowest_head
        if measured is not None and not self._held_back(holder, measured.rate_bps):
            return measured.rate_bps
        return self.uplink.get(holder, self.target) / max(self.cap(holder), 1)

    def rtt(self, holder: str, asker: str) -> float:
        measured = self.pairs.get((holder, asker))
        if measured is not None:
            return measured.rtt_s
        ends = (self.end_rtt.get(holder, self.typical_rtt), self.end_rtt.get(asker, self.typical_rtt))
        return sum(ends) / 2

    def cold_start_s(self, holder: str, asker: str, rate: float, rtt: float) -> float:
        """What a new connection costs the pair before it streams at `rate`: none for the last
        version's parent (its connection kept warm between versions), else slow start's round
        trips (INITIAL_WINDOW_BYTES). Measured: each change of tree on equal links made its version
        3-5× slower (docs/registry.md, "A tree chosen by measured paths")."""
        if self.parents.get(asker) == holder:
            return 0.0
        return rtt * max(0.0, math.log2(rate * rtt / 8 / INITIAL_WINDOW_BYTES))

    def via(self, tree: _Tree, holder: str, asker: str) -> tuple[float, float, float]:
        """(finish, first byte, inflow rate) of `asker` fetching from `holder` in `tree`."""
        first, inflow = tree.flow[holder]
        rate, rtt = max(self.rate(holder, asker), 1.0), self.rtt(holder, asker)
        first += rtt / 2 + self.piece_bits / rate + self.cold_start_s(holder, asker, rate, rtt)
        inflow = min(inflow, rate)
        return first + self.bits / max(inflow, 1.0), first, inflow

    def grow_any(self, workers: list[str], rank: Mapping[str, int], fixed: Mapping[str, str]) -> _Tree | None:
        """`grow`, letting leaves serve one child, the fastest first, only as many as it takes for
        a tree to fit (with caps of one, a chain has room for a single leaf: its end); or as many
        of the fastest other workers one child more, if that finishes sooner (a slow leaf feeding
        another makes both slow)."""
        by_uplink = sorted(workers, key=lambda w: -self.uplink.get(w, self.target))
        leaves = [w for w in by_uplink if self.cap(w) == 0]
        for promoted in range(len(leaves) + 1):
            tree = self.grow(workers, rank, fixed, frozenset(leaves[:promoted]))
            if tree is not None:
                break
        if tree is None or not promoted:
            return tree
        fast = [w for w in by_uplink if self.cap(w) > 0][:promoted]
        wider = self.grow(workers, rank, fixed, frozenset(fast))
        return wider if wider is not None and wider.makespan < tree.makespan else tree

    def grow(self, workers: list[str], rank: Mapping[str, int], fixed: Mapping[str, str],
             promoted: frozenset[str] = frozenset()) -> _Tree | None:
        """Greedy earliest finish (module docstring). A worker in `fixed` is attached under that
        parent once it is in the tree, whatever its cap (the registry's stays one); a `promoted`
        worker may serve one more. None if the caps leave a worker no room."""
        def cap(node: str) -> int:
            return self.cap(node) + 1 if node in promoted else self.cap(node)

        members = set(workers)
        fixed = {w: p for w, p in fixed.items() if w in members and (p == REGISTRY or p in members)}
        heads = sorted((w for w, p in fixed.items() if p == REGISTRY), key=lambda w: rank[w])
        for w in heads[1:]:  # one copy from the registry: the others choose again
            del fixed[w]
        tree, left, room = _Tree(), set(workers), cap(REGISTRY)
        # Per worker still to attach, its options (finish, holder's rank, holder, first byte,
        # inflow) as a heap: a node's options do not change once it is attached, so each is
        # offered once, and one under a node that has filled up since is dropped when on top.
        options: dict[str, list[_Option]] = {w: [] for w in workers}

        def offer(node: str, to: Iterable[str]) -> None:
            for w in to:
                if fixed.get(w, node) == node and (w in fixed or tree.children[node] < cap(node)):
                    heapq.heappush(options[w], self._option(tree, node, w, rank))

        def soonest(w: str) -> _Option | None:
            heap = options[w]
            while heap and w not in fixed and tree.children[heap[0][2]] >= cap(heap[0][2]):
                heapq.heappop(heap)
            return heap[0] if heap else None

        offer(REGISTRY, left)
        while left:
            ready = sorted(((w, o) for w in left if (o := soonest(w)) is not None),
                           key=lambda wo: (wo[1][0], rank[wo[0]]))
            if not ready:
                if any(w in fixed for w in left):  # a loop among the last version's parents
                    fixed = {w: p for w, p in fixed.items() if w not in left}
                    for node in tree.flow:
                        offer(node, left)
                    continue
                return None
            # The soonest that leaves room for the workers still to come (a leaf waits till last).
            w, (finish, _, parent, first, inflow) = next(
                (wo for wo in ready if len(left) == 1
                 or room - (tree.children[wo[1][2]] < cap(wo[1][2])) + cap(wo[0]) > 0), ready[0])
            room += cap(w) - (tree.children[parent] < cap(parent))
            tree.attach(w, parent, first, inflow, finish)
            left.discard(w)
            offer(w, left)
        return tree

    def _option(self, tree: _Tree, holder: str, asker: str, rank: Mapping[str, int]) -> _Option:
        finish, first, inflow = self.via(tree, holder, asker)
        return finish, rank.get(holder, -1), holder, first, inflow


@dataclass
class _Plan:
    tree: _Tree
    costs: _Costs

    def place(self, worker: str) -> None:
        """A worker not planned for (it joined later): under the node with room where it would
        finish soonest; if none has room, under the soonest worker that forwards at all (one child
        more there beats a leaf's slow uplink or a second copy from the registry)."""
        tree, cap = self.tree, self.costs.cap
        nodes = ([n for n in tree.flow if tree.children[n] < cap(n)]
                 or [n for n in tree.flow if n != REGISTRY and cap(n) > 0])
        if not nodes:
            tree.attach(worker, None, math.inf, 0.0, math.inf)
            return
        finish, first, inflow, parent = min((*self.costs.via(tree, n, worker), n) for n in nodes)
        tree.attach(worker, parent, first, inflow, finish)


@dataclass
class _RunPeers:
    peers: dict[str, Peer] = field(default_factory=dict)
    handed: dict[tuple[str, str], int] = field(default_factory=dict)  # (key, worker) → times listed first
    passed_over: set[tuple[str, str]] = field(default_factory=set)  # (key, worker) not waited for again
    next_rank: int = 0
    changed: asyncio.Event | None = None  # set on every announcement (waiters re-check)
    # Measured paths, (holder, asker) → as the asker last reported them (the registry: REGISTRY).
    paths: dict[tuple[str, str], PathSample] = field(default_factory=dict)
    parent: dict[str, str] = field(default_factory=dict)  # worker → first listed on its newest patch
    limits: dict[str, float] = field(default_factory=dict)  # worker → uplink it was seen limited at
    plans: dict[str, _Plan | None] = field(default_factory=dict)  # patch → its tree (None: the chain)

    def forget_departed(self) -> None:
        """Drop the measurements and parents of workers no longer live."""
        live = self.peers
        self.paths = {pair: m for pair, m in self.paths.items()
                      if (pair[0] == REGISTRY or pair[0] in live) and pair[1] in live}
        self.parent = {w: p for w, p in self.parent.items() if w in live}
        self.limits = {w: rate for w, rate in self.limits.items() if w in live}


class PeerDirectory:
    def __init__(self, ttl_s: float = 60.0, max_listed: int = 3,
                 clock: Callable[[], float] = time.monotonic, *, tree: TreeKind = "chain",
                 piece_bytes: int = 4 << 20, gain: float = GAIN) -> None:
        self.ttl_s = ttl_s
        self.max_listed = max_listed
        self._clock = clock
        self.tree = tree
        self.piece_bytes = piece_bytes  # the registry's piece: a hop's store-and-forward unit
        self.gain = gain
        self._runs: dict[str, _RunPeers] = {}

    def _live(self, run: str) -> _RunPeers:
        state = self._runs.setdefault(run, _RunPeers())
        now = self._clock()
        expired = [w for w, peer in state.peers.items() if now - peer.seen > self.ttl_s]
        for worker in expired:
            del state.peers[worker]
        if expired:
            state.forget_departed()
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

    def record(self, run: str, worker: str, url: str, objects: list[str],
               paths: Mapping[str, PathSample] | None = None, sizes: Mapping[str, int] | None = None,
               ) -> list[str]:
        """Note that `worker` serves `objects` at `url` (it keeps its place in the order), and what
        it measured of its sources (`paths`: by a peer's URL, or REGISTRY_SOURCE); returns the
        objects it had not announced before (what it is starting to fetch). With the measured
        tree, the first announcement of a single-version patch plans its tree (`sizes`: bytes per
        key; a patch of unknown size gets the chain)."""
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
        state.plans = {k: plan for k, plan in state.plans.items() if k in keys}
        by_url = {p.url: w for w, p in state.peers.items() if w != worker}
        for source, figures in (paths or {}).items():
            holder = REGISTRY if source == REGISTRY_SOURCE else by_url.get(source)
            if holder is not None:  # a source that is gone, or never announced, tells nothing
                state.paths[(holder, worker)] = figures
        new = [k for k in objects if k not in first]
        if self.tree == "measured":
            for key in new:
                if _base_of_next_patch(key) is None:
                    continue
                if key not in state.plans:
                    state.plans[key] = self._plan(state, key, (sizes or {}).get(key))
                elif (plan := state.plans[key]) is not None and worker not in plan.tree.index:
                    plan.place(worker)
                    log.info("peer tree for %s: %s joined late, under %s", key, worker,
                             plan.tree.parent.get(worker) or "no one")
        if state.changed is not None:
            state.changed.set()
            state.changed = None
        return new

    def _plan(self, state: _RunPeers, key: str, size: int | None) -> _Plan | None:
        """The tree for a new single-version patch over every live worker at its base (module
        docstring), or None (the chain) without the figures for one."""
        costs = _Costs.of(state.paths, state.parent, self.piece_bytes, size, state.limits)
        if costs is None:
            return None
        state.limits = costs.limits
        base = _base_of_next_patch(key)
        rank = {w: p.rank for w, p in state.peers.items()}
        workers = [w for w, p in state.peers.items()
                   if key in p.objects or any(target_version(k) == base for k in p.objects)]
        kept = costs.grow_any(workers, rank, state.parent)
        # Greedy from scratch breaks ties between equally cold pairs by a millisecond of round trip
        # and may break up warm runs of the last tree; the last tree less its leaves (they go last)
        # and their children's places keeps every other warm pair (measured: two slow uplinks kept
        # the chain because the scratch tree paid three slow starts on the way to its last worker).
        repaired = {w: p for w, p in state.parent.items()
                    if costs.cap(w) > 0 and (p == REGISTRY or costs.cap(p) > 0)}
        grown = [t for t in (costs.grow_any(workers, rank, {}), costs.grow_any(workers, rank, repaired))
                 if t is not None]
        best = min(grown, key=lambda t: t.makespan, default=None)
        if best is None or (kept is not None and best.makespan >= (1 - self.gain) * kept.makespan):
            best = kept
        if best is None:
            return None
        log.info("peer tree for %s over %d workers (%s, %.2fs planned; target %.0f Mbit/s): %s", key,
                 len(workers), "kept" if best is kept else "new", best.makespan, costs.target / 1e6,
                 ", ".join(f"{best.parent.get(w) or 'registry'}→{w}" for w in best.order))
        return _Plan(best, costs)

    def awaited(self, run: str, worker: str, objects: list[str]) -> dict[str, list[str]]:
        """Per single-version patch among `objects` (those `worker` starts to fetch), the live
        predecessors of `worker` at the patch's base version that have not announced it yet (with
        a planned tree, its planned parent only): the pipeline waits for them."""
        state = self._live(run)
        me = state.peers.get(worker)
        if me is None:
            return {}
        waiting: dict[str, list[str]] = {}
        for key in objects:
            base = _base_of_next_patch(key)
            if base is None:
                continue
            plan = state.plans.get(key)
            if plan is not None:  # a tree: only the planned parent (a worker that waits for its own)
                parent = plan.tree.parent.get(worker)
                before = [] if parent is None or parent not in state.peers else [parent]
            else:
                before = [w for w, p in state.peers.items() if p.rank < me.rank]
            late = [w for w in before
                    if key not in state.peers[w].objects and (key, w) not in state.passed_over
                    and any(target_version(k) == base for k in state.peers[w].objects)]
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

    def _planned(self, state: _RunPeers, plan: _Plan, key: str, worker: str) -> list[str]:
        """Holders of `key` placed before `worker` in its plan: its planned parent first, then its
        other ancestors, nearest first, then the rest, latest placed first."""
        tree = plan.tree
        ancestors: list[str] = []
        node = tree.parent.get(worker)
        while node is not None and node != REGISTRY:
            ancestors.append(node)
            node = tree.parent.get(node)
        depth = {w: i for i, w in enumerate(ancestors)}
        position = tree.index.get(worker, len(tree.order))
        before = [w for w in tree.order[:position] if w in state.peers and key in state.peers[w].objects]
        before.sort(key=lambda w: (0, depth[w]) if w in depth else (1, -tree.index[w]))
        return before[: self.max_listed]

    def answer(self, run: str, worker: str, objects: list[str]) -> dict[str, list[str]]:
        """The peers `worker` should try for each of `objects`, never itself; the first listed is
        counted as handed out, and on its newest single-version patch kept as its parent."""
        state = self._live(run)
        result: dict[str, list[str]] = {}
        bases = {k: b for k in objects if (b := _base_of_next_patch(k)) is not None}
        newest = max(bases, key=bases.__getitem__, default=None)
        for key in objects:
            plan = state.plans.get(key)
            chosen = (self._planned(state, plan, key, worker) if plan is not None
                      else self._candidates(state, key, worker, pipeline=True))
            if chosen:  # only the first is fetched from; the others are fallbacks
                state.handed[(key, chosen[0])] = state.handed.get((key, chosen[0]), 0) + 1
            if key == newest:
                state.parent[worker] = chosen[0] if chosen else REGISTRY
            result[key] = [state.peers[w].url for w in chosen]
        return result

    def announce(self, run: str, worker: str, url: str, objects: list[str],
                 paths: Mapping[str, PathSample] | None = None,
                 sizes: Mapping[str, int] | None = None) -> dict[str, list[str]]:
        """record, then answer, without waiting for late predecessors (`announce_ordered` waits)."""
        self.record(run, worker, url, objects, paths, sizes)
        return self.answer(run, worker, objects)

    async def announce_ordered(self, run: str, worker: str, url: str, objects: list[str],
                               wait_s: float, paths: Mapping[str, PathSample] | None = None,
                               sizes: Mapping[str, int] | None = None) -> dict[str, list[str]]:
        """record, wait up to wait_s for the predecessors expected on a patch it starts to fetch
        (each announcement wakes the wait), pass over those still missing, then answer."""
        new = self.record(run, worker, url, objects, paths, sizes)
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
        state = self._runs.get(run, _RunPeers())
        if state.peers.pop(worker, None) is None:
            return False
        state.forget_departed()
        return True
