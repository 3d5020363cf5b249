"""services.trainer.repair against a real registry over HTTP: a snapshot of the head is uploaded
when the registry wants one (and only then), never of weights between two versions."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from services.registry.app import create_app
from services.registry.settings import RegistrySettings
from services.trainer.repair import repair_loop, repair_once
from shared.registry.client import RegistryClient
from tests.conftest import serve_app
from tests.integration.registry_helpers import TOKEN, make_chain
from tests.unit.services.registry.test_registry_repair import flip_byte

RUN = "r1"


def test_the_trainer_uploads_the_snapshot_the_registry_wants(tmp_path: Path) -> None:
    chain = make_chain(RUN, 5)
    settings = RegistrySettings(store_url=f"file://{tmp_path}", api_token=TOKEN, piece_bytes=4096,
                                snapshot_every=0, plan_lease_s=0)
    held: dict[str, tuple[int, dict[str, torch.Tensor]] | None] = {"now": None}

    async def head_weights() -> tuple[int, dict[str, torch.Tensor]] | None:
        return held["now"]

    async def scenario(base: str) -> None:
        async with RegistryClient(base, RUN, token=TOKEN) as client:
            await client.publish_snapshot(0, chain.snapshot(0))
            for v in range(1, 5):
                await client.publish_patch(v, chain.patches[v])
            held["now"] = (4, chain.states[4])
            assert await repair_once(client, head_weights) is None  # nothing wanted
            assert (await client.manifest(4)).snapshot is None

            flip_byte(tmp_path, "patches/2-3.patch")
            assert (await client.report_corrupt("patches/2-3.patch")).quarantined
            assert (await client.repair_status()).snapshot_wanted == 4
            held["now"] = None  # the trainer is starting
            assert await repair_once(client, head_weights) is None
            held["now"] = (4, chain.states[5])  # a step captured, not yet published
            assert await repair_once(client, head_weights) is None
            assert (await client.manifest(4)).snapshot is None

            held["now"] = (4, chain.states[4])
            stop = asyncio.Event()
            loop = asyncio.create_task(repair_loop(client, head_weights, stop, poll_s=0.05))
            for _ in range(100):
                if (await client.repair_status()).snapshot_wanted is None:
                    break
                await asyncio.sleep(0.05)
            stop.set()
            await loop
            assert (await client.manifest(4)).snapshot is not None
            assert (await client.plan(None)).steps[0].object.key == "snapshots/4.safetensors"
            assert await repair_once(client, head_weights) is None  # repaired: nothing more wanted

    with serve_app(create_app(settings)) as base:
        asyncio.run(scenario(base))
