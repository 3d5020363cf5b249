"""Prompt queue, leases and exactly-once completion against a real Redis (env REDIS_URL)."""

from __future__ import annotations

import asyncio

import pytest

from shared.coord import Lease, QueueFull
from shared.schemas import KVStats, PromptGroup, Sample, Trajectory
from tests.integration.conftest import CoordFactory


def groups(n: int, start: int = 0) -> list[PromptGroup]:
    return [PromptGroup(id=f"g{i}", task="addition", prompt=f"{i}+1=", answer=str(i + 1), samples=2)
            for i in range(start, start + n)]


def trajectory(lease: Lease, version: int = 0) -> Trajectory:
    sample = Sample(completion="1", prompt_ids=[1, 2], completion_ids=[3], logprobs=[-0.5], reward=1.0,
                    correct=True, finish_reason="stop", kv=KVStats(peak_tokens=3, peak_bytes=96, evicted=0))
    return Trajectory(group_id=lease.group_id, attempt=lease.attempt, policy_version=version,
                      worker_id=lease.worker_id, task=lease.group.task, prompt=lease.group.prompt,
                      samples=[sample, sample])


async def test_claim_complete_publishes_trajectory(make_coord: CoordFactory) -> None:
    coord = make_coord()
    ids = await coord.enqueue(groups(3))
    assert len(ids) == 3
    leases = await coord.claim("w1", 2)
    assert [(lease.group_id, lease.attempt) for lease in leases] == [("g0", 1), ("g1", 1)]
    assert (await coord.stats())["leases_pending"] == 2
    for lease in leases:
        assert await coord.complete(lease, trajectory(lease))
    got = await coord.next_trajectories(10)
    assert [t.group_id for t in got] == ["g0", "g1"]
    assert got[0].samples[0].kv.peak_bytes == 96
    assert await coord.next_trajectories(10) == []  # consumed once
    stats = await coord.stats()
    assert (stats["prompts_queued"], stats["leases_pending"], stats["completions"]) == (1, 0, 2)
    assert stats["trajectories_read"] == 2 and stats["trajectories_queued"] == 0


async def test_complete_checks_group_matches_lease(make_coord: CoordFactory) -> None:
    coord = make_coord()
    await coord.enqueue(groups(2))
    first, second = await coord.claim("w1", 2)
    with pytest.raises(ValueError, match="g1"):
        await coord.complete(first, trajectory(second))


@pytest.mark.parametrize("first_to_finish", ["stalled", "reclaimer"])
async def test_stalled_worker_finishing_after_reclaim_counted_once(
    make_coord: CoordFactory, first_to_finish: str
) -> None:
    coord = make_coord(lease_ttl_s=0.1)
    await coord.enqueue(groups(1))
    [stalled] = await coord.claim("slow", 1)
    await asyncio.sleep(0.15)  # no heartbeat: the lease expires
    [reclaimed] = await coord.claim("fast", 1)
    assert (reclaimed.group_id, reclaimed.attempt) == ("g0", 2)
    assert await coord.heartbeat_leases([stalled]) == []  # the stalled worker learns it lost the lease
    order = [stalled, reclaimed] if first_to_finish == "stalled" else [reclaimed, stalled]
    results = [await coord.complete(lease, trajectory(lease)) for lease in order]
    assert results == [True, False]
    got = await coord.next_trajectories(10)
    assert [(t.group_id, t.worker_id) for t in got] == [("g0", order[0].worker_id)]
    stats = await coord.stats()
    assert (stats["completions"], stats["duplicates"], stats["reclaims"]) == (1, 1, 1)
    assert stats["late_completions"] == (1 if first_to_finish == "stalled" else 0)
    assert stats["leases_pending"] == 0 and stats["prompts_queued"] == 0
    assert await coord.claim("fast", 5) == []  # nothing left to reclaim


async def test_heartbeat_keeps_lease_from_reclaim(make_coord: CoordFactory) -> None:
    coord = make_coord(lease_ttl_s=0.5)  # generous: a loaded machine may delay the loop
    await coord.enqueue(groups(1))
    leases = await coord.claim("w1", 1)
    for _ in range(7):  # 0.7 s in all, past one TTL
        await asyncio.sleep(0.1)
        assert await coord.heartbeat_leases(leases) == leases
    assert await coord.claim("w2", 1) == []
    assert await coord.complete(leases[0], trajectory(leases[0]))


async def test_dead_letter_after_max_attempts(make_coord: CoordFactory) -> None:
    coord = make_coord(lease_ttl_s=0.05, max_attempts=2)
    await coord.enqueue(groups(1))
    [first] = await coord.claim("w1", 1)
    await asyncio.sleep(0.08)
    [second] = await coord.claim("w2", 1)
    assert second.attempt == 2
    await asyncio.sleep(0.08)
    assert await coord.claim("w3", 1) == []  # third delivery would exceed max_attempts
    [dead] = await coord.dead_letters()
    assert dead["reason"].startswith("max_attempts") and dead["attempts"] == "2"
    assert PromptGroup.model_validate_json(dead["group"]).id == "g0"
    assert not await coord.complete(second, trajectory(second))  # dead-lettered: too late
    stats = await coord.stats()
    assert (stats["dead_letters"], stats["max_attempts_exceeded"], stats["rejected"]) == (1, 1, 1)
    assert (stats["completions"], stats["leases_pending"], stats["prompts_queued"]) == (0, 0, 0)


async def test_malformed_entries_dead_lettered_and_consumer_continues(make_coord: CoordFactory) -> None:
    coord = make_coord()
    await coord.enqueue(groups(1))
    await coord.setup()
    await coord.redis.xadd(coord.keys.prompts, {"junk": "1"})
    await coord.redis.xadd(coord.keys.prompts, {"group": "{not json"})
    await coord.redis.xadd(coord.keys.prompts, {"group": b"\xff\xfe not utf-8"})
    await coord.redis.xadd(coord.keys.prompts, {"group": '{"id": "bad", "task": "t", "prompt": "p", "samples": 0}'})
    await coord.enqueue(groups(1, start=1))
    leases = await coord.claim("w1", 10)
    assert [lease.group_id for lease in leases] == ["g0", "g1"]
    reasons = [d["reason"] for d in await coord.dead_letters()]
    assert len(reasons) == 4 and all(r.startswith("malformed: ") for r in reasons)
    assert "no 'group' field" in reasons[0]
    assert "samples" in reasons[3]
    stats = await coord.stats()
    assert (stats["malformed"], stats["dead_letters"], stats["leases_pending"]) == (4, 4, 2)


async def test_release_returns_group_without_using_an_attempt(make_coord: CoordFactory) -> None:
    coord = make_coord(lease_ttl_s=30)
    await coord.enqueue(groups(1))
    [lease] = await coord.claim("w1", 1)
    assert await coord.release(lease)
    assert not await coord.release(lease)  # no longer held by w1
    [again] = await coord.claim("w2", 1)  # at once, not after the 30 s TTL
    assert (again.group_id, again.attempt) == ("g0", 1)
    assert (await coord.stats())["released"] == 1


async def test_reject_dead_letters_with_reason(make_coord: CoordFactory) -> None:
    coord = make_coord()
    await coord.enqueue(groups(1))
    [lease] = await coord.claim("w1", 1)
    assert await coord.reject(lease, "prompt longer than context")
    [dead] = await coord.dead_letters()
    assert (dead["reason"], dead["worker_id"]) == ("prompt longer than context", "w1")
    assert (await coord.stats())["worker_rejected"] == 1


async def test_backpressure_refuses_past_bound_all_or_none(make_coord: CoordFactory) -> None:
    coord = make_coord(max_queue=5)
    await coord.enqueue(groups(4))
    with pytest.raises(QueueFull, match="max_queue 5") as refused:
        await coord.enqueue(groups(2, start=4))
    assert (refused.value.depth, refused.value.requested) == (4, 2)
    stats = await coord.stats()
    assert (stats["prompts_queued"], stats["refused"]) == (4, 2)
    [lease] = await coord.claim("w1", 1)  # leased groups still count against the bound
    with pytest.raises(QueueFull):
        await coord.enqueue(groups(2, start=4))
    await coord.complete(lease, trajectory(lease))
    assert len(await coord.enqueue(groups(2, start=4))) == 2


async def test_same_group_enqueued_twice_counted_once(make_coord: CoordFactory) -> None:
    coord = make_coord()
    await coord.enqueue(groups(1))
    await coord.enqueue(groups(1))  # a producer retrying after a timeout
    a, b = await coord.claim("w1", 2)
    assert [await coord.complete(a, trajectory(a)), await coord.complete(b, trajectory(b))] == [True, False]
    stats = await coord.stats()
    assert (stats["completions"], stats["duplicates"], stats["leases_pending"]) == (1, 1, 0)


async def test_blocking_claim_wakes_on_enqueue(make_coord: CoordFactory) -> None:
    coord = make_coord()
    await coord.setup()
    waiter = asyncio.create_task(coord.claim("w1", 4, block_ms=3000))
    await asyncio.sleep(0.1)
    await coord.enqueue(groups(2))
    leases = await asyncio.wait_for(waiter, 5)
    assert [lease.group_id for lease in leases] == ["g0", "g1"]
    assert (await coord.stats())["claimed"] == 2


async def test_complete_many_counts_each_group_once(make_coord: CoordFactory) -> None:
    coord = make_coord()
    await coord.enqueue(groups(3))
    leases = await coord.claim("w1", 3)
    assert await coord.complete(leases[1], trajectory(leases[1]))
    results = await coord.complete_many([(lease, trajectory(lease)) for lease in leases])
    assert results == [True, False, True]
    assert [t.group_id for t in await coord.next_trajectories(10)] == ["g1", "g0", "g2"]
    with pytest.raises(ValueError):
        await coord.complete_many([(leases[0], trajectory(leases[2]))])
    assert (await coord.stats())["completions"] == 3


async def test_inflight_window_bounds_leased_plus_unread(make_coord: CoordFactory) -> None:
    """Workers cannot run further ahead than the trainer reads: leased + unread ≤ the window."""
    coord = make_coord()
    await coord.enqueue(groups(10))
    await coord.set_inflight_limit(3)
    first = await coord.claim("w1", 5)
    assert len(first) == 3  # clipped to the window
    assert await coord.claim("w2", 2) == [] and await coord.claim("w2", 2, block_ms=50) == []
    for lease in first:
        await coord.complete(lease, trajectory(lease))
    assert await coord.claim("w2", 2) == []  # completed but unread still counts
    assert len(await coord.next_trajectories(2)) == 2
    assert [lease.group_id for lease in await coord.claim("w2", 5, block_ms=50)] == ["g3", "g4"]
    stats = await coord.stats()
    assert stats["window_refusals"] >= 3 and stats["leases_pending"] == 2 and stats["trajectories_queued"] == 1
    await coord.set_inflight_limit(0)  # unbounded again
    assert len(await coord.claim("w3", 10)) == 5


async def test_expired_and_released_leases_count_as_queued_and_the_lease_table_agrees(
        make_coord: CoordFactory) -> None:
    # The dashboard once showed 8 leased groups while both workers held none: expired and released
    # entries stay in Redis's pending list. They are queued, not leased, and the table says who holds what.
    coord = make_coord(lease_ttl_s=0.3)
    await coord.enqueue(groups(4))
    held = await coord.claim("w1", 2)
    released = await coord.claim("w2", 2)
    await coord.release(released[0])
    table = await coord.leases()
    assert {(r["holder"], r["reclaims"]) for r in table if r["holder"] == "w1"} == {("w1", 0)}
    assert all(0 < r["expires_in_s"] <= 0.3 for r in table if r["holder"] == "w1")
    stats = await coord.stats()
    assert (stats["leases_pending"], stats["leases_expired"], stats["prompts_queued"]) == (3, 1, 1)
    await asyncio.sleep(0.35)  # nobody heartbeats: every lease expires
    stats = await coord.stats()
    assert (stats["leases_pending"], stats["leases_expired"], stats["prompts_queued"]) == (0, 4, 4)
    assert all(r["expires_in_s"] <= 0 for r in await coord.leases())
    again = await coord.claim("w3", 4)  # reclaims the expired ones
    assert {lease.group_id for lease in again} >= {lease.group_id for lease in held}
    table = {r["entry_id"]: r for r in await coord.leases()}
    for lease in held:
        assert table[lease.entry_id]["holder"] == "w3" and table[lease.entry_id]["reclaims"] >= 1
    assert (await coord.stats())["leases_pending"] == len(again)
