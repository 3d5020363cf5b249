"""The peer directory's measured tree (services/registry/peers.py, tree="measured"): where the paths
workers report say a chain is slow, a tree; where nothing is measured, the chain; never a cycle."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Sequence

import pytest

from services.registry.peers import PeerDirectory
from shared.relay import REGISTRY_SOURCE, PathSample

R = 1e9  # bits per second: the registry's rate to the head, and every worker's
RTT = 0.1
SIZE = 76_000_000  # the 1.7B shape's patch
WORKERS = "abcdefgh"


def key(v: int) -> str:
    return f"patches/{v}-{v + 1}.patch"


def measured(rtt_s: float, rate_bps: float) -> PathSample:
    return PathSample(rtt_s=rtt_s, rate_bps=rate_bps)


def url(w: str) -> str:
    return REGISTRY_SOURCE if w == REGISTRY_SOURCE else f"http://{w}"


Reports = dict[str, dict[str, PathSample]]


def chain_reports(workers: str = WORKERS, slow: dict[str, float] | None = None, rtt: float = RTT) -> Reports:
    """What each worker reports after a version fetched along the chain: its predecessor (the
    head's, the registry) at `rtt`, at R, or at what `slow` says of that predecessor, and the
    workers after a slow one only as fast as it (cut-through: a hop forwards what it receives)."""
    reports: Reports = {}
    rate = R
    for i, w in enumerate(workers):
        source = workers[i - 1] if i else REGISTRY_SOURCE
        rate = min(rate, (slow or {}).get(source, R))
        reports[w] = {url(source): measured(rtt, rate)}
    return reports


def join(peers: PeerDirectory, workers: str = WORKERS) -> None:
    """Workers take their places in this order, each at version 1 (the v0 snapshot they started
    from, and patch 0-1 fetched along the chain: that is the tree the next patch compares with)."""
    for w in workers:
        peers.announce("r", w, url(w), ["snapshots/0.safetensors", key(0)])


def report(peers: PeerDirectory, reports: Reports, held: str = key(0)) -> None:
    """Each worker announces what it holds again (as between versions), with its measurements."""
    for w, paths in reports.items():
        peers.announce("r", w, url(w), ["snapshots/0.safetensors", held], paths=paths)


def version(peers: PeerDirectory, v: int, arrival: Sequence[str] = "hcafbgde", size: int | None = SIZE,
            wait_s: float = 2.0, delays: Sequence[float] | None = None) -> dict[str, str]:
    """The workers of `arrival` announce patch v in that order, 5 ms apart (or `delays` after the
    start), each waiting as the registry does; per worker, the first listed (what it fetches
    from), REGISTRY_SOURCE for none."""
    sizes = {key(v): size} if size else None
    delays = delays or [0.005 * i for i in range(len(arrival))]

    async def ask(w: str, delay: float) -> tuple[str, list[str]]:
        await asyncio.sleep(delay)
        answer = await peers.announce_ordered("r", w, url(w), [key(v - 1), key(v)], wait_s=wait_s,
                                              sizes=sizes)
        return w, answer[key(v)]

    async def main() -> list[tuple[str, list[str]]]:
        return await asyncio.gather(*(ask(w, delay) for w, delay in zip(arrival, delays, strict=True)))

    return {w: (listed[0] if listed else REGISTRY_SOURCE) for w, listed in asyncio.run(main())}


def route(firsts: dict[str, str], worker: str) -> list[str]:
    """The workers an object passes through to reach `worker` from the registry (nearest first);
    fails on a cycle."""
    by_url = {url(w): w for w in firsts}
    path, node = [], worker
    while firsts[node] != REGISTRY_SOURCE:
        node = by_url[firsts[node]]
        assert node not in path and node != worker, f"cycle through {node}: {path}"
        path.append(node)
    return path


def is_chain(firsts: dict[str, str], workers: str = WORKERS) -> bool:
    return all(firsts[w] == url(before) for before, w in zip(workers, workers[1:], strict=False)) and (
        firsts[workers[0]] == REGISTRY_SOURCE)


def test_nothing_measured_forms_the_chain() -> None:
    peers = PeerDirectory(tree="measured")
    join(peers)
    assert is_chain(version(peers, 1))
    report(peers, chain_reports(), held=key(1))
    assert is_chain(version(peers, 2))  # equal links: the measured plan is the chain too


def test_a_slow_uplink_early_in_the_order_is_made_a_leaf() -> None:
    """b, second in the order, delivers a tenth of what it receives (its uplink): in the chain
    everyone after it gets the patch at that rate. The measured tree serves b last and routes
    nobody through it; one copy still leaves the registry."""
    reports = chain_reports(slow={"b": R / 10})
    for tree in ("chain", "measured"):
        peers = PeerDirectory(tree=tree)  # type: ignore[arg-type]
        join(peers)
        report(peers, reports)
        firsts = version(peers, 1)
        if tree == "chain":  # the same reports leave the chain as it is
            assert is_chain(firsts)
            continue
        assert url("b") not in firsts.values()
        assert all("b" not in route(firsts, w) for w in WORKERS)
        assert firsts["c"] == url("a") and firsts["b"] != REGISTRY_SOURCE
        assert Counter(firsts.values())[REGISTRY_SOURCE] == 1
        # The next version keeps that tree: its reports say the same.
        report(peers, {**chain_reports(WORKERS.replace("b", "") + "b"), "c": reports["c"]}, held=key(1))
        assert version(peers, 2, arrival="bhgfedca") == firsts


def test_a_worker_held_back_now_is_not_judged_by_an_older_faster_inflow() -> None:
    """d once received from a at the full rate (a pair kept while both live), but now fetches from c,
    behind the slow b, and forwards the tenth it receives: held back, not slow. Only b is a leaf,
    so the tree is the chain with b at its end (a chain has room for one leaf)."""
    reports = chain_reports(slow={"b": R / 10})
    reports["d"][url("a")] = measured(RTT, R)
    peers = PeerDirectory(tree="measured")
    join(peers)
    report(peers, reports)
    firsts = version(peers, 1)
    assert url("b") not in firsts.values()
    assert all("b" not in route(firsts, w) for w in WORKERS)


def test_with_more_slow_workers_than_leaves_the_slowest_is_the_leaf() -> None:
    """b serves a tenth of the target, d (behind it) a twentieth of it: with every other uplink at
    the target a chain has room for one leaf, and it goes to d; b serves one, nobody fetches
    through d."""
    reports = chain_reports(slow={"b": R / 10, "d": R / 20})
    peers = PeerDirectory(tree="measured")
    join(peers)
    report(peers, reports)
    firsts = version(peers, 1)
    children = Counter(firsts.values())
    assert url("d") not in children and children[url("b")] <= 1
    assert all("d" not in route(firsts, w) for w in WORKERS)


def test_a_head_never_measured_is_not_preferred_to_a_measured_one() -> None:
    """a heads the chain and measured the registry at a third of the rate b once saw (a new head's
    cold connection); b serves slowly, so it is a leaf. The others never fetched from the registry:
    costed at the target (b's figure), any of them would look three times faster than a and take
    its place, which on real links costs a cold start each time. a stays the head."""
    reports = chain_reports(slow={"b": R / 10})
    reports["a"][REGISTRY_SOURCE] = measured(RTT, R / 3)
    reports["b"][REGISTRY_SOURCE] = measured(RTT, R)
    peers = PeerDirectory(tree="measured")
    join(peers)
    report(peers, reports)
    firsts = version(peers, 1)
    assert firsts["a"] == REGISTRY_SOURCE and url("b") not in firsts.values()


def test_a_patch_of_unknown_size_gets_the_chain() -> None:
    peers = PeerDirectory(tree="measured")
    join(peers)
    report(peers, chain_reports(slow={"b": R / 10}))
    assert is_chain(version(peers, 1, size=None))


@pytest.mark.parametrize("measured_rate", [2 * R, 3 * R])
def test_a_fast_uplink_serves_as_many_children_as_it_carries(measured_rate: float) -> None:
    """d was once measured delivering twice (three times) the target rate (h fetched a whole
    object from it): it serves two (three) children at once, never more, every other worker one.
    On 1 ms round trips, where a new connection's slow start costs little (at 100 ms it costs
    more than a shallower tree gains: the next test)."""
    peers = PeerDirectory(tree="measured", gain=0.0)
    join(peers)
    reports = chain_reports(rtt=0.001)
    reports["h"][url("d")] = measured(0.001, measured_rate)
    report(peers, reports)
    firsts = version(peers, 1)
    children = Counter(firsts.values())
    assert children[url("d")] == measured_rate / R
    assert all(n == 1 for u, n in children.items() if u != url("d"))  # the registry's one copy too
    assert max(len(route(firsts, w)) for w in WORKERS) < len(WORKERS) - 1  # shallower than the chain


def test_equal_links_keep_the_chain_the_workers_are_on() -> None:
    """Every hop measured at R, the registry → head path at a third of it (as on the harness: a
    head's first fetches ramp up on a cold connection): every uplink is three times the target,
    so a tree of fan-out three is feasible and, costed on warm connections, 25 % sooner than the
    chain at 100 ms. But each moved worker streams on a new connection, whose slow start costs
    ~8 round trips to reach the target: costed so, the best tree is 3 % sooner than the chain, and
    the chain stays (it would take 20 %). (Measured before: the tree left the chain, and each change
    made its version 3-5× slower.)"""
    reports = chain_reports()
    reports["a"][REGISTRY_SOURCE] = measured(RTT, R / 3)
    peers = PeerDirectory(tree="measured")
    join(peers)
    for v in (1, 2, 3):
        report(peers, reports, held=key(v - 1))
        assert is_chain(version(peers, v))


def test_a_slow_uplink_goes_last_and_the_rest_keep_their_warm_pairs() -> None:
    """b serves at a tenth of R and g is a millisecond nearer than the rest. From scratch, greedy
    takes g first among equally cold pairs and breaks the chain twice more on the way to b; moving
    only b (to the end) keeps every other pair's warm connection and all hold the patch sooner."""
    reports = chain_reports(slow={"b": R / 10})
    reports["g"] = {url("f"): measured(0.099, R / 10)}
    peers = PeerDirectory(tree="measured")
    join(peers)
    report(peers, reports)
    firsts = version(peers, 1)
    assert is_chain(firsts, "acdefghb")


def test_a_slow_uplink_moved_behind_another_stays_a_leaf() -> None:
    """b and c both serve at a tenth of R, c hidden behind b (it forwards what b sends it). The
    first plan sends b last; then c, now fed at R by a, is seen slow too, and b, now fed slowly
    by the workers behind c, delivers what it receives: its old measure (a tenth while it received
    R) still says its uplink is slow. Both end up leaves, behind every fast worker (a fast one
    serving one more child rather than one slow leaf feeding the other)."""
    peers = PeerDirectory(tree="measured")
    join(peers)
    report(peers, chain_reports(slow={"b": R / 10, "c": R / 10}))
    firsts = version(peers, 1)
    assert is_chain(firsts, "acdefghb")
    # What the workers measured on that chain: c at R from a, everyone after c at a tenth, b too.
    after = chain_reports("acdefghb", slow={"c": R / 10})
    report(peers, after, held=key(1))
    firsts = version(peers, 2)
    assert all(not {"b", "c"} & set(route(firsts, w)) for w in "adefgh")
    assert url("b") not in firsts.values() and url("c") not in firsts.values()  # neither feeds anyone


def test_hysteresis_keeps_the_tree_on_a_small_change_and_moves_it_on_a_large_one() -> None:
    # The equal links of the test above: the best tree is 3 % sooner than the chain in the model.
    small = chain_reports()
    small["a"][REGISTRY_SOURCE] = measured(RTT, R / 3)
    for gain, kept in ((0.2, True), (0.0, False)):
        peers = PeerDirectory(tree="measured", gain=gain)
        join(peers)
        report(peers, small)
        firsts = version(peers, 1)
        assert is_chain(firsts) == kept  # without hysteresis, h moves for 3 %
    large = chain_reports(slow={"b": R / 10})
    report(peers, large, held=key(1))
    peers.gain = 0.2
    firsts = version(peers, 2)
    assert url("b") not in firsts.values()  # b a leaf: c and the rest no longer behind it
    assert all("b" not in route(firsts, w) for w in WORKERS)


@pytest.mark.parametrize("seed", range(30))
def test_following_first_choices_always_reaches_the_registry(seed: int) -> None:
    """Random measurements, arrival orders and delays, workers that skip a version (passed over
    after the wait): from every asker, the first choices lead to the registry without coming back
    to a worker. Each asker's record and answer are apart (the wait), as in the registry."""
    rng = random.Random(seed)
    workers = "abcdefghijkl"[: rng.randint(2, 12)]
    peers = PeerDirectory(tree=rng.choice(["chain", "measured"]), max_listed=3, gain=rng.choice([0.0, 0.2]))
    join(peers, workers)
    for v in (1, 2, 3, 4):
        reports: Reports = {}
        for w in workers:
            sources = rng.sample([x for x in workers if x != w] + [REGISTRY_SOURCE], k=min(3, len(workers)))
            reports[w] = {url(s): measured(rng.uniform(0.001, 0.3), R * rng.choice([0.05, 0.3, 1, 2, 4]))
                          for s in sources}
        report(peers, reports, held=key(v - 1))
        asking = rng.sample(workers, rng.randint(1, len(workers)))
        firsts = version(peers, v, asking, wait_s=0.03, delays=[rng.uniform(0, 0.02) for _ in asking])
        for w in asking:
            route(firsts, w)
        for w in workers:  # those that skipped catch up (a merged patch would do; here, this one)
            if w not in asking:
                peers.announce("r", w, url(w), [key(v - 1), key(v)])


def test_measurements_go_with_their_workers() -> None:
    """A worker that expires takes its measurements with it (as holder and as asker); a report
    from a source that never announced is not kept."""
    from tests.unit.services.registry.test_relay_peers import Clock

    clock = Clock()
    peers = PeerDirectory(ttl_s=10, clock=clock, tree="measured")
    join(peers, "abc")
    reports = chain_reports("abc")
    reports["a"][url("zz")] = measured(RTT, R)
    report(peers, reports)
    state = peers._runs["r"]
    assert set(state.paths) == {("", "a"), ("a", "b"), ("b", "c")}
    clock.now = 5
    report(peers, {w: {} for w in "ac"})
    clock.now = 12  # b expired
    peers.holders("r", key(0))
    assert set(state.paths) == {("", "a")}
    assert peers.leave("r", "a") and state.paths == {}
