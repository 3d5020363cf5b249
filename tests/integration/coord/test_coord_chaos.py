"""Chaos: 1,000 groups, 4 worker processes SIGKILLed at random and restarted; every group must be
completed exactly once. Run alone with `pytest -m chaos`. This file is also the worker program:
`python test_coord_chaos.py REDIS_URL PREFIX`, then "WORKER_ID SEED" on stdin.
"""

from __future__ import annotations

import asyncio
import os
import random
import select
import signal
import subprocess
import sys
import time

import pytest
import redis.asyncio as aioredis

from shared.coord import Coordinator, CoordSettings
from shared.schemas import PromptGroup, Trajectory
from tests.paths import REPO_ROOT

GROUPS = 1000
WORKERS = 4
KILLS = 8
# Short leases so killed workers' groups come back within a second; attempts high enough that
# no group is dead-lettered just for meeting several kills.
SETTINGS = CoordSettings(lease_ttl_s=0.5, max_attempts=50, max_queue=GROUPS)
STALL_PROBABILITY = 0.01  # a worker sometimes stalls past its lease, then still completes
REPO_ROOT = REPO_ROOT
RUN = "chaos"


async def run_worker(redis_url: str, prefix: str, worker_id: str, seed: int) -> None:
    client = aioredis.from_url(redis_url)
    coord = Coordinator(client, prefix, SETTINGS, run=RUN)
    rng = random.Random(seed)
    while True:
        leases = await coord.claim(worker_id, rng.randint(1, 8), block_ms=200)
        lost: set[str] = set()
        last_heartbeat = time.monotonic()
        for i, lease in enumerate(leases):
            if lease.entry_id in lost:
                continue  # reclaimed by another worker while this one was busy: drop it
            stall = rng.random() < STALL_PROBABILITY
            await asyncio.sleep(SETTINGS.lease_ttl_s * 1.5 if stall else rng.uniform(0, 0.02))
            trajectory = Trajectory(group_id=lease.group_id, attempt=lease.attempt, policy_version=0,
                                    worker_id=worker_id, task=lease.group.task, prompt=lease.group.prompt,
                                    samples=[])
            await coord.complete(lease, trajectory)
            rest = leases[i + 1:]
            if rest and time.monotonic() - last_heartbeat > SETTINGS.heartbeat_interval_s:
                held = {lease.entry_id for lease in await coord.heartbeat_leases(rest)}
                lost |= {lease.entry_id for lease in rest if lease.entry_id not in held}
                last_heartbeat = time.monotonic()


class Fleet:
    """Worker processes started ahead: each finishes its imports (seconds on a loaded machine),
    says "ready" and waits on stdin for its worker id, so a killed worker is replaced at once."""

    def __init__(self, redis_url: str, prefix: str, rng: random.Random, processes: int) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        self.rng = rng
        self.spares = [
            subprocess.Popen([sys.executable, __file__, redis_url, prefix], env=env, cwd=REPO_ROOT,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for _ in range(processes)
        ]
        self.active: dict[str, subprocess.Popen] = {}

    async def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        waiting = list(self.spares)
        while waiting:
            assert time.monotonic() < deadline, "worker processes did not start"
            readable, _, _ = select.select([p.stdout for p in waiting], [], [], 0)
            for proc in [p for p in waiting if p.stdout in readable]:
                assert proc.stdout.readline() == b"ready\n", proc.stderr.read().decode()[-2000:]
                waiting.remove(proc)
            await asyncio.sleep(0.05)

    def start(self, worker_id: str) -> None:
        proc = self.spares.pop()
        proc.stdin.write(f"{worker_id} {self.rng.randrange(1 << 30)}\n".encode())
        proc.stdin.flush()
        self.active[worker_id] = proc

    def kill(self, worker_id: str) -> None:
        proc = self.active.pop(worker_id)
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    def check_alive(self) -> None:  # a worker that died by itself is a bug, not chaos
        for proc in [*self.active.values(), *self.spares]:
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]

    def close(self) -> None:
        for proc in [*self.active.values(), *self.spares]:
            proc.kill()
            proc.wait()


@pytest.mark.chaos
async def test_sigkilled_workers_complete_every_group_exactly_once(redis_url: str, redis_prefix: str) -> None:
    rng = random.Random(1234)
    client = aioredis.from_url(redis_url)
    coord = Coordinator(client, redis_prefix, SETTINGS, run=RUN)
    ids = [f"g{i:04d}" for i in range(GROUPS)]
    await coord.enqueue([PromptGroup(id=i, task="addition", prompt=f"{i}=", samples=1) for i in ids])
    fleet = Fleet(redis_url, redis_prefix, rng, WORKERS + KILLS)
    try:
        await fleet.wait_ready(timeout_s=120)
        for i in range(WORKERS):
            fleet.start(f"w{i}")
        started = time.monotonic()
        while (await coord.stats())["groups_completed"] < GROUPS:
            assert time.monotonic() - started < 60, f"not done in 60 s: {await coord.stats()}"
            await asyncio.sleep(rng.uniform(0.1, 0.3))
            fleet.check_alive()
            if fleet.spares:
                fleet.kill(rng.choice(sorted(fleet.active)))
                fleet.start(f"w{WORKERS + KILLS - len(fleet.spares)}")
    finally:
        fleet.close()
    await asyncio.sleep(SETTINGS.lease_ttl_s)  # any straggler completion would land by now
    trajectories = await coord.next_trajectories(2 * GROUPS)
    stats = await coord.stats()
    await client.aclose()
    counted = [t.group_id for t in trajectories]
    assert len(counted) == len(set(counted)), "a group was counted twice"
    assert sorted(counted) == ids, f"lost groups: {sorted(set(ids) - set(counted))[:10]}"
    assert stats["completions"] == GROUPS and stats["dead_letters"] == 0
    assert stats["prompts_queued"] == 0 and stats["leases_pending"] == 0
    assert not fleet.spares and stats["reclaims"] > 0, stats  # every planned kill happened


if __name__ == "__main__":
    print("ready", flush=True)
    worker_id, seed = sys.stdin.readline().split()  # a warm spare waits here for its turn
    asyncio.run(run_worker(sys.argv[1], sys.argv[2], worker_id, int(seed)))
