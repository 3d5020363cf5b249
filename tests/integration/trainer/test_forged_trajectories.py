"""A forged trajectory in Redis is refused and counted (issue 27): trajectories written straight
into the run's stream, for groups never submitted or with chosen rewards, unsigned or signed with
another key, are not trained; a worker's honest, signed trajectory of a submitted group is.

Over real Redis (REDIS_URL): the groups go through the trainer's ledger (its submission path), the
honest trajectory through the coordinator's claim and complete (a worker's path), the forgeries
through a plain XADD to the stream, and the trainer's admission (services.trainer.admission)
decides on what the trainer reads back. The last test runs the trainer service itself over HTTP.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import redis.asyncio as aioredis

from services.rollout.engine.config import GenerationOutput
from services.rollout.worker import score_samples
from services.trainer import admission
from services.trainer.admission import refusal
from services.trainer.ledger import GroupLedger
from shared.coord import Coordinator
from shared.schemas import KVStats, PromptGroup, SamplingInfo, Trajectory, WorkerInfo
from shared.signing import sign_trajectory
from shared.tasks import get_task
from shared.tokenizer import build_tokenizer
from tests.integration.trainer.test_trainer_service import AUTH, stack

RUN, WORKER_TOKEN = "t", "worker-credential"
# A group nobody submitted.
NEVER = PromptGroup(id="never-submitted", task="addition", prompt="Add: 1+1\n", answer="2", samples=2)
TOKENIZER = build_tokenizer()
# What a worker sampling as the trainer assumes reports: forgeries copy it, so only admission stops them.
SAMPLING = SamplingInfo(temperature=1.0, top_p=1.0, engine="native", kv_policy="dense")


def trajectory(group: PromptGroup, completions: list[str], *, worker: str = "w1") -> Trajectory:
    """The trajectory a worker makes of `group` (its scoring, the demo's tokenizer)."""
    encode = lambda text: list(TOKENIZER(text).input_ids)  # noqa: E731 - as RolloutCore.encode
    outputs = [GenerationOutput(token_ids=encode(text)[1:] + [TOKENIZER.eos_token_id],
                                logprobs=[-0.7] * len(text) + [-0.2], finish_reason="stop", kv=KVStats())
               for text in completions]
    samples = score_samples(get_task(group.task), group.answer or "", encode(group.prompt), outputs,
                            lambda ids: str(TOKENIZER.decode(list(ids), skip_special_tokens=True)))
    return Trajectory(group_id=group.id, attempt=1, policy_version=0, worker_id=worker, task=group.task,
                      prompt=group.prompt, samples=samples, sampling=SAMPLING)


def chosen_rewards(t: Trajectory) -> Trajectory:
    """The forger's edit: every sample correct with full reward."""
    for sample in t.samples:
        sample.reward, sample.correct = 1.0, True
    return t


async def write_to_stream(coord: Coordinator, t: Trajectory) -> None:
    """What anyone who reaches Redis can do: append a trajectory to the run's stream directly."""
    await coord.redis.xadd(coord.keys.trajectories, {"trajectory": t.model_dump_json()})


def test_a_forged_trajectory_in_redis_is_refused_and_counted(tmp_path: Path, redis_url: str,
                                                             redis_prefix: str) -> None:
    async def scenario() -> tuple[dict[str, int], list[str]]:
        client = aioredis.from_url(redis_url)
        coord = Coordinator(client, redis_prefix, run=RUN)
        ledger = GroupLedger.in_dir(tmp_path, RUN)
        submitted = [PromptGroup(id=f"g{i}", task="addition", prompt=f"Add: {i}+3\n", answer=str(i + 3),
                                 samples=2) for i in range(3)]
        try:
            await ledger.submit(coord, submitted)
            leases = await coord.claim("w1", 3)
            assert [lease.group_id for lease in leases] == ["g0", "g1", "g2"]
            # The worker completes g0 honestly and signed; g1 and g2 stay leased (in flight).
            honest = sign_trajectory(trajectory(submitted[0], ["=3", "=5"]), WORKER_TOKEN, RUN)
            assert await coord.complete(leases[0], honest)

            forgeries = [
                # A group never submitted, signed with a key that is not the worker credential.
                sign_trajectory(chosen_rewards(trajectory(NEVER, ["=2", "=7"])), "guessed-key", RUN),
                # A submitted group, unsigned, with chosen rewards.
                chosen_rewards(trajectory(submitted[1], ["=9", "x"], worker="intruder")),
                # The honest trajectory replayed with its rewards raised: its signature no longer holds.
                chosen_rewards(honest.model_copy(deep=True)),
            ]
            for forged in forgeries:
                await write_to_stream(coord, forged)

            refused: dict[str, int] = {}  # as the trainer counts them (Trainer.refused)
            admitted = []
            for t in await coord.next_trajectories(10, min_version=0):
                reason = refusal(t, ledger, WORKER_TOKEN, TOKENIZER)
                if reason is None:
                    admitted.append(t.group_id)
                else:
                    refused[reason] = refused.get(reason, 0) + 1
            return refused, admitted
        finally:
            await client.aclose()

    refused, admitted = asyncio.run(scenario())
    assert admitted == ["g0"]
    assert refused == {admission.BAD_SIGNATURE: 2, admission.UNSIGNED: 1}


def test_without_a_worker_token_the_ledger_and_the_rewards_still_decide(tmp_path: Path, redis_url: str,
                                                                         redis_prefix: str) -> None:
    """Signatures off (loopback development): forgeries of unsubmitted groups or with chosen
    rewards are still refused, each for its own reason."""
    async def scenario() -> dict[str, int]:
        client = aioredis.from_url(redis_url)
        coord = Coordinator(client, redis_prefix, run=RUN)
        ledger = GroupLedger.in_dir(tmp_path, RUN)
        group = PromptGroup(id="g0", task="addition", prompt="Add: 20+22\n", answer="42", samples=2)
        try:
            await ledger.submit(coord, [group])
            for forged in (chosen_rewards(trajectory(NEVER, ["=1", "=3"])),
                           chosen_rewards(trajectory(group, ["=41", "=40"])),
                           trajectory(group, ["=42", "=42"]).model_copy(update={"prompt": "Add: 0+42\n"})):
                await write_to_stream(coord, forged)
            refused: dict[str, int] = {}
            for t in await coord.next_trajectories(10, min_version=0):
                reason = refusal(t, ledger, None, TOKENIZER)
                assert reason is not None
                refused[reason] = refused.get(reason, 0) + 1
            return refused
        finally:
            await client.aclose()

    assert asyncio.run(scenario()) == {admission.NOT_ADMITTED: 1, admission.REWARD_DIFFERS: 1,
                                       admission.PROMPT_DIFFERS: 1}


def test_the_trainer_names_a_worker_whose_trajectories_it_will_refuse(
        tmp_path: Path, tiny_model_dir: str, redis_url: str, redis_prefix: str) -> None:
    """A worker without the worker token (or too old to sign) shows why in /v1/status."""
    with stack(tmp_path, tiny_model_dir, redis_url, redis_prefix, worker_token=WORKER_TOKEN) as (url, _):
        async def register() -> None:
            client = aioredis.from_url(redis_url)
            try:
                coord = Coordinator(client, redis_prefix, run=RUN)
                await coord.register_worker(WorkerInfo(worker_id="no-token", sampling=SAMPLING))
                await coord.register_worker(WorkerInfo(worker_id="signs", sampling=SAMPLING, signs=True))
            finally:
                await client.aclose()

        asyncio.run(register())
        workers = {w["worker_id"]: w for w in httpx.get(f"{url}/v1/status").json()["workers"]}
    assert workers["no-token"]["disagreement"] == admission.UNSIGNED_WORKER
    assert workers["signs"]["disagreement"] is None


def test_the_trainer_service_refuses_and_counts_a_forged_trajectory(
        tmp_path: Path, tiny_model_dir: str, redis_url: str, redis_prefix: str) -> None:
    with stack(tmp_path, tiny_model_dir, redis_url, redis_prefix, worker_token=WORKER_TOKEN,
               groups_per_step=1, collect_timeout_s=1.0) as (url, registry_url):
        async def forge() -> None:
            client = aioredis.from_url(redis_url)
            try:
                await write_to_stream(Coordinator(client, redis_prefix, run=RUN),
                                      chosen_rewards(trajectory(NEVER, ["=2", "=5"])))
            finally:
                await client.aclose()

        asyncio.run(forge())
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            status = httpx.get(f"{url}/v1/status").json()
            if status["refused_trajectories"] or status["version"]:
                break
            time.sleep(0.2)
        time.sleep(2.0)  # a step on the forgery would have published by now
        status = httpx.get(f"{url}/v1/status", headers=AUTH).json()
        assert status["refused_trajectories"] == {admission.UNSIGNED: 1}
        assert status["version"] == 0 and status["step"] == 0  # nothing trained
        assert httpx.get(f"{registry_url}/v1/runs/{RUN}/latest").json()["version"] == 0
        metrics = httpx.get(f"{url}/metrics").text
        assert f'trainer_refused_trajectories{{reason="{admission.UNSIGNED}"}} 1.0' in metrics
