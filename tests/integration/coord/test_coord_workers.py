"""Trajectory staleness, worker registry and scheduling against a real Redis (env REDIS_URL)."""

from __future__ import annotations

import asyncio

from shared.coord import Coordinator
from shared.schemas import PromptGroup, Trajectory, WorkerInfo
from tests.integration.conftest import CoordFactory


def groups(n: int) -> list[PromptGroup]:
    return [PromptGroup(id=f"g{i}", task="addition", prompt=f"{i}+1=", samples=1) for i in range(n)]


async def complete_with_versions(coord: Coordinator, versions: list[int]) -> None:
    await coord.enqueue(groups(len(versions)))
    leases = await coord.claim("w1", len(versions))
    for lease, version in zip(leases, versions, strict=True):
        trajectory = Trajectory(group_id=lease.group_id, attempt=lease.attempt, policy_version=version,
                                worker_id="w1", task="addition", prompt=lease.group.prompt, samples=[])
        assert await coord.complete(lease, trajectory)


async def test_stale_trajectories_dropped_and_counted(make_coord: CoordFactory) -> None:
    coord = make_coord(max_lag=2)
    await coord.set_trainer_version(5)
    await complete_with_versions(coord, [2, 3, 5, 1])
    got = await coord.next_trajectories(10)
    assert [t.policy_version for t in got] == [3, 5]  # 5 - 2 = 3 is the oldest accepted
    stats = await coord.stats()
    assert (stats["dropped_stale"], stats["trajectories_read"], stats["trajectories_queued"]) == (2, 2, 0)


async def test_explicit_min_version_overrides_max_lag(make_coord: CoordFactory) -> None:
    coord = make_coord(max_lag=10)
    await complete_with_versions(coord, [0, 1, 2])
    got = await coord.next_trajectories(10, min_version=2)
    assert [t.policy_version for t in got] == [2]
    assert (await coord.stats())["dropped_stale"] == 2


async def test_trainer_blocking_read_wakes_on_completion(make_coord: CoordFactory) -> None:
    coord = make_coord()
    await coord.setup()
    reader = asyncio.create_task(coord.next_trajectories(8, block_ms=3000))
    await asyncio.sleep(0.1)
    await complete_with_versions(coord, [0])
    assert [t.group_id for t in await asyncio.wait_for(reader, 5)] == ["g0"]


async def test_worker_registry_expires_silent_workers(make_coord: CoordFactory) -> None:
    coord = make_coord(worker_ttl_s=0.6)
    await coord.register_worker(WorkerInfo(worker_id="a", engine="vllm", tokens_per_s=900.0, leases=3))
    await coord.register_worker(WorkerInfo(worker_id="b", kv_policy="rkv", kv_budget=512))
    assert [(w.worker_id, w.engine) for w in await coord.workers()] == [("a", "vllm"), ("b", "native")]
    await asyncio.sleep(0.4)
    await coord.register_worker(WorkerInfo(worker_id="a", tokens_per_s=950.0))  # a heartbeats, b is silent
    await asyncio.sleep(0.4)
    assert [w.worker_id for w in await coord.workers()] == ["a"]
    assert (await coord.stats())["workers_registered"] == 1  # b pruned from the set
    await coord.deregister_worker("a")
    assert await coord.workers() == []


async def test_three_times_faster_worker_gets_about_three_times_the_claims(make_coord: CoordFactory) -> None:
    coord = make_coord(base_claim=4, max_queue=10_000)
    await coord.register_worker(WorkerInfo(worker_id="slow", tokens_per_s=100.0))
    await coord.register_worker(WorkerInfo(worker_id="fast", tokens_per_s=300.0))
    await coord.enqueue(groups(400))
    claimed = {"slow": 0, "fast": 0}
    # Each round both workers take their scheduled share; a batch lasts about the same wall time
    # for both because the batch is sized by throughput.
    for _ in range(20):
        for worker_id in claimed:
            leases = await coord.claim(worker_id, await coord.claim_size(worker_id))
            claimed[worker_id] += len(leases)
            for lease in leases:
                await coord.release(lease)
    assert claimed["slow"] > 0
    assert 2.5 <= claimed["fast"] / claimed["slow"] <= 3.5


async def test_lagging_worker_claims_none_until_synced(make_coord: CoordFactory) -> None:
    coord = make_coord(staleness_bound=1)
    await coord.enqueue(groups(4))
    await coord.set_trainer_version(5)
    await coord.register_worker(WorkerInfo(worker_id="behind", weight_version=3, tokens_per_s=500.0))
    await coord.register_worker(WorkerInfo(worker_id="current", weight_version=4, tokens_per_s=100.0))
    assert await coord.claim_size("behind") == 0
    assert await coord.claim_size("current") == 4  # the lagging worker does not count in the fleet mean
    assert await coord.claim("behind", 4) == []  # enforced by the claim script, not only advised
    assert (await coord.stats())["lagging_refusals"] == 1
    await coord.register_worker(WorkerInfo(worker_id="behind", weight_version=5, tokens_per_s=500.0))
    assert len(await coord.claim("behind", 4)) == 4


async def test_trajectories_read_by_a_crashed_trainer_are_handed_out_again(make_coord: CoordFactory) -> None:
    coord = make_coord()
    await complete_with_versions(coord, [0, 0, 0])
    # A trainer that died between reading and acknowledging: two entries pending, unacknowledged.
    await coord.redis.xreadgroup("trainer", "trainer", {coord.keys.trajectories: ">"}, count=2)
    restarted = make_coord()
    assert [t.group_id for t in await restarted.next_trajectories(10)] == ["g0", "g1"]
    assert [t.group_id for t in await restarted.next_trajectories(10)] == ["g2"]
    assert await restarted.next_trajectories(10) == []
    assert (await restarted.stats())["trajectories_queued"] == 0
