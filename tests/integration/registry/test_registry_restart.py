"""Kill the registry process in the middle of a client download and start it again: the client
resumes where its streams stopped and ends bit-exact."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from shared.ports import free_port
from shared.registry.client import RegistryClient
from shared.registry.sync import sync_weights
from tests.integration.registry_helpers import TOKEN, make_chain, same, start_registry, stop

RUN = "restart"


@pytest.mark.chaos
async def test_download_survives_a_registry_restart(tmp_path: Path) -> None:
    chain = make_chain(RUN, 2, seed=5)
    port = free_port()
    store = f"file://{tmp_path}/store"
    env = {"SPARSECAST_PIECE_BYTES": "16384", "SPARSECAST_SNAPSHOT_EVERY": "0"}
    proc = await asyncio.to_thread(start_registry, port, store, **env)
    try:
        url = f"http://127.0.0.1:{port}"
        async with RegistryClient(url, RUN, token=TOKEN) as publisher:
            await publisher.publish_snapshot(0, chain.snapshot(0))
            for v in (1, 2):
                await publisher.publish_patch(v, chain.patches[v])
        # ~1.4 s at 1 Mbit/s; retries for minutes: a restart on a loaded machine can be slow.
        async with RegistryClient(
            url, RUN, streams=2, bandwidth_bps=1e6, retries=300, max_backoff_s=1.0
        ) as client:
            total = (await client.plan(None)).total_bytes
            state: dict = {}
            task = asyncio.create_task(sync_weights(client, state, None))
            while client.counters.bytes < total * 0.3:
                assert not task.done()
                await asyncio.sleep(0.02)
            stop(proc)  # SIGKILL mid-download
            killed_at = client.counters.bytes
            assert killed_at < total
            proc = await asyncio.to_thread(start_registry, port, store, **env)
            result = await task
        assert result.version == 2 and same(state, chain.states[2])
        assert client.counters.retries > 0
        # Resumed, not restarted: every byte received before the kill was kept, none fetched twice.
        assert result.bytes == total
    finally:
        stop(proc)
