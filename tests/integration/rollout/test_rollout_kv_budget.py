"""A rollout worker follows the KV budget published with each version (registry manifests,
services.trainer.kv_budget): real registry over HTTP, real Redis, the native engine."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import httpx
import redis.asyncio as aioredis
import torch
from safetensors.torch import load_file

from services.registry.app import create_app as create_registry
from services.registry.settings import RegistrySettings
from services.rollout.core import RolloutCore
from services.rollout.engine.config import KVConfig
from services.rollout.settings import RolloutSettings
from services.rollout.sync import WeightSync
from services.rollout.worker import RolloutWorker
from shared.coord import Coordinator
from shared.kv import KVSettings
from shared.patch import extract_patch, save_snapshot
from shared.registry.client import RegistryClient
from shared.registry.wire import RolloutDirective
from shared.schemas import PromptGroup, Trajectory
from tests.conftest import serve_app
from tests.integration.registry_helpers import TOKEN, step

RUN = "kvbudget"
OWN_BUDGET = 48  # the worker's own setting


async def _wait(predicate, timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


async def test_worker_generates_with_the_budget_of_its_weights_version(
    tmp_path: Path, tiny_model_dir: str, redis_url: str, redis_prefix: str
) -> None:
    states: list[dict[str, torch.Tensor]] = [load_file(str(Path(tiny_model_dir) / "model.safetensors"))]
    for v in range(1, 4):
        states.append(step(states[-1], v))

    def patch(v: int) -> bytes:
        return extract_patch(states[v - 1], states[v], run=RUN, base_version=v - 1, target_version=v)

    registry = RegistrySettings(store_url=f"file://{tmp_path}/store", api_token=TOKEN, snapshot_every=0)
    redis = aioredis.Redis.from_url(redis_url)
    with serve_app(create_registry(registry)) as url:
        async with RegistryClient(url, RUN, token=TOKEN) as client:
            await client.publish_snapshot(0, save_snapshot(states[0], run=RUN, version=0))  # no directive
            settings = RolloutSettings(
                model=tiny_model_dir, device="cpu", kv=KVSettings(policy="rkv", budget=OWN_BUDGET, buffer=4),
                registry_url=url, run=RUN, redis_url=redis_url, redis_prefix=redis_prefix, worker_id="w1",
                max_new_tokens=40, data_dir=str(tmp_path / "rollout"),
            )
            core = RolloutCore.from_model_dir(settings, Path(tiny_model_dir), version=0)
            used: list[KVConfig] = []  # what the engine was really asked to run with
            generate = core.engine.generate

            def recording(prompts, params, kv):  # type: ignore[no-untyped-def]
                used.append(kv)
                return generate(prompts, params, kv)

            core.engine.generate = recording  # type: ignore[method-assign]
            coord = Coordinator(redis, redis_prefix, settings.coord, run=RUN)
            sync = WeightSync(core, client, poll_s=0.1)
            worker = RolloutWorker(core, coord, settings, sync)

            async def one_group(gid: str) -> Trajectory:
                await coord.enqueue([PromptGroup(id=gid, task="addition", prompt="add 12+34\n", answer="46",
                                                 samples=2)])
                leases = await coord.claim("w1", 1, block_ms=2000)
                assert len(leases) == 1
                await worker.process(leases)
                [trajectory] = await coord.next_trajectories(1, min_version=0, block_ms=2000)
                return trajectory

            # v0 carries no budget: the worker's own.
            await sync.refresh_budget()
            assert (core.weights.kv_budget, core.weights.kv_budget_of) == (None, 0)
            t0 = await one_group("g0")
            assert (t0.policy_version, t0.sampling.kv_budget, used[-1].budget) == (0, OWN_BUDGET, OWN_BUDGET)

            # v1 carries 12: the sync swaps weights and budget together.
            await client.publish_patch(1, patch(1), rollout=RolloutDirective(kv_budget=12))
            assert await sync.sync_to(1) == 1
            info = worker.info()
            assert (core.weights.kv_budget, info.kv_budget, info.sampling.kv_budget) == (12, 12, 12)
            t1 = await one_group("g1")
            assert (t1.policy_version, t1.sampling.kv_budget, used[-1].budget) == (1, 12, 12)
            # The engine held it (prompt protected: the budget counts generated tokens, + the buffer).
            assert all(s.kv.peak_tokens - len(s.prompt_ids) <= 12 + 4 for s in t1.samples)

            # v2 carries 20 but its manifest cannot be read at the sync: the weights move, the old
            # budget stays (and is what the batch reports), the loop reads it on its next round.
            await client.publish_patch(2, patch(2), rollout=RolloutDirective(kv_budget=20))
            manifest = client.manifest

            async def unreachable(version: int):  # type: ignore[no-untyped-def]
                raise httpx.ConnectError("registry unreachable")

            client.manifest = unreachable  # type: ignore[method-assign]
            assert await sync.sync_to(2) == 2
            assert (core.weights.kv_budget, core.weights.kv_budget_of) == (12, 1)
            t2 = await one_group("g2")
            assert (t2.policy_version, t2.sampling.kv_budget, used[-1].budget) == (2, 12, 12)
            client.manifest = manifest  # type: ignore[method-assign]

            stop = asyncio.Event()
            loop = asyncio.create_task(sync.run(stop))
            try:
                await _wait(lambda: core.weights.kv_budget_of == 2)
                assert core.weights.kv_budget == 20
                t3 = await one_group("g3")
                assert (t3.policy_version, t3.sampling.kv_budget, used[-1].budget) == (2, 20, 20)
                # v3 carries none: back to the worker's own budget, picked up by the running loop.
                await client.publish_patch(3, patch(3))
                await _wait(lambda: core.weights.version == 3)
                assert core.weights.kv_budget is None and core.kv_config().budget == OWN_BUDGET
                t4 = await one_group("g4")
                assert (t4.policy_version, t4.sampling.kv_budget) == (3, OWN_BUDGET)
            finally:
                stop.set()
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait_for(loop, timeout=60)
    await redis.aclose()


def test_a_dense_only_engine_ignores_the_published_budget(tiny_model_dir: str) -> None:
    core = RolloutCore.from_model_dir(
        RolloutSettings(model=tiny_model_dir, device="cpu", kv=KVSettings(policy="rkv", budget=OWN_BUDGET)),
        Path(tiny_model_dir))
    core.weights.kv_budget = 12
    assert core.kv_config().budget == 12
    core.engine.name = "vllm"  # what a vLLM engine reports: a dense cache whatever is published
    assert core.kv_config() == KVConfig(policy="dense")
