"""The registry's self-repair and outage answers over real HTTP: a full store answers 507 (never 500)
and the trainer's client waits it out; corrupt objects are reported, listed and routed around;
slow clients are timed out. One test fills a real filesystem (a tmpfs in a user namespace)."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from services.registry.app import create_app
from services.registry.settings import RegistrySettings
from shared.ports import free_port
from shared.registry.client import RegistryClient
from shared.registry.errors import RegistryHTTPError
from shared.registry.sync import sync_weights
from shared.retry import transient
from tests.conftest import serve_app
from tests.integration.registry_helpers import ROOT, TOKEN, clone, make_chain, registry_process, same, stop
from tests.mount_namespaces import fill_until_full, needs_tmpfs_namespaces
from tests.unit.services.registry.test_registry_repair import FullableStore, flip_byte

RUN = "r1"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def settings(tmp_path: Path, **overrides) -> RegistrySettings:
    values = {"store_url": f"file://{tmp_path}", "api_token": TOKEN, "piece_bytes": 4096,
              "snapshot_every": 0, "plan_lease_s": 0}
    return RegistrySettings(**{**values, **overrides})


def put(base: str, path: str, data: bytes) -> httpx.Response:
    return httpx.put(f"{base}/v1/runs/{RUN}/{path}", content=data, headers=AUTH, timeout=30)


def test_a_full_store_answers_507_and_the_publisher_waits_it_out(tmp_path: Path) -> None:
    chain = make_chain(RUN, 3)
    store = FullableStore(f"file://{tmp_path}")
    with serve_app(create_app(settings(tmp_path), storage=store)) as base:
        assert put(base, "snapshots/0", chain.snapshot(0)).status_code == 200
        store.full = True
        for _ in range(3):
            r = put(base, "patches/1", chain.patches[1])
            assert r.status_code == 507, r.text
            assert "full" in r.json()["detail"] and r.headers["retry-after"] == "5"
        assert transient(RegistryHTTPError(507, "full"))  # the trainer's loops wait, never drop a step
        health = httpx.get(f"{base}/healthz").json()
        assert health["status"] == "degraded" and "store full" in health["reasons"][0]
        metrics = httpx.get(f"{base}/metrics").text
        assert "sparsecast_registry_store_full_refusals_total 3.0" in metrics
        assert "sparsecast_registry_store_full 1.0" in metrics

        async def publish_through_the_outage() -> int:
            async with RegistryClient(base, RUN, token=TOKEN, retries=30, backoff_s=0.05,
                                      max_backoff_s=0.2) as client:
                loop = asyncio.get_running_loop()
                loop.call_later(0.5, setattr, store, "full", False)  # space is freed meanwhile
                manifest = await client.publish_patch(1, chain.patches[1])
                assert client.counters.retries >= 1
                return manifest.version

        assert asyncio.run(publish_through_the_outage()) == 1
        assert httpx.get(f"{base}/healthz").json()["status"] == "ok"


def test_a_reported_corrupt_object_is_listed_and_routed_around(tmp_path: Path) -> None:
    chain = make_chain(RUN, 4)
    with serve_app(create_app(settings(tmp_path))) as base:
        assert put(base, "snapshots/0", chain.snapshot(0)).status_code == 200
        for v in range(1, 5):
            assert put(base, f"patches/{v}", chain.patches[v]).status_code == 200
        flip_byte(tmp_path, "patches/2-3.patch")

        async def lagging_worker() -> None:
            async with RegistryClient(base, RUN) as client:
                weights = clone(chain.states[1])
                # The chain fails its sha256 here; the worker reports it, the registry checks and
                # quarantines it, and nothing reaches v4 until the trainer uploads a snapshot.
                with pytest.raises(RegistryHTTPError) as failed:
                    await sync_weights(client, weights, 1)
                assert failed.value.status == 404
                assert same(weights, chain.states[1])  # untouched: never a bad weight
                status = await client.repair_status()
                assert status.snapshot_wanted == 4
                assert [(q.key, q.found_by) for q in status.quarantined] == [("patches/2-3.patch", "reader")]
                async with RegistryClient(base, RUN, token=TOKEN) as trainer:
                    await trainer.publish_snapshot(4, chain.snapshot(4))
                result = await sync_weights(client, weights, 1)
                assert result.version == 4 and result.path == "snapshot" and same(weights, chain.states[4])
                assert (await client.repair_status()).snapshot_wanted is None

        asyncio.run(lagging_worker())
        assert 'sparsecast_registry_corrupt_objects_total{found_by="reader"} 1.0' in httpx.get(
            f"{base}/metrics").text
        assert httpx.post(f"{base}/v1/runs/{RUN}/quarantine/patches/9-10.patch").status_code == 404
        assert httpx.post(f"{base}/v1/runs/{RUN}/quarantine/nothing/x").status_code == 422


def test_the_background_scrub_finds_corruption_nobody_read(tmp_path: Path) -> None:
    chain = make_chain(RUN, 3)
    with serve_app(create_app(settings(tmp_path, scrub_every_s=0.2, snapshot_every=2))) as base:
        assert put(base, "snapshots/0", chain.snapshot(0)).status_code == 200
        for v in range(1, 4):
            assert put(base, f"patches/{v}", chain.patches[v]).status_code == 200
        deadline = time.monotonic() + 30
        while httpx.get(f"{base}/v1/runs/{RUN}/manifests/2").json()["snapshot"] is None:
            assert time.monotonic() < deadline, "v2 was never materialized"
            time.sleep(0.05)
        flip_byte(tmp_path, "patches/2-3.patch")
        while not httpx.get(f"{base}/v1/runs/{RUN}/quarantine").json()["quarantined"]:
            assert time.monotonic() < deadline, "the scrub did not find the corrupt patch"
            time.sleep(0.1)
        status = httpx.get(f"{base}/v1/runs/{RUN}/quarantine").json()
        assert [(q["key"], q["found_by"]) for q in status["quarantined"]] == [("patches/2-3.patch", "scrub")]
        assert status["snapshot_wanted"] == 3  # snapshots 0 and 2 both need the bad patch for v3
        health = httpx.get(f"{base}/healthz").json()
        assert health["status"] == "degraded" and health["scrub"]["passes"] >= 1
        metrics = httpx.get(f"{base}/metrics").text
        assert 'sparsecast_registry_corrupt_objects_total{found_by="scrub"} 1.0' in metrics
        assert f'sparsecast_registry_snapshot_wanted{{run="{RUN}"}} 1.0' in metrics
        assert "sparsecast_registry_scrubbed_bytes_total" in metrics


def test_a_stalled_upload_is_refused_408(tmp_path: Path) -> None:
    snapshot = make_chain(RUN, 0).snapshot(0)
    with serve_app(create_app(settings(tmp_path, upload_idle_s=0.5))) as base:
        port = int(base.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            head = (f"PUT /v1/runs/{RUN}/snapshots/0 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                    f"Content-Length: {len(snapshot)}\r\n\r\n")
            sock.sendall(head.encode() + snapshot[:len(snapshot) // 2])  # then nothing more
            t0 = time.monotonic()
            answer = sock.recv(4096).decode(errors="replace")
        assert answer.startswith("HTTP/1.1 408"), answer
        assert "stalled" in answer and time.monotonic() - t0 < 5


def test_idle_keep_alive_connections_are_closed(tmp_path: Path) -> None:
    port = free_port()
    with registry_process(port, f"file://{tmp_path}", SPARSECAST_KEEP_ALIVE_S="1"):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = sock.recv(4096)
            head, _, body = answer.partition(b"\r\n\r\n")
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            while len(body) < length:
                body += sock.recv(4096)
            assert answer.startswith(b"HTTP/1.1 200")
            time.sleep(2.5)
            assert sock.recv(4096) == b""  # closed by the server


def test_a_client_keeps_its_connection_between_versions(tmp_path: Path) -> None:
    """Registry and client keep an idle connection longer than uvicorn's and httpx's 5 s defaults
    (KEEP_ALIVE_S), so the next version's transfer reuses a connection whose TCP windows already
    grew (docs/registry.md, "Relays built for latency")."""
    port = free_port()

    async def main() -> tuple[int, int]:
        client = RegistryClient(f"http://127.0.0.1:{port}", RUN)
        try:
            ports = []
            for wait in (0.0, 6.0):
                await asyncio.sleep(wait)
                answer = await client._http.get("/healthz")
                assert answer.status_code == 200
                ports.append(answer.extensions["network_stream"].get_extra_info("client_addr")[1])
            return ports[0], ports[1]
        finally:
            await client.aclose()

    with registry_process(port, f"file://{tmp_path}"):
        first, second = asyncio.run(main())
    assert first == second


@needs_tmpfs_namespaces
def test_a_really_full_filesystem_answers_507_and_recovers(tmp_path: Path) -> None:
    """The registry as its own process on a 2 MB tmpfs mounted in a private mount namespace; the
    test fills it and frees it through /proc/<pid>/root."""
    chain = make_chain(RUN, 2)
    store = tmp_path / "store"
    store.mkdir()
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPARSECAST_PORT": str(port), "OMP_NUM_THREADS": "1",
           "SPARSECAST_API_TOKEN": TOKEN, "SPARSECAST_STORE_URL": f"file://{store}",
           "SPARSECAST_SNAPSHOT_EVERY": "0"}
    proc = subprocess.Popen(["unshare", "-rm", "sh", "-c",
                             f'mount -t tmpfs -o size=2m tmpfs "{store}" && exec "{sys.executable}" '
                             "-m services.registry"], env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "registry did not start"
            try:
                if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        assert put(base, "snapshots/0", chain.snapshot(0)).status_code == 200
        ballast = Path(f"/proc/{proc.pid}/root") / str(store).lstrip("/") / "ballast"
        fill_until_full(ballast, 64 << 10)  # the tmpfs the registry sees
        for _ in range(2):
            r = put(base, "patches/1", chain.patches[1])
            assert r.status_code == 507 and "No space left on device" in r.json()["detail"], r.text
        assert httpx.get(f"{base}/healthz").json()["status"] == "degraded"
        ballast.unlink()
        assert put(base, "patches/1", chain.patches[1]).status_code == 200
        assert httpx.get(f"{base}/healthz").json()["status"] == "ok"
        assert not (store / RUN).exists()  # the tmpfs lives in the registry's namespace only
    finally:
        stop(proc)
