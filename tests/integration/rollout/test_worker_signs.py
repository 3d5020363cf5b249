"""A rollout worker with SPARSECAST_WORKER_TOKEN signs every trajectory it completes (issue 27):
a real worker (tiny model, real Redis) claims groups the trainer's ledger admitted, and what it
puts in the stream carries a valid signature for the run and passes the trainer's admission,
token ids and rewards included; without the token it signs nothing."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from transformers import AutoTokenizer

from services.rollout.app import create_app as create_rollout
from services.rollout.settings import RolloutSettings
from services.trainer.admission import refusal
from services.trainer.ledger import GroupLedger
from shared.coord import Coordinator
from shared.kv import KVSettings
from shared.schemas import PromptGroup, Trajectory, WorkerInfo
from shared.signing import signature_valid
from tests.conftest import serve_app

WORKER_TOKEN = "the-worker-credential"


@pytest.mark.parametrize("token", [WORKER_TOKEN, None], ids=["signed", "unsigned"])
def test_the_worker_signs_what_it_completes(token: str | None, tmp_path: Path, tiny_model_dir: str,
                                            redis_url: str, redis_prefix: str) -> None:
    settings = RolloutSettings(model=tiny_model_dir, device="cpu", redis_url=redis_url,
                               redis_prefix=redis_prefix, registry_url="", worker_id="w-signs",
                               kv=KVSettings(policy="dense"), max_new_tokens=6,
                               data_dir=str(tmp_path / "rollout"), worker_token=token)
    ledger = GroupLedger.in_dir(tmp_path / "trainer", settings.run)
    groups = [PromptGroup(id=f"g{i}", task="addition", prompt=f"Add: {i}+1\n", answer=str(i + 1), samples=2)
              for i in range(3)]

    async def take(wanted: int) -> tuple[list[Trajectory], list[WorkerInfo]]:
        client = aioredis.from_url(redis_url)
        coord = Coordinator(client, redis_prefix, run=settings.run)
        got: list[Trajectory] = []
        try:
            deadline = time.monotonic() + 120
            while len(got) < wanted and time.monotonic() < deadline:
                got += await coord.next_trajectories(wanted, min_version=0, block_ms=500)
            return got, await coord.workers()
        finally:
            await client.aclose()

    async def submit() -> None:
        client = aioredis.from_url(redis_url)
        try:
            await ledger.submit(Coordinator(client, redis_prefix, run=settings.run), groups)
        finally:
            await client.aclose()

    asyncio.run(submit())
    with serve_app(create_rollout(settings)):
        trajectories, workers = asyncio.run(take(len(groups)))
    # What it tells the trainer (which names a worker that does not sign where signatures are required).
    assert [(w.worker_id, w.signs) for w in workers] == [("w-signs", bool(token))]
    assert sorted(t.group_id for t in trajectories) == ["g0", "g1", "g2"]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)  # the trainer's (the model's) tokenizer
    for trajectory in trajectories:
        if token:
            assert signature_valid(trajectory, token, settings.run)
            assert not signature_valid(trajectory, token, "another-run")
        else:
            assert trajectory.signature is None
        assert refusal(trajectory, ledger, token, tokenizer) is None
