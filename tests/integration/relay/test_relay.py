"""Relay fan-out over real HTTP: a registry and peer workers on loopback (shared.relay)."""

from __future__ import annotations

import asyncio
import json
import logging
import mmap
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import ExitStack, asynccontextmanager, contextmanager
from pathlib import Path

import httpx
import pytest

from services.registry.app import create_app
from services.registry.settings import RegistrySettings
from shared.ports import free_port
from shared.registry.client import RegistryClient
from shared.registry.download import _Download
from shared.registry.sync import sync_weights
from shared.relay import Holdings, Relay, relay_app
from tests.conftest import serve_app
from tests.integration.registry_helpers import TOKEN, Chain, clone, make_chain, same

RUN = "relay"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def chain() -> Chain:
    return make_chain(RUN, 3)


@contextmanager
def registry(tmp_path: Path, **options: float | str) -> Iterator[str]:
    """A registry on loopback (empty: `publish` fills it)."""
    settings = RegistrySettings(store_url=f"file://{tmp_path}/store", api_token=TOKEN, piece_bytes=4096,
                                snapshot_every=0, plan_lease_s=0, **options)
    with serve_app(create_app(settings)) as base:
        yield base


async def publish(base: str, chain: Chain) -> None:
    """The chain's v0 snapshot and patches 1-3."""
    async with RegistryClient(base, RUN, token=TOKEN) as client:
        await client.publish_snapshot(0, chain.snapshot(0))
        for v in (1, 2, 3):
            await client.publish_patch(v, chain.patches[v])


@pytest.fixture
def url(tmp_path: Path, chain: Chain) -> Iterator[str]:
    with registry(tmp_path) as base:
        asyncio.run(publish(base, chain))
        yield base


@pytest.fixture
def peers() -> Iterator[ExitStack]:
    with ExitStack() as stack:
        yield stack


@asynccontextmanager
async def worker(
    url: str, name: str, stack: ExitStack, **relay_options: float
) -> AsyncIterator[RegistryClient]:
    """A client whose Relay serves its holdings on a loopback port of its own."""
    holdings = Holdings()
    peer_url = stack.enter_context(serve_app(relay_app(holdings, wait_s=0.5)))
    async with RegistryClient(url, RUN, token=TOKEN, streams=3) as client:
        client.downloader.relay = Relay(name, peer_url, holdings, **relay_options)
        try:
            yield client
        finally:
            await client.downloader.relay.aclose()


async def served(url: str) -> float:
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"{url}/metrics")).text
    return next(float(line.split()[-1]) for line in text.splitlines()
                if line.startswith("sparsecast_registry_bytes_served_total"))


async def announce(url: str, name: str, peer_url: str, objects: list[str]) -> None:
    async with httpx.AsyncClient() as http:
        response = await http.put(f"{url}/v1/runs/{RUN}/peers/{name}", headers=AUTH,
                                  json={"url": peer_url, "objects": objects})
        assert response.status_code == 200, response.text


async def test_second_worker_fetches_every_piece_from_the_first(
    url: str, chain: Chain, peers: ExitStack
) -> None:
    key = "patches/0-1.patch"
    pieces = -(-len(chain.patches[1]) // 4096)
    async with worker(url, "a", peers) as a, worker(url, "b", peers) as b:
        state_a = clone(chain.states[0])
        assert (await sync_weights(a, state_a, 0, target=1)).version == 1 and same(state_a, chain.states[1])
        assert a.downloader.relay.stats.peer_pieces == 0  # nobody held it: straight from the registry
        before = await served(url)
        state_b = clone(chain.states[0])
        await sync_weights(b, state_b, 0, target=1)
        assert same(state_b, chain.states[1])
        assert (b.downloader.relay.stats.peer_pieces, b.downloader.relay.stats.registry_pieces) == (pieces, 0)
        assert await served(url) == before  # the registry sent none of the patch's bytes again
        assert a.downloader.relay.holdings.served_pieces == pieces
        # The plan lists the holders of each object, never the asker.
        async with httpx.AsyncClient() as http:
            plan = (
                await http.get(f"{url}/v1/runs/{RUN}/plan", params={"from": 0, "to": 1, "peer": "b"})
            ).json()
        assert plan["peers"] == {key: [a.downloader.relay.url]}


async def test_the_pipelines_head_takes_each_object_in_one_ranged_request(
    url: str, chain: Chain, peers: ExitStack
) -> None:
    """In index order at the link's rate: one request per object, not one per piece on several
    streams (each stream would sit idle a round trip per piece; docs/registry.md)."""
    pieces = -(-len(chain.patches[1]) // 4096)
    assert pieces > 1  # one request per piece would be several
    async with worker(url, "a", peers) as a:
        ranges: list[str | None] = []

        async def note(request: httpx.Request) -> None:
            if "/objects/" in request.url.path:
                ranges.append(request.headers.get("Range"))

        a.downloader.transport._http.event_hooks["request"].append(note)
        state = clone(chain.states[0])
        await sync_weights(a, state, 0, target=1)
        assert same(state, chain.states[1]) and a.downloader.relay.stats.peer_pieces == 0
        assert ranges == [f"bytes=0-{len(chain.patches[1]) - 1}"]


@pytest.mark.parametrize("keeping", [True, False])
async def test_a_worker_announcing_between_versions_stays_listed_past_the_registrys_ttl(
    tmp_path: Path, chain: Chain, peers: ExitStack, keeping: bool
) -> None:
    """The registry forgets a peer after peer_ttl_s (1 s here) without an announcement; a worker
    calling keep_place between versions (due every 0.25 s) stays listed across 2.5 s and serves the
    next worker every piece, where one that does not has dropped out and the registry serves."""
    pieces = -(-len(chain.patches[1]) // 4096)
    with registry(tmp_path, peer_ttl_s=1.0) as base:
        await publish(base, chain)
        async with worker(base, "a", peers, announce_every_s=0.25) as a, worker(base, "b", peers) as b:
            relay = a.downloader.relay
            assert not await relay.keep_place(a.downloader)  # no place yet: its first download takes one
            await sync_weights(a, clone(chain.states[0]), 0, target=1)
            assert not await relay.keep_place(a.downloader)  # announced just now, with the download
            announced, began = 0, time.monotonic()
            for _ in range(25):  # at least 2.5 s: over twice the registry's TTL
                await asyncio.sleep(0.1)
                if keeping:
                    announced += await relay.keep_place(a.downloader)
            elapsed = time.monotonic() - began
            state = clone(chain.states[0])
            await sync_weights(b, state, 0, target=1)
            assert same(state, chain.states[1])
            stats = b.downloader.relay.stats
            if keeping:
                assert 5 <= announced <= elapsed / 0.25 + 1  # when due, and not more often
                assert (stats.peer_pieces, stats.registry_pieces) == (pieces, 0)
            else:
                assert stats.peer_pieces == 0 and stats.peers == {"patches/0-1.patch": []}


async def test_keeping_a_place_survives_a_registry_that_is_down(
    chain: Chain, peers: ExitStack, caplog: pytest.LogCaptureFixture
) -> None:
    """An announcement that fails is logged once and tried again at each call, never raised."""
    async with worker(f"http://127.0.0.1:{free_port()}", "a", peers, announce_every_s=0.0) as a:
        relay = a.downloader.relay
        relay._announced_at = 0.0  # as after a download
        a.downloader.transport.retries = 0
        with caplog.at_level(logging.WARNING, logger="shared.relay"):
            assert [await relay.keep_place(a.downloader) for _ in range(3)] == [False, False, False]
        assert sum("peer announcement failed" in r.getMessage() for r in caplog.records) == 1


async def test_the_measured_tree_serves_every_version_with_one_copy(
    tmp_path: Path, chain: Chain, peers: ExitStack
) -> None:
    """With PEER_TREE=measured the registry plans each new patch by the paths workers report (the
    chain until it has them): every worker still gets every version, every piece from a peer but
    the one copy the registry sends."""
    with registry(tmp_path, peer_tree="measured") as base:
        await publish(base, chain)
        async with (worker(base, "t-a", peers, min_rate_bytes=1) as a,
                    worker(base, "t-b", peers, min_rate_bytes=1) as b,
                    worker(base, "t-c", peers, min_rate_bytes=1) as c):
            states = {w: clone(chain.states[0]) for w in (a, b, c)}
            for w in (a, b, c):  # version 1 one after another: the chain, measured as it goes
                await sync_weights(w, states[w], 0, target=1)
            for v in (2, 3):
                before = await served(base)
                await asyncio.gather(*(sync_weights(w, states[w], v - 1, target=v) for w in (a, b, c)))
                assert all(same(states[w], chain.states[v]) for w in (a, b, c))
                assert await served(base) - before == len(chain.patches[v])
            assert all(w.downloader.relay.stats.dropped == {} for w in (a, b, c))
            # What the plans had to go by: the head's measure of the registry (these patches are
            # too small for a peer's stream to have a rate: they come with the answer's headers).
            assert "registry" in a.downloader.relay.paths


WARM_UP = 4 * 4096  # bytes: the first 4 pieces of the v0 snapshot


async def test_warming_up_forms_the_first_versions_pipeline_on_its_connections(
    url: str, chain: Chain, peers: ExitStack
) -> None:
    """Workers started from their own weights take their places with the first pieces of the v0
    snapshot, through the relay (the registry sends them once); the first patch then flows through
    the same pipeline, whatever order its workers ask in, on the connections the warm-up opened."""
    async with worker(url, "a", peers) as a, worker(url, "b", peers) as b, worker(url, "c", peers) as c:
        ra, rb, rc = (w.downloader.relay for w in (a, b, c))
        before = await served(url)
        for w in (a, b, c):
            assert await w.downloader.relay.warm_up(w.downloader, await w.plan(None), WARM_UP)
        assert await served(url) - before == WARM_UP
        assert (rb.stats.peer_pieces, rc.stats.peer_pieces) == (4, 4)
        assert rc.stats.peers["snapshots/0.safetensors"] == [rb.url, ra.url]  # nearest first
        opened = (rb.connections_opened, rc.connections_opened)
        assert opened == (1, 1)

        async def first_version(w: RegistryClient, delay_s: float) -> dict:
            await asyncio.sleep(delay_s)
            state = clone(chain.states[0])
            await sync_weights(w, state, 0, target=1)
            return state

        # The tail asks first: the registry waits for its predecessors (they hold v0's snapshot).
        before = await served(url)
        states = await asyncio.gather(first_version(c, 0.0), first_version(b, 0.1), first_version(a, 0.2))
        assert all(same(state, chain.states[1]) for state in states)
        key = "patches/0-1.patch"
        assert rb.stats.peers[key][0] == ra.url and rc.stats.peers[key][0] == rb.url
        assert await served(url) - before == len(chain.patches[1])  # one copy left the registry
        assert (rb.connections_opened, rc.connections_opened) == opened  # the warm-up's connections


async def test_a_new_worker_behind_warmed_up_ones_takes_their_prefix_then_the_registrys_rest(
    url: str, chain: Chain, peers: ExitStack
) -> None:
    async with worker(url, "a", peers) as a, worker(url, "d", peers) as d:
        ra = a.downloader.relay
        assert await ra.warm_up(a.downloader, await a.plan(None), WARM_UP)
        async with httpx.AsyncClient(base_url=ra.url) as http:
            path = f"/v1/relay/{RUN}/pieces"
            part = await http.get(path, params={"key": "snapshots/0.safetensors", "first": 2, "last": 99})
            assert part.status_code == 200 and len(part.content) == 2 * 4096  # what it holds of the range
            beyond = await http.get(path, params={"key": "snapshots/0.safetensors", "first": 4})
            assert beyond.status_code == 416
        state: dict = {}
        result = await sync_weights(d, state, None)  # a worker with no weights: snapshot, then chain
        assert result.version == 3 and same(state, chain.states[3])
        rd = d.downloader.relay
        assert rd.stats.peer_pieces == 4 and rd.stats.dropped == {"stopped early": 1}


async def test_warming_up_is_once_and_never_raises(
    url: str, chain: Chain, peers: ExitStack, caplog: pytest.LogCaptureFixture
) -> None:
    async with worker(url, "e", peers) as e:
        relay, plan = e.downloader.relay, await e.plan(None)
        assert not await relay.warm_up(e.downloader, plan, 0)  # off
        assert not await relay.warm_up(e.downloader, await e.plan(0, 1), WARM_UP)  # no snapshot in it
        await sync_weights(e, clone(chain.states[0]), 0, target=1)
        assert not await relay.warm_up(e.downloader, plan, WARM_UP)  # its download took a place
        assert relay.holdings.keys(RUN) == ["patches/0-1.patch"]
    async with worker(f"http://127.0.0.1:{free_port()}", "f", peers) as f:  # the registry is gone
        f.downloader.transport.retries = 0
        with caplog.at_level(logging.WARNING, logger="shared.relay"):
            assert not await f.downloader.relay.warm_up(f.downloader, plan, WARM_UP)
        assert any("relay warm-up on snapshots/0.safetensors failed" in r.getMessage()
                   for r in caplog.records)


async def test_a_garbled_peer_list_costs_the_relay_not_the_download(
    tmp_path: Path, chain: Chain, peers: ExitStack, caplog: pytest.LogCaptureFixture
) -> None:
    """A registry whose answer to an announcement is no peer list: downloads (a warm-up among them)
    come from the registry instead, as when the announcement fails outright."""
    from starlette.responses import JSONResponse

    settings = RegistrySettings(store_url=f"file://{tmp_path}/store", api_token=TOKEN, piece_bytes=4096,
                                snapshot_every=0, plan_lease_s=0)
    app = create_app(settings)

    async def garbling(scope: dict, receive: object, send: object) -> None:
        if scope["type"] == "http" and scope["method"] == "PUT" and "/peers/" in scope["path"]:
            await JSONResponse({"peers": "garbled"})(scope, receive, send)
            return
        await app(scope, receive, send)

    with serve_app(garbling) as base:
        await publish(base, chain)
        async with worker(base, "g", peers) as g:
            relay = g.downloader.relay
            with caplog.at_level(logging.WARNING, logger="shared.relay"):
                assert await relay.warm_up(g.downloader, await g.plan(None), WARM_UP)
                state = clone(chain.states[0])
                assert (await sync_weights(g, state, 0, target=1)).version == 1
            assert same(state, chain.states[1]) and relay.stats.peer_pieces == 0
            assert sum("peer announcement failed" in r.getMessage() for r in caplog.records) == 2


async def test_a_lying_peer_is_dropped_and_the_registry_serves(
    url: str, chain: Chain, peers: ExitStack
) -> None:
    """A peer whose bytes fail their sha256: every piece still verifies, from the registry."""
    async with worker(url, "honest-a", peers) as a:
        plan = await a.plan(1, 2)
    ref = plan.steps[0].object
    liar = Holdings()
    junk = _Download(ref, mmap.mmap(-1, ref.size), [True] * len(ref.pieces))
    junk.buffer[:] = b"\x5a" * ref.size
    liar.add(RUN, junk)
    liar_url = peers.enter_context(serve_app(relay_app(liar)))
    await announce(url, "liar", liar_url, [ref.key])
    async with worker(url, "c", peers) as c:
        state = clone(chain.states[1])
        result = await sync_weights(c, state, 1, target=2)
        assert result.version == 2 and not result.fell_back and same(state, chain.states[2])
        assert c.downloader.relay.stats.dropped == {"wrong piece": 1}
        assert c.downloader.relay.stats.registry_pieces == len(ref.pieces)


async def test_dead_slow_and_behind_peers_cost_a_retry(url: str, chain: Chain, peers: ExitStack) -> None:
    key = "patches/2-3.patch"

    # Dead: announced, then gone (nothing listens on its port).
    await announce(url, "dead", f"http://127.0.0.1:{free_port()}", [key])
    async with worker(url, "d", peers) as d:
        state = clone(chain.states[2])
        await sync_weights(d, state, 2, target=3)
        assert same(state, chain.states[3]) and list(d.downloader.relay.stats.dropped) == [
            "unreachable: ConnectError"
        ]

    # Behind on versions: it announced the object but holds only older ones, so it answers 404.
    async with worker(url, "behind", peers) as behind:
        await sync_weights(behind, clone(chain.states[0]), 0, target=1)  # holds 0-1 only
        await announce(url, "behind", behind.downloader.relay.url, [key])
    async with worker(url, "e", peers) as e:
        state = clone(chain.states[2])
        await sync_weights(e, state, 2, target=3)
        assert same(state, chain.states[3])
        assert "answered 404" in e.downloader.relay.stats.dropped

    # Slow: answers nothing within piece_timeout_s.
    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route

    async def stall(request: object) -> Response:
        await asyncio.sleep(3)
        return Response(b"")

    slow_url = peers.enter_context(serve_app(Starlette(routes=[Route("/v1/relay/{run}/pieces", stall)])))
    await announce(url, "slow", slow_url, ["patches/1-2.patch"])
    async with worker(url, "f", peers, piece_timeout_s=0.3) as f:
        state = clone(chain.states[1])
        await sync_weights(f, state, 1, target=2)
        assert same(state, chain.states[2]) and f.downloader.relay.stats.dropped.get("slow") == 1


async def test_announcements_need_the_token_and_valid_keys(url: str) -> None:
    async with httpx.AsyncClient(base_url=url) as http:
        body = {"url": "http://10.0.0.2:8300", "objects": ["patches/0-1.patch"]}
        assert (await http.put(f"/v1/runs/{RUN}/peers/w1", json=body)).status_code == 401
        bad = [({**body, "objects": ["../etc/passwd"]}, "w1"), ({**body, "url": "ftp://x"}, "w1"),
               (body, "bad id!")]
        sample = {"rtt_s": 0.1, "rate_bps": 1e9}
        bad += [({**body, "paths": paths}, "w1") for paths in (  # measured paths out of bounds
            {"registry": {**sample, "rtt_s": -1}}, {"registry": {**sample, "rate_bps": 1e30}},
            {"registry": {"rtt_s": 0.1}}, {"ftp://x": sample},
            {f"http://10.0.0.{i}:8300": sample for i in range(17)})]
        for payload, name in bad:
            response = await http.put(f"/v1/runs/{RUN}/peers/{name}", json=payload, headers=AUTH)
            assert response.status_code == 422, response.text
        # NaN is no JSON, but Python's parser takes it: refused as any bad figure.
        nan = ('{"url": "http://10.0.0.2:8300", "objects": [], '
               '"paths": {"registry": {"rtt_s": NaN, "rate_bps": 1}}}')
        response = await http.put(f"/v1/runs/{RUN}/peers/w1", content=nan, headers={
            **AUTH, "Content-Type": "application/json"})
        assert response.status_code == 422, response.text
        assert (await http.delete(f"/v1/runs/{RUN}/peers/w1", headers=AUTH)).status_code == 404
        good = {**body, "paths": {"registry": sample, "http://10.0.0.3:8300": sample}}
        assert (await http.put(f"/v1/runs/{RUN}/peers/w1", json=good, headers=AUTH)).status_code == 200


async def test_a_worker_reports_the_paths_it_measured_in_its_next_announcement(
    tmp_path: Path, chain: Chain, peers: ExitStack
) -> None:
    """Each source an object came from is measured: the round trip to the answer's headers, less
    the wait the peer reports (Server-Timing: here it waits 0.3 s for its own first bytes), and
    the stream's rate; the registry's too. The next announcement carries them."""
    patch = "patches/0-1.patch"
    with registry(tmp_path, peer_order_wait_s=0) as base:
        await publish(base, chain)
        async with RegistryClient(base, RUN, token=TOKEN) as reader:
            ref = (await reader.plan(0, 1)).steps[0].object
        late = Holdings()
        download = held(patch, chain.patches[1], ref.piece_bytes, verified=0)  # no byte yet
        late.add(RUN, download)
        late_url = peers.enter_context(serve_app(relay_app(late, wait_s=2.0)))
        await announce(base, "late", late_url, [patch])
        async with worker(base, "measuring", peers, min_rate_bytes=1) as c:
            relay = c.downloader.relay
            sent: list[dict] = []

            async def keep(request: httpx.Request) -> None:
                if request.method == "PUT" and "/peers/" in request.url.path:
                    sent.append(json.loads(request.content))

            c.downloader.transport._http.event_hooks["request"].append(keep)
            loop = asyncio.get_running_loop()
            for i in range(len(download.done)):  # its own download lands from 0.3 s after the ask
                loop.call_later(0.3 + 0.01 * i, download.mark_done, i)
            began = loop.time()
            state = clone(chain.states[0])
            await sync_weights(c, state, 0, target=1)
            assert same(state, chain.states[1]) and relay.stats.peer_pieces == len(ref.pieces)
            assert loop.time() - began >= 0.3
            assert sent[-1]["paths"] == {}  # nothing measured before this fetch
            assert list(relay.paths) == [late_url]
            assert 0 < relay.paths[late_url].rtt_s < 0.15  # not the 0.3 s the peer waited
            assert relay.paths[late_url].rate_bps > 0
            await sync_weights(c, state, 1, target=2)  # nobody holds 1-2: from the registry
            assert same(state, chain.states[2]) and set(relay.paths) == {late_url, "registry"}
            assert set(sent[-1]["paths"]) == {late_url}  # announced before this fetch measured it
            await relay.announce(c.downloader)  # the next announcement (keep_place's)
            assert sent[-1]["paths"] == {k: v.model_dump() for k, v in relay.paths.items()}
            assert all(v["rtt_s"] > 0 and v["rate_bps"] > 0 for v in sent[-1]["paths"].values())


def held(ref_key: str, data: bytes, piece_bytes: int, verified: int | None = None) -> _Download:
    """A download of `data` whose first `verified` pieces (all by default) are verified."""
    from shared.registry.wire import ObjectRef

    n = -(-len(data) // piece_bytes)
    ref = ObjectRef(key=ref_key, size=len(data), piece_bytes=piece_bytes, pieces=["0" * 64] * n)
    download = _Download(ref, mmap.mmap(-1, len(data)), [False] * n)
    download.buffer[:] = data
    for i in range(n if verified is None else verified):
        download.mark_done(i)
    return download


async def test_a_stream_sends_each_piece_as_it_is_verified_and_ends_at_a_missing_one(
    peers: ExitStack
) -> None:
    """Cut-through: a peer still downloading answers one stream of the pieces asked for, each as
    soon as it verifies (woken, across threads, not polled), and ends early at a piece that does
    not verify within its wait."""
    data = bytes(range(256)) * 64  # 4 pieces of 4096 bytes
    holdings = Holdings()
    download = held("patches/0-1.patch", data, 4096, verified=0)
    holdings.add(RUN, download)
    peer = peers.enter_context(serve_app(relay_app(holdings, wait_s=1.0)))
    got: list[tuple[float, int]] = []
    async with httpx.AsyncClient() as http:
        params = {"key": "patches/0-1.patch", "first": 0, "last": 4}
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        for i in range(3):  # verified one by one, 0.2 s apart (the first after the ask); piece 3 never
            loop.call_later(0.2 * (i + 1), download.mark_done, i)
        async with http.stream("GET", f"{peer}/v1/relay/{RUN}/pieces", params=params) as response:
            body = b""
            async for chunk in response.aiter_bytes():
                body += chunk
                got.append((loop.time() - t0, len(body)))
        assert response.status_code == 200
    assert body == data[: 3 * 4096]  # the missing piece ended the stream, cleanly
    # Each piece left as soon as it verified (0.2, 0.4, 0.6 s), not after the whole run.
    first_full = next(t for t, n in got if n >= 4096)
    assert 0.15 <= first_full < 0.35 and got[-1][0] >= 0.55, got
    assert holdings.served_pieces == 3
    async with httpx.AsyncClient() as http:
        url = f"{peer}/v1/relay/{RUN}/pieces"
        assert (await http.get(url, params={"key": "patches/0-1.patch", "first": 4})).status_code == 416
        # A range running past the object: what it holds of it (a holder of a prefix answers so).
        past = await http.get(url, params={"key": "patches/0-1.patch", "first": 2, "last": 9})
        assert past.status_code == 200 and past.content == data[2 * 4096 : 3 * 4096]
        assert (await http.get(url, params={"key": "patches/0-1.patch", "first": 3})).status_code == 404
        assert (await http.get(url, params={"key": "other", "first": 0})).status_code == 404


async def test_a_peer_dying_or_stalling_mid_stream_costs_only_the_rest(
    url: str, chain: Chain, peers: ExitStack
) -> None:
    """A serving peer killed mid-transfer (its stream breaks) or stuck behind (its stream ends
    early): the pieces already verified from it are kept, only the rest comes from the registry."""
    async with worker(url, "g", peers) as g:
        plan = await g.plan(0, 1)
    ref = plan.steps[0].object
    data = chain.patches[1]
    half = len(ref.pieces) // 2
    assert half >= 1

    stuck = Holdings()
    stuck.add(RUN, held(ref.key, data, ref.piece_bytes, verified=half))
    stuck_url = peers.enter_context(serve_app(relay_app(stuck, wait_s=0.3)))

    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    async def dies(request: Request) -> StreamingResponse:
        async def body():  # type: ignore[no-untyped-def]
            yield data[: half * ref.piece_bytes]
            raise ConnectionResetError("killed")  # the connection drops mid-stream

        return StreamingResponse(body())

    dying_url = peers.enter_context(serve_app(Starlette(routes=[Route("/v1/relay/{run}/pieces", dies)])))
    for name, peer_url, reason in (("stuck", stuck_url, "stopped early"),
                                   ("dying", dying_url, "unreachable: connection lost")):
        await announce(url, name, peer_url, [ref.key])
        async with worker(url, f"after-{name}", peers) as w:
            before = await served(url)
            state = clone(chain.states[0])
            await sync_weights(w, state, 0, target=1)
            assert same(state, chain.states[1])
            stats = w.downloader.relay.stats
            assert stats.dropped == {reason: 1}, stats.dropped
            assert (stats.peer_pieces, stats.registry_pieces) == (half, len(ref.pieces) - half)
            assert await served(url) - before == ref.size - half * ref.piece_bytes
        async with httpx.AsyncClient() as http:  # neither is a peer of the next round
            for gone in (name, f"after-{name}"):
                left = await http.delete(f"{url}/v1/runs/{RUN}/peers/{gone}", headers=AUTH)
                assert left.status_code == 200


class Connections:
    """An ASGI app seen through: the client address of every request (one per TCP connection)."""

    def __init__(self, app: object) -> None:
        self.app, self.clients = app, []  # type: list[tuple[str, int]]

    async def __call__(self, scope, receive, send) -> None:  # type: ignore[no-untyped-def]
        if scope["type"] == "http":
            self.clients.append(tuple(scope["client"]))
        await self.app(scope, receive, send)  # type: ignore[operator]


async def test_successive_fetches_from_a_peer_share_one_kept_connection(
    url: str, chain: Chain, peers: ExitStack
) -> None:
    """A new version's stream goes over the connection the last one used (no new handshake, no
    new slow start); one the peer closed while idle is replaced by a new one, transparently."""
    holdings = Holdings()
    seen = Connections(relay_app(holdings, wait_s=0.5))
    a_url = peers.enter_context(serve_app(seen, timeout_keep_alive=0.8))
    async with RegistryClient(url, RUN, token=TOKEN, streams=3) as a:
        a.downloader.relay = Relay("keep-a", a_url, holdings)
        state = clone(chain.states[0])
        for v in (1, 2, 3):
            await sync_weights(a, state, v - 1, target=v)
        await a.downloader.relay.aclose()
    async with worker(url, "keep-b", peers) as b:
        relay = b.downloader.relay
        state = clone(chain.states[0])
        for v in (1, 2):
            await sync_weights(b, state, v - 1, target=v)
        assert same(state, chain.states[2]) and relay.stats.dropped == {}
        assert len(seen.clients) == 2 and len(set(seen.clients)) == 1  # two objects, one connection
        assert relay.connections_opened == 1
        await asyncio.sleep(1.5)  # the peer closes the idle connection (its keep-alive timeout)
        await sync_weights(b, state, 2, target=3)
        assert same(state, chain.states[3]) and relay.stats.dropped == {}
        assert relay.stats.registry_pieces == 0 and len(set(seen.clients)) == 2
        assert relay.connections_opened == 2


async def test_a_kept_connection_the_peer_drops_at_the_next_request_is_retried_once(
    url: str, chain: Chain, peers: ExitStack
) -> None:
    """The race a kept connection has: the peer closes it just as the next request goes out (no
    byte of an answer came). The request goes once more on a new connection, not to the next peer."""
    async with worker(url, "race-a", peers) as a:
        plan = await a.plan(0, 1)
    piece = plan.steps[0].object.piece_bytes
    data = {"patches/0-1.patch": chain.patches[1], "patches/1-2.patch": chain.patches[2]}
    requests: list[int] = []  # per request: its connection's number

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        number, asked = len(set(requests)), 0
        while head := await reader.readuntil(b"\r\n\r\n"):
            asked += 1
            if asked == 2:  # the second request on a connection: dropped unanswered
                writer.close()
                return
            requests.append(number)
            query = dict(p.split("=") for p in head.split(b" ")[1].decode().split("?")[1].split("&"))
            whole = data[query["key"].replace("%2F", "/")]
            body = whole[int(query["first"]) * piece : int(query["last"]) * piece]
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
            await writer.drain()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    raw_url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    await announce(url, "raw", raw_url, list(data))
    try:
        async with worker(url, "race-b", peers) as b:
            relay = b.downloader.relay
            state = clone(chain.states[0])
            for v in (1, 2):
                await sync_weights(b, state, v - 1, target=v)
            assert same(state, chain.states[2]) and relay.stats.dropped == {}
            assert relay.stats.registry_pieces == 0 and requests == [0, 1]
            assert relay.connections_opened == 2
    finally:
        server.close()


async def test_peer_connections_get_the_wider_socket_buffers(
    url: str, chain: Chain, peers: ExitStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SO_SNDBUF / SO_RCVBUF are set on the relay's own sockets before they connect (the receive
    window's scale is agreed in the handshake), where they widen the kernel's autotuning."""
    import socket

    from shared import relay as relay_module
    from shared.relay import KernelLimits, socket_buffers

    real = relay_module.kernel_limits()
    monkeypatch.setattr(relay_module, "kernel_limits",
                        lambda: KernelLimits(real.wmem_max, real.rmem_max, 0, 0))
    async with worker(url, "wide-a", peers) as a:
        await sync_weights(a, clone(chain.states[0]), 0, target=1)
    async with worker(url, "wide-b", peers, socket_buffer_bytes=1 << 20) as b:
        await sync_weights(b, clone(chain.states[0]), 0, target=1)
        relay = b.downloader.relay
        assert relay.stats.peer_pieces > 0 and relay.connections_opened == 1
        (kept,) = [c for idle in relay._idle.values() for c in idle]
        sock = kept.transport.get_extra_info("socket")
        for option, size in socket_buffers(1 << 20).items():
            assert sock.getsockopt(socket.SOL_SOCKET, option) >= size  # the kernel reports twice it
