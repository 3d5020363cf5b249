"""The trainer publishes the workers' KV budget with each version and a restarted trainer resumes
it from the head manifest (real registry over HTTP, real Redis)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path

import redis.asyncio as aioredis

from services.registry.app import create_app as create_registry
from services.registry.settings import RegistrySettings
from services.trainer.core import Trainer
from services.trainer.kv_budget import KVControlSettings
from services.trainer.ledger import GroupLedger
from services.trainer.optim import OptimSettings
from services.trainer.settings import TrainerSettings
from shared.coord import Coordinator
from shared.registry.client import RegistryClient
from shared.schemas import KVStats, Sample, SamplingInfo, Trajectory
from tests.conftest import serve_app

TOKEN = "kv-trainer-token"
RUN = "kvt"


def _trajectories(version: int, budget: int, groups: int = 2, samples: int = 4) -> list[Trajectory]:
    """Sampled at `budget` on `version`; sampler log-probs near the tiny model's own (no veto)."""
    rng = random.Random(version)
    out = []
    for g in range(groups):
        prompt = [1] + [rng.randrange(4, 60) for _ in range(4)]
        items = [Sample(completion="x", prompt_ids=prompt,
                        completion_ids=[rng.randrange(4, 60) for _ in range(5)], logprobs=[-4.6] * 5,
                        reward=rng.random(), correct=False, finish_reason="stop",
                        kv=KVStats(peak_tokens=8, peak_bytes=100, evicted=1)) for _ in range(samples)]
        out.append(Trajectory(group_id=f"v{version}g{g}", attempt=1, policy_version=version, worker_id="w",
                              task="addition", prompt="p", samples=items,
                              sampling=SamplingInfo(temperature=1.0, kv_policy="rkv", kv_budget=budget)))
    return out


async def test_budget_published_per_version_logged_and_resumed(
    tmp_path: Path, tiny_model_dir: str, redis_url: str, redis_prefix: str
) -> None:
    control = KVControlSettings(mode="adaptive", metric="rejection_rate", target=0.3, smoothing=1.0,
                                min_sequences=1, min_budget=16, max_budget=64, start_budget=32, step=8)
    registry = RegistrySettings(store_url=f"file://{tmp_path}/store", api_token=TOKEN, snapshot_every=0)
    redis = aioredis.Redis.from_url(redis_url)
    with serve_app(create_registry(registry)) as url:
        settings = TrainerSettings(model=tiny_model_dir, device="cpu", optim=OptimSettings(lr=1e-3),
                                   data_dir=str(tmp_path / "t"), run=RUN, registry_url=url,
                                   redis_url=redis_url, redis_prefix=redis_prefix,
                                   kv_control=control, checkpoint_every=0)

        async def trainer() -> Trainer:
            client = RegistryClient(url, RUN, token=TOKEN)
            coord = Coordinator(redis, redis_prefix, settings.coord, run=RUN)
            t = await asyncio.to_thread(Trainer, settings, client, coord, Path(tiny_model_dir),
                                        ledger=GroupLedger.in_dir(settings.data_dir, RUN))
            await t.start(asyncio.Event())
            return t

        first = await trainer()
        assert (await first.registry.manifest(0)).rollout.kv_budget == 32  # the v0 snapshot carries it
        # Nothing vetoed (rejection 0 < 0.3 × 0.8): the next version asks for a tighter cache.
        metrics = first.train_step(_trajectories(0, 32))
        assert metrics["rejection_rate"] == 0.0
        assert (metrics["kv_budget"], metrics["kv_signal"], metrics["kv_budget_since"]) == (24, 0.0, 1)
        captured = first.learner.capture(False)
        await first.publish(captured, metrics, time.perf_counter(), (), first.rollout_directive())
        head = await first.registry.manifest(1)
        assert head.rollout.kv_budget == 24 and head.metrics["kv_budget"] == 24
        assert head.metrics["kv_signal"] == 0.0
        logged = [json.loads(line) for line in first.metrics_path.read_text().splitlines()]
        assert logged[-1]["kv_budget"] == 24 and logged[-1]["kv_signal"] == 0.0
        # Trajectories still sampled at 32 (a worker not yet at v1): no evidence about 24.
        metrics = first.train_step(_trajectories(0, 32))
        assert (metrics["kv_budget"], metrics["kv_signal"], metrics["kv_evidence"]) == (24, None, 0)
        await first.registry.aclose()

        # A restarted trainer (no checkpoint: it loads v1 from the registry) goes on at 24, not 32.
        second = await trainer()
        assert second.version == 1
        assert second.kv_control.state() == {"kv_budget": 24, "kv_budget_since": 1, "kv_signal": None,
                                             "kv_evidence": 0, "kv_moves": 0, "kv_step": 8,
                                             "kv_direction": -1, "kv_streak": 1, "kv_saved_signal": None,
                                             "kv_saved_per_token": None, "kv_held_by": "evidence"}
        assert second.rollout_directive().kv_budget == 24
        await second.registry.aclose()
    await redis.aclose()
