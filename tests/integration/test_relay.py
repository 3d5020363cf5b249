"""Relay fan-out over real HTTP: a registry and peer workers on loopback (shared.relay)."""

from __future__ import annotations

import asyncio
import mmap
from collections.abc import AsyncIterator, Iterator
from contextlib import ExitStack, asynccontextmanager
from pathlib import Path

import httpx
import pytest

from services.registry.app import create_app
from services.registry.settings import RegistrySettings
from shared.registry.client import RegistryClient
from shared.registry.download import _Download
from shared.registry.sync import sync_weights
from shared.relay import Holdings, Relay, relay_app
from tests.conftest import free_port, serve_app
from tests.integration.registry_helpers import TOKEN, Chain, clone, make_chain, same

RUN = "relay"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def chain() -> Chain:
    return make_chain(RUN, 3)


@pytest.fixture
def url(tmp_path: Path, chain: Chain) -> Iterator[str]:
    settings = RegistrySettings(store_url=f"file://{tmp_path}/store", api_token=TOKEN, piece_bytes=4096,
                                snapshot_every=0, plan_lease_s=0)
    with serve_app(create_app(settings)) as base:

        async def publish() -> None:
            async with RegistryClient(base, RUN, token=TOKEN) as client:
                await client.publish_snapshot(0, chain.snapshot(0))
                for v in (1, 2, 3):
                    await client.publish_patch(v, chain.patches[v])

        asyncio.run(publish())
        yield base


@pytest.fixture
def peers() -> Iterator[ExitStack]:
    with ExitStack() as stack:
        yield stack


@asynccontextmanager
async def worker(url: str, name: str, stack: ExitStack, **relay_options: float) -> AsyncIterator[RegistryClient]:
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


async def test_second_worker_fetches_every_piece_from_the_first(url: str, chain: Chain, peers: ExitStack) -> None:
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
            plan = (await http.get(f"{url}/v1/runs/{RUN}/plan", params={"from": 0, "to": 1, "peer": "b"})).json()
        assert plan["peers"] == {key: [a.downloader.relay.url]}


async def test_a_lying_peer_is_dropped_and_the_registry_serves(url: str, chain: Chain, peers: ExitStack) -> None:
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
        assert same(state, chain.states[3]) and list(d.downloader.relay.stats.dropped) == ["unreachable: ConnectError"]

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

    slow_url = peers.enter_context(serve_app(Starlette(routes=[Route("/v1/relay/{run}/piece", stall)])))
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
        for payload, name in bad:
            response = await http.put(f"/v1/runs/{RUN}/peers/{name}", json=payload, headers=AUTH)
            assert response.status_code == 422, response.text
        assert (await http.delete(f"/v1/runs/{RUN}/peers/w1", headers=AUTH)).status_code == 404
