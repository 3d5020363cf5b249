"""Coordination under faults (issue 13), against the shared real Redis: expired leases reclaimed
before the in-flight window (row 2), failed attempts counted and dead-lettered with their error
(row 3), two runs on one prefix kept apart (row 9), lost groups found and queued again (row 1b)."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from shared.coord import CoordError, Coordinator, CoordSettings
from shared.schemas import PromptGroup
from tests.integration.conftest import CoordFactory
from tests.integration.coord.test_coord_queue import groups, trajectory


async def test_window_full_of_a_dead_workers_leases_is_reclaimed(make_coord: CoordFactory) -> None:
    """Row 2: a worker dies holding the whole in-flight window; the next claim must reclaim."""
    coord = make_coord(lease_ttl_s=0.2)
    await coord.enqueue(groups(6))
    await coord.set_inflight_limit(4)
    held = await coord.claim("doomed", 4)
    assert len(held) == 4
    assert await coord.claim("rescuer", 4) == []  # leases still live: the window is full
    await asyncio.sleep(0.3)  # the doomed worker never heartbeats again
    rescued = await coord.claim("rescuer", 4)
    assert sorted(lease.group_id for lease in rescued) == sorted(lease.group_id for lease in held)
    assert all(lease.attempt == 2 for lease in rescued)
    assert await coord.claim("third", 4) == []  # reclaimed leases still fill the window
    for lease in rescued:
        assert await coord.complete(lease, trajectory(lease))
    assert len(await coord.next_trajectories(10)) == 4
    assert [lease.group_id for lease in await coord.claim("third", 4)] == ["g4", "g5"]
    stats = await coord.stats()
    assert stats["reclaims"] == 4 and stats["completions"] == 4


async def test_reclaim_does_not_exceed_what_the_caller_asked(make_coord: CoordFactory) -> None:
    coord = make_coord(lease_ttl_s=0.1)
    await coord.enqueue(groups(3))
    await coord.set_inflight_limit(3)
    await coord.claim("doomed", 3)
    await asyncio.sleep(0.15)
    assert len(await coord.claim("a", 2)) == 2
    assert [lease.attempt for lease in await coord.claim("b", 5)] == [2]


async def test_failed_group_counts_attempts_and_is_dead_lettered_with_its_error(
    make_coord: CoordFactory,
) -> None:
    """Row 3: each failure uses an attempt and records the error; the last one dead-letters."""
    coord = make_coord(max_attempts=3, lease_ttl_s=30)
    await coord.enqueue(groups(2))
    poison, good = await coord.claim("w1", 2)
    assert await coord.fail(poison, "ValueError: countdown answer must look like '3 7 25 -> 46'") == "retry"
    assert await coord.complete(good, trajectory(good))
    assert await coord.fail(poison, "again") == "lost"  # that attempt is over
    for attempt in (2, 3):
        [again] = await coord.claim(f"w{attempt}", 5)  # at once, not after the 30 s TTL
        assert (again.group_id, again.attempt) == (poison.group_id, attempt)
        outcome = await coord.fail(again, f"ValueError: attempt {attempt}")
    assert outcome == "dead"
    assert await coord.claim("w4", 5) == []
    [dead] = await coord.dead_letters()
    assert dead["group_id"] == poison.group_id and dead["attempts"] == "3" and dead["worker_id"] == "w3"
    assert dead["reason"] == "failed: 3 attempts; last error: ValueError: attempt 3"
    assert (await coord.failures())[poison.group_id] == "3 w3: ValueError: attempt 3"
    stats = await coord.stats()
    assert (stats["failures"], stats["failed_groups"], stats["dead_letters"]) == (3, 1, 1)
    assert (stats["completions"], stats["leases_pending"], stats["prompts_queued"]) == (1, 0, 0)


async def test_two_runs_on_one_prefix_never_share_a_queue(redis_url: str, redis_prefix: str) -> None:
    """Row 9: every key carries the run; a worker of run b never sees run a's groups."""
    client = aioredis.from_url(redis_url)
    try:
        a = Coordinator(client, redis_prefix, CoordSettings(), run="a")
        b = Coordinator(client, redis_prefix, CoordSettings(), run="b")
        await a.enqueue(groups(2))
        await a.set_trainer_version(5)
        await a.set_inflight_limit(1)
        assert await b.claim("wb", 4) == []
        assert await b.trainer_version() == 0
        await b.enqueue(groups(3))
        assert len(await b.claim("wb", 4)) == 3  # a's window does not bound b
        assert [lease.group_id for lease in await a.claim("wa", 4)] == ["g0"]
        assert (await a.stats())["enqueued"] == 2 and (await b.stats())["enqueued"] == 3
        keys = [k.decode() async for k in client.scan_iter(match=f"{redis_prefix}*")]
        assert keys and all(k.startswith((f"{redis_prefix}:a:", f"{redis_prefix}:b:")) for k in keys), keys
        with pytest.raises(ValueError, match="run"):
            Coordinator(client, redis_prefix, CoordSettings(), run="")
    finally:
        await client.aclose()


async def test_missing_groups_are_found_and_queued_again_once(make_coord: CoordFactory) -> None:
    """Row 1b: groups in no stream (lost with Redis's data, or completed and then dropped as stale)
    are found in one atomic read and queued again, their completion mark cleared."""
    coord = make_coord(max_attempts=1, lease_ttl_s=30)
    everything = groups(5)
    await coord.enqueue(everything[:4])  # g4 never reached Redis
    leases = await coord.claim("w1", 3)
    await coord.complete(leases[0], trajectory(leases[0]))  # g0: completed, unread
    await coord.complete(leases[1], trajectory(leases[1], version=0))
    await coord.set_trainer_version(10)
    assert await coord.next_trajectories(10, min_version=5) == []  # g0 and g1 dropped as stale
    await coord.reject(leases[2], "prompt too long")  # g2: dead-lettered
    missing, dead = await coord.missing([g.id for g in everything])
    assert sorted(missing) == ["g0", "g1", "g4"] and dead == ["g2"]  # g3 is still queued
    assert sorted(await coord.requeue([g for g in everything if g.id in missing])) == ["g0", "g1", "g4"]
    assert await coord.requeue(everything) == []  # all present now: nothing twice
    claimed = await coord.claim("w2", 10)
    assert sorted(lease.group_id for lease in claimed) == ["g0", "g1", "g3", "g4"]
    assert all(await coord.complete_many([(lease, trajectory(lease, version=10)) for lease in claimed]))
    stats = await coord.stats()
    assert stats["requeued"] == 3 and stats["completions"] == 6 and stats["duplicates"] == 0


async def test_epoch_detects_lost_data_and_a_second_trainer(make_coord: CoordFactory) -> None:
    coord = make_coord()
    assert not await coord.check_epoch("t1")  # first time: the key was missing
    assert await coord.check_epoch("t1")
    with pytest.raises(CoordError, match="another trainer"):
        await coord.check_epoch("t2")
    await coord.redis.delete(coord.keys.epoch)  # what a Redis that lost its data looks like
    assert not await coord.check_epoch("t1")


async def test_every_call_survives_its_streams_vanishing(make_coord: CoordFactory) -> None:
    """Row 1b: with the run's keys gone (Redis restarted empty), calls re-create the streams instead
    of failing with NOGROUP, and stats read zeros without writing."""
    coord = make_coord()
    await coord.enqueue(groups(2))
    [lease] = await coord.claim("w1", 1)
    keys = [k async for k in coord.redis.scan_iter(match=f"{coord.keys.base}:*")]
    await coord.redis.delete(*keys)
    assert (await coord.stats())["prompts_queued"] == 0
    assert not await coord.redis.exists(coord.keys.prompts)  # stats did not write
    assert not await coord.complete(lease, trajectory(lease))  # its entry is gone: not counted
    assert await coord.heartbeat_leases([lease]) == []
    assert await coord.next_trajectories(5) == []
    await coord.enqueue([PromptGroup(id="after", task="addition", prompt="1+1=", answer="2", samples=1)])
    assert [lease.group_id for lease in await coord.claim("w1", 5)] == ["after"]
    assert coord.stream_resets >= 1
