"""A relaying rollout worker keeps its place in the registry's peer order between versions
(shared.relay.Relay.keep_place, called by the weight sync's loop): real registry over HTTP."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import httpx
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
