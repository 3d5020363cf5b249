"""A relaying rollout worker takes its place in the registry's peer order before the first version
(shared.relay.Relay.warm_up) and keeps it between versions (Relay.keep_place), both called by the
weight sync's loop: real registry over HTTP."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from services.registry.app import create_app as create_registry
from services.registry.settings import RegistrySettings
from services.rollout.core import RolloutCore
from services.rollout.settings import RolloutSettings
from services.rollout.sync import WeightSync
from shared.patch import extract_patch, save_snapshot
from shared.registry.client import RegistryClient
from shared.relay import Holdings, Relay
from tests.conftest import serve_app
from tests.integration.registry_helpers import TOKEN, step

RUN = "relayplace"


async def test_the_sync_loop_keeps_a_relaying_worker_listed_past_the_registrys_ttl(
    tmp_path: Path, tiny_model_dir: str
) -> None:
    states: list[dict[str, torch.Tensor]] = [load_file(str(Path(tiny_model_dir) / "model.safetensors"))]
    states.append(step(states[0], 1))
    registry = RegistrySettings(store_url=f"file://{tmp_path}/store", api_token=TOKEN, snapshot_every=0,
                                peer_ttl_s=1.0)
    with serve_app(create_registry(registry)) as url:
        async with RegistryClient(url, RUN, token=TOKEN) as client:
            await client.publish_snapshot(0, save_snapshot(states[0], run=RUN, version=0))
            settings = RolloutSettings(model=tiny_model_dir, device="cpu", registry_url=url, run=RUN,
                                       worker_id="w1", data_dir=str(tmp_path / "rollout"))
            core = RolloutCore.from_model_dir(settings, Path(tiny_model_dir), version=0)
            relay = Relay("w1", "http://127.0.0.1:9", Holdings(), announce_every_s=0.3)
            client.downloader.relay = relay
            sync = WeightSync(core, client, poll_s=0.1)
            stop = asyncio.Event()
            loop = asyncio.create_task(sync.run(stop))
            try:
                await client.publish_patch(1, extract_patch(states[0], states[1], run=RUN, base_version=0,
                                                            target_version=1))
                deadline = asyncio.get_running_loop().time() + 30
                while core.weights.version < 1:
                    assert asyncio.get_running_loop().time() < deadline, "v1 not reached"
                    await asyncio.sleep(0.05)
                await asyncio.sleep(2.5)  # over twice the registry's TTL with no new version
                async with httpx.AsyncClient() as http:
                    plan = (await http.get(f"{url}/v1/runs/{RUN}/plan",
                                           params={"from": 0, "to": 1, "peer": "w2"})).json()
                assert plan["peers"] == {"patches/0-1.patch": ["http://127.0.0.1:9"]}
            finally:
                stop.set()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(loop, timeout=10)


@pytest.mark.parametrize("warm_up_bytes", [4096, 0])
async def test_the_sync_loop_warms_a_relaying_worker_up_before_the_first_version(
    tmp_path: Path, tiny_model_dir: str, warm_up_bytes: int
) -> None:
    """Started from its own weights, a relaying worker takes its place with the first pieces of the
    newest snapshot as its sync loop starts (shared.relay.Relay.warm_up): listed to a new worker
    for them before any patch exists. Off (0), it has no place until its first download."""
    state = load_file(str(Path(tiny_model_dir) / "model.safetensors"))
    registry = RegistrySettings(store_url=f"file://{tmp_path}/store", api_token=TOKEN, snapshot_every=0,
                                piece_bytes=1024)
    with serve_app(create_registry(registry)) as url:
        async with RegistryClient(url, RUN, token=TOKEN) as client:
            await client.publish_snapshot(0, save_snapshot(state, run=RUN, version=0))
            settings = RolloutSettings(model=tiny_model_dir, device="cpu", registry_url=url, run=RUN,
                                       worker_id="w1", data_dir=str(tmp_path / "rollout"))
            core = RolloutCore.from_model_dir(settings, Path(tiny_model_dir), version=0)
            relay = Relay("w1", "http://127.0.0.1:9", Holdings())
            client.downloader.relay = relay
            sync = WeightSync(core, client, poll_s=0.1, warm_up_bytes=warm_up_bytes)
            stop = asyncio.Event()
            loop = asyncio.create_task(sync.run(stop))
            try:
                await asyncio.sleep(1.0)
                async with httpx.AsyncClient() as http:
                    plan = (await http.get(f"{url}/v1/runs/{RUN}/plan", params={"peer": "w2"})).json()
            finally:
                stop.set()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(loop, timeout=10)
    listed = plan["peers"].get("snapshots/0.safetensors", [])
    if warm_up_bytes:
        assert listed == ["http://127.0.0.1:9"]
        assert [len(relay.holdings.find(RUN, key).done) for key in relay.holdings.keys(RUN)] == [4]
    else:
        assert listed == [] and relay.holdings.keys(RUN) == []
