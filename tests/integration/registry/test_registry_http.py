"""The registry over real HTTP (uvicorn on loopback, file store) with the real client."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from services.registry.app import create_app
from services.registry.settings import RegistrySettings
from shared.patch import extract_patch, fingerprint
from shared.registry.client import RegistryClient
from shared.registry.errors import SyncError
from shared.registry.sync import sync_weights
from tests.conftest import serve_app
from tests.integration.registry_helpers import TOKEN, Chain, clone, make_chain, same, step

RUN = "r1"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def chain() -> Chain:
    return make_chain(RUN, 8)


def settings_for(tmp_path: Path, **overrides) -> RegistrySettings:
    values = {
        "store_url": f"file://{tmp_path}/store", "api_token": TOKEN, "piece_bytes": 4096,
        "snapshot_every": 0, "plan_lease_s": 0, "max_upload_bytes": 400_000,
    }
    return RegistrySettings(**{**values, **overrides})


@pytest.fixture
def url(tmp_path: Path) -> Iterator[str]:
    with serve_app(create_app(settings_for(tmp_path))) as base:
        yield base


async def publish(client: RegistryClient, chain: Chain, upto: int, snapshots: tuple[int, ...] = (0,)) -> None:
    await client.publish_snapshot(0, chain.snapshot(0))
    for v in range(1, upto + 1):
        await client.publish_patch(v, chain.patches[v], {"loss": v / 10})
        if v in snapshots:
            await client.publish_snapshot(v, chain.snapshot(v))


async def test_round_trip(url: str, chain: Chain, tmp_path: Path) -> None:
    async with RegistryClient(url, RUN, token=TOKEN, streams=4) as client:
        assert await client.latest() is None
        await publish(client, chain, 6, snapshots=(0, 4))
        await client.put_model_file("config.json", b'{"hidden_size": 128}')
        await client.put_model_file("tokenizer.json", b'{"model": {}}')

        versions = await client.versions()
        assert [m.version for m in versions] == list(range(7))
        assert versions[3].metrics == {"loss": 0.3} and versions[3].payload_ratio > 5
        assert (await client.latest()).fingerprint == fingerprint(chain.states[6])
        assert (await client.manifest(4)).snapshot is not None

        # A stateless worker: model files, then snapshot + chain into empty weights.
        files = await client.fetch_model_files(tmp_path / "model")
        assert sorted(p.name for p in files) == ["config.json", "tokenizer.json"]
        assert json.loads((tmp_path / "model" / "config.json").read_text()) == {"hidden_size": 128}
        fresh: dict = {}
        result = await sync_weights(client, fresh, None)
        assert (result.version, result.path) == (6, "snapshot") and same(fresh, chain.states[6])

        # A lagging worker gets one merged patch, applied in place; one step behind, the chain.
        state = clone(chain.states[1])
        live = state["model.norm.weight"]
        result = await sync_weights(client, state, 1)
        assert result.path == "merged" and result.bytes < sum(len(chain.patches[v]) for v in range(2, 7))
        assert same(state, chain.states[6]) and state["model.norm.weight"] is live
        state = clone(chain.states[3])
        assert (await sync_weights(client, state, 3, 4)).path == "chain" and same(state, chain.states[4])
        assert (await sync_weights(client, state, 4, 4)).path == "none"

    async with httpx.AsyncClient(base_url=url) as http:
        key = "patches/0-1.patch"
        whole = (await http.get(f"/v1/runs/{RUN}/objects/{key}")).content
        assert whole == chain.patches[1]
        part = await http.get(f"/v1/runs/{RUN}/objects/{key}", headers={"Range": "bytes=10-19"})
        assert part.status_code == 206 and part.content == whole[10:20]
        assert part.headers["content-range"] == f"bytes 10-19/{len(whole)}"
        tail = await http.get(f"/v1/runs/{RUN}/objects/{key}", headers={"Range": "bytes=-5"})
        assert tail.content == whole[-5:]
        assert (await http.get("/healthz")).status_code == 200
        assert (await http.get("/readyz")).json()["status"] == "ready"
        metrics = (await http.get("/metrics")).text
        assert 'sparsecast_registry_head_version{run="r1"} 6.0' in metrics
        assert 'sparsecast_registry_plans_total{kind="merged"}' in metrics
        assert (await http.get("/docs")).status_code == 200


async def test_bad_inputs_get_their_4xx(url: str, chain: Chain) -> None:
    async with httpx.AsyncClient(base_url=url) as http:
        base = f"/v1/runs/{RUN}"
        assert (await http.get(f"{base}/latest")).status_code == 404
        cases = [
            ("PUT", "snapshots/0", chain.snapshot(0), {}, 401),  # no token
            ("PUT", "snapshots/0", chain.snapshot(0), {"Authorization": "Bearer nope"}, 401),
            ("PUT", "model/config.json", b"{}", {}, 401),
            ("PUT", "patches/1", chain.patches[1], AUTH, 409),  # the first version is a snapshot
            ("PUT", "snapshots/0", chain.snapshot(0), AUTH, 200),
            ("PUT", "patches/2", chain.patches[2], AUTH, 409),  # not the next version
            ("PUT", "patches/1", b"garbage" * 10, AUTH, 422),  # malformed
            ("PUT", "patches/1", chain.patches[1][:-1], AUTH, 422),  # truncated
            ("PUT", "patches/1", b"", AUTH, 400),
            ("PUT", "patches/1", bytes(500_000), AUTH, 413),  # over max_upload_bytes
            ("PUT", "patches/x", chain.patches[1], AUTH, 422),
            ("PUT", "patches/1?metrics=notjson", chain.patches[1], AUTH, 422),
            ("PUT", "patches/1", chain.patches[1], {**AUTH, "X-Sparsecast-Metrics": "[1]"}, 422),
            ("PUT", "patches/1", extract_patch(step(chain.states[0], 7), chain.states[1], run=RUN,
                                               base_version=0, target_version=1), AUTH, 409),  # base fp
            ("PUT", "patches/1?metrics=%7B%22loss%22%3A1%7D", chain.patches[1], AUTH, 200),
            ("PUT", "snapshots/5", chain.snapshot(1), AUTH, 409),
            ("PUT", "model/weights.bin", b"{}", AUTH, 422),
            ("PUT", "model/config.json", b"{not json", AUTH, 422),
            ("GET", "manifests/9", None, {}, 404),
            ("GET", "plan?from=1&to=0", None, {}, 422),
            ("GET", "plan?from=0&to=9", None, {}, 404),
            ("GET", "plan?from=zero", None, {}, 422),
            ("GET", "objects/patches/9-10.patch", None, {}, 404),
            ("GET", "objects/secrets/x", None, {}, 422),
            ("GET", "objects/patches/0-1.patch", None, {"Range": "bytes=999999-"}, 416),
            ("GET", "objects/patches/0-1.patch", None, {"Range": "bytes=0-1,5-6"}, 416),
            ("GET", "model/tokenizer.json", None, {}, 404),
            ("GET", "model/..%2F..%2Fsecret", None, {}, 404),
        ]
        for method, path, body, headers, status in cases:
            response = await http.request(method, f"{base}/{path}", content=body, headers=headers)
            assert response.status_code == status, (method, path, response.status_code, response.text)
            if status >= 400:
                assert response.json()["detail"], (path, response.text)
        assert (await http.get("/v1/runs/bad%20run/versions")).status_code == 422
        assert (await http.get(f"{base}/manifests/1")).json()["metrics"] == {"loss": 1}


async def test_corrupt_object_is_detected_and_snapshot_recovers(tmp_path: Path, chain: Chain) -> None:
    with serve_app(create_app(settings_for(tmp_path))) as url:
        async with RegistryClient(url, RUN, token=TOKEN, retries=2, backoff_s=0.01) as client:
            await publish(client, chain, 3, snapshots=(0, 3))
            path = tmp_path / "store" / RUN / "patches" / "1-2.patch"
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0xFF
            path.write_bytes(bytes(data))
            state = clone(chain.states[1])
            result = await sync_weights(client, state, 1)  # merging 1→3 fails on the corrupt input: chain
            assert result.fell_back and result.path == "snapshot" and result.version == 3
            assert same(state, chain.states[3])
            # An object lost from storage on every path: the sync fails, the weights stay at 3.
            for v in (4, 5):
                await client.publish_patch(v, chain.patches[v])
            (tmp_path / "store" / RUN / "patches" / "4-5.patch").unlink()
            with pytest.raises(SyncError) as failure:
                await sync_weights(client, state, 3)
            assert failure.value.version == 3 and same(state, chain.states[3])


async def test_concurrent_publish_and_reads(url: str, chain: Chain) -> None:
    async with RegistryClient(url, RUN, token=TOKEN, streams=2) as client:
        await client.publish_snapshot(0, chain.snapshot(0))

        async def publisher() -> None:
            for v in range(1, 9):
                await client.publish_patch(v, chain.patches[v])
                await asyncio.sleep(0.01)

        async def reader(start: int) -> list[int]:
            async with RegistryClient(url, RUN, streams=2) as own:
                state = clone(chain.states[start]) if start >= 0 else {}
                version: int | None = start if start >= 0 else None
                seen = []
                while version != 8:
                    result = await sync_weights(own, state, version)
                    version = result.version
                    assert same(state, chain.states[version])
                    seen.append(version)
                return seen

        _, *seen = await asyncio.gather(publisher(), reader(0), reader(-1), reader(0))
        assert all(s[-1] == 8 for s in seen)


async def test_announcements_wake_waiters(
    tmp_path: Path, chain: Chain, redis_url: str, redis_prefix: str
) -> None:
    settings = settings_for(tmp_path, redis_url=redis_url, redis_prefix=redis_prefix)
    with serve_app(create_app(settings)) as url:
        async with (
            RegistryClient(url, RUN, token=TOKEN, redis_url=redis_url, redis_prefix=redis_prefix) as pushed,
            RegistryClient(url, RUN, token=TOKEN) as polling,
        ):
            await pushed.publish_snapshot(0, chain.snapshot(0))
            assert await polling.wait_for_version(0, timeout=0.2, poll_s=0.05) is None
            waiters = asyncio.gather(
                pushed.wait_for_version(0, timeout=30), polling.wait_for_version(0, timeout=30, poll_s=0.05)
            )
            await asyncio.sleep(0.3)  # both are waiting (one subscribed, one polling)
            await pushed.publish_patch(1, chain.patches[1])
            assert await waiters == [1, 1]
    head = redis.Redis.from_url(redis_url)
    try:
        assert head.get(f"{redis_prefix}:{RUN}:registry-head") == b"1"
    finally:
        head.close()


async def test_client_resumes_from_verified_pieces(url: str, chain: Chain, tmp_path: Path) -> None:
    async with RegistryClient(url, RUN, token=TOKEN) as client:
        await client.publish_snapshot(0, chain.snapshot(0))
    size = len(chain.snapshot(0))
    cache = tmp_path / "cache"
    # ~1.3 s at 1 Mbit/s: cancelled once a first piece is verified (not after a fixed sleep, which
    # on a slow machine came before any byte), the verified pieces stay in the cache.
    async with RegistryClient(url, RUN, streams=2, bandwidth_bps=1e6, cache_dir=cache) as slow:
        task = asyncio.create_task(sync_weights(slow, {}, None))
        deadline = asyncio.get_running_loop().time() + 30
        while slow.counters.pieces == 0 and not task.done():
            assert asyncio.get_running_loop().time() < deadline, "no piece verified in 30 s"
            await asyncio.sleep(0.01)
        assert not task.done(), "the throttled download finished before it could be cancelled"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        first = slow.counters.bytes
    assert 0 < first < size and list((cache / RUN).iterdir())
    async with RegistryClient(url, RUN, streams=2, cache_dir=cache) as again:
        state: dict = {}
        result = await sync_weights(again, state, None)
        assert again.counters.resumed_pieces > 0 and result.bytes < size
        assert same(state, chain.states[0])
    assert not list((cache / RUN).iterdir())  # finished downloads leave no part files
