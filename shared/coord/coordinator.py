"""Coordinator: the one object trainer and rollout workers use to talk through Redis.

Prompt groups live in a stream read by a consumer group; a lease is a pending entry, a heartbeat
resets its idle time, and an entry idle for a lease TTL is reclaimed by the next claim. Every
state change runs as one Lua script (scripts.py). Formulas and guarantees: docs/coordination.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar, cast

import redis.asyncio as aioredis
from pydantic import ValidationError
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ResponseError

from shared.coord import scripts
from shared.coord.errors import CoordError, QueueFull
from shared.coord.keys import Keys
from shared.coord.leases import Lease
from shared.coord.scheduling import claim_size as scheduled_claim_size
from shared.coord.settings import CoordSettings
from shared.coord.stats import counters_from_hash, decode
from shared.schemas import PromptGroup, Trajectory, WorkerInfo, one_line_error

log = logging.getLogger(__name__)
T = TypeVar("T")

TRAINER_GROUP = "trainer"
# Dead-letter entries keep at most this much of a malformed payload, so one bad producer cannot
# bloat the dead-letter stream.
MAX_DEAD_PAYLOAD = 64 * 1024
# Error text kept per failed attempt (a traceback's last line is enough to act on).
MAX_ERROR_TEXT = 2000
# Socket bounds of a coordination client: the longest blocking read we issue is ~1 s, so a call
# silent for 15 s means a dead peer (the loop retries) rather than a slow answer.
SOCKET_TIMEOUT_S = 15.0
CONNECT_TIMEOUT_S = 5.0


def connect(url: str) -> aioredis.Redis:
    """The Redis client every service uses for coordination: bounded connect and read times, so a
    vanished Redis surfaces as an error instead of a call that hangs, and no retries inside the
    client: the services' loops retry (shared.retry), so every dropped connection is seen, logged
    once per outage and counted, in one place."""
    return aioredis.Redis.from_url(
        url,
        socket_timeout=SOCKET_TIMEOUT_S,
        socket_connect_timeout=CONNECT_TIMEOUT_S,
        retry=Retry(NoBackoff(), 0),
    )


def lost_streams(exc: BaseException) -> bool:
    """True for the errors Redis answers when a run's streams or consumer groups are gone (its data
    was lost, or the keys deleted while a read blocked)."""
    return isinstance(exc, ResponseError) and any(m in str(exc) for m in ("NOGROUP", "UNBLOCKED"))


class Coordinator:
    def __init__(self, redis: aioredis.Redis, prefix: str, settings: CoordSettings | None = None, *,
                 run: str) -> None:
        self.redis = redis
        self.keys = Keys(prefix, run)
        self.settings = settings or CoordSettings()
        self._scripts = {
            name: redis.register_script(getattr(scripts, name))
            for name in (
                "ENQUEUE",
                "CLAIM",
                "HEARTBEAT",
                "RELEASE",
                "COMPLETE",
                "DEAD_LETTER",
                "FAIL",
                "MISSING",
                "REQUEUE",
                "EPOCH",
            )
        }
        self._ready = False
        # Times this process found the run's streams gone and created them again (Redis data loss).
        self.stream_resets = 0
        # Trajectories a previous trainer process read but had not acknowledged when it died
        # are still pending for the trainer consumer; the first read hands them out again.
        self._trainer_backlog = True

    async def setup(self) -> None:
        """Create the streams and consumer groups (idempotent; every method calls it once)."""
        if self._ready:
            return
        for stream, group in (
            (self.keys.prompts, self.settings.consumer_group),
            (self.keys.trajectories, TRAINER_GROUP),
        ):
            try:
                await self.redis.xgroup_create(stream, group, id="0", mkstream=True)
            except ResponseError as e:
                if "BUSYGROUP" not in str(e):
                    raise
        self._ready = True

    async def _recreate_streams(self, exc: BaseException) -> None:
        self.stream_resets += 1
        log.warning("run %s: streams or consumer groups gone (%s); creating them again", self.keys.base, exc)
        await self.reset()

    async def reset(self) -> None:
        """Create the streams and groups again (after Redis lost them) and re-read any trajectories
        still pending for the trainer."""
        self._ready = False
        self._trainer_backlog = True
        await self.setup()

    async def _guarded(self, call: Callable[[], Awaitable[T]]) -> T:
        """Run call; if the run's streams are gone (Redis lost its data), create them and run it once
        more, so every process keeps working on the empty streams (the trainer re-enqueues)."""
        await self.setup()
        try:
            return await call()
        except ResponseError as exc:
            if not lost_streams(exc):
                raise
            await self._recreate_streams(exc)
            return await call()

    async def _script(self, name: str, keys: list[str], args: list[Any]) -> Any:
        return await self._guarded(lambda: self._scripts[name](keys=keys, args=args))

    # ---- prompts and leases -------------------------------------------------------------------

    async def enqueue(self, groups: Sequence[PromptGroup]) -> list[str]:
        """Queue prompt groups, all or none; returns their stream entry ids. Raises QueueFull."""
        if not groups:
            return []
        args: list[Any] = [self.settings.max_queue]
        for g in groups:
            args += [g.id, g.model_dump_json()]
        ok, result = await self._script("ENQUEUE", [self.keys.prompts, self.keys.stats], args)
        if not ok:
            raise QueueFull(int(result), len(groups), self.settings.max_queue)
        return [decode(i) for i in result]

    async def check_room(self, count: int) -> None:
        """Raise QueueFull (and count the refusal) unless `count` more groups fit the queue now: a
        submitter refuses before it records anything. enqueue checks again, atomically."""
        depth = int(await self.redis.xlen(self.keys.prompts))
        if depth + count > self.settings.max_queue:
            await self.redis.hincrby(self.keys.stats, "refused", count)
            raise QueueFull(depth, count, self.settings.max_queue)

    async def claim(self, worker_id: str, max_groups: int, block_ms: int = 0) -> list[Lease]:
        """Lease up to max_groups groups: expired leases first, then new groups.

        Returns [] when the worker's registered weights lag the trainer by more than
        staleness_bound (after waiting block_ms, so a polling loop does not spin). With
        block_ms > 0 and nothing available, waits up to block_ms for new groups.
        """
        if max_groups <= 0:
            return []
        s = self.settings
        reply = await self._script(
            "CLAIM",
            [
                self.keys.prompts,
                self.keys.dead,
                self.keys.stats,
                self.keys.worker(worker_id),
                self.keys.trainer_version,
                self.keys.reclaim_cursor,
                self.keys.trajectories,
                self.keys.inflight_limit,
            ],
            [s.consumer_group, worker_id, max_groups, s.lease_ttl_ms, s.max_attempts, s.staleness_bound],
        )
        if not reply[0]:
            if block_ms > 0:
                await asyncio.sleep(block_ms / 1000)
            return []
        entries = [(decode(e[0]), int(e[1]), e[2]) for e in reply[1]]
        if not entries and block_ms > 0:
            fresh: Any = await self._guarded(lambda: self.redis.xreadgroup(
                s.consumer_group, worker_id, {self.keys.prompts: ">"}, count=int(reply[2]), block=block_ms
            ))
            if fresh:
                entries = [(decode(i), 1, fields) for i, fields in fresh[0][1]]
                await self.redis.hincrby(self.keys.stats, "claimed", len(entries))
        return [lease for e in entries if (lease := await self._to_lease(worker_id, *e)) is not None]

    async def _to_lease(self, worker_id: str, entry_id: str, attempt: int, fields: Any) -> Lease | None:
        """Parse a delivered entry; a malformed one is dead-lettered with the reason, not raised."""
        if isinstance(fields, dict):
            pairs = {decode(k): decode(v) for k, v in fields.items()}
        else:  # Lua replies are flat [field, value, ...] arrays
            pairs = {decode(fields[i]): decode(fields[i + 1]) for i in range(0, len(fields) - 1, 2)}
        payload = pairs.get("group")
        try:
            if payload is None:
                raise ValueError(f"entry has no 'group' field (fields: {sorted(pairs)[:10]})")
            group = PromptGroup.model_validate_json(payload)
        except (ValidationError, ValueError) as e:
            reason = f"malformed: {one_line_error(e, 'entry')}"
            raw = payload if payload is not None else repr(pairs)
            await self._dead_letter(worker_id, entry_id, attempt, reason, raw[:MAX_DEAD_PAYLOAD], "malformed",
                                    pairs.get("id", ""))
            return None
        return Lease(entry_id, worker_id, attempt, group, time.time())

    async def heartbeat_leases(self, leases: Sequence[Lease]) -> list[Lease]:
        """Extend leases (call every settings.heartbeat_interval_s). Returns those still held;
        a lease missing from the result was reclaimed or finished elsewhere: stop working on it."""
        if not leases:
            return []
        by_worker: dict[str, list[Lease]] = {}
        for lease in leases:
            by_worker.setdefault(lease.worker_id, []).append(lease)
        held: list[Lease] = []
        for worker_id, own in by_worker.items():
            args: list[Any] = [self.settings.consumer_group, worker_id]
            for lease in own:
                args += [lease.entry_id, lease.attempt]
            ids = {decode(i) for i in await self._script("HEARTBEAT", [self.keys.prompts], args)}
            held += [lease for lease in own if lease.entry_id in ids]
        return held

    async def release(self, lease: Lease) -> bool:
        """Give a lease back for another worker to claim at once; does not use up an attempt.
        For groups this worker cannot process, use reject() so they do not circulate forever."""
        s = self.settings
        done = await self._script(
            "RELEASE",
            [self.keys.prompts, self.keys.stats],
            [s.consumer_group, lease.worker_id, lease.entry_id, lease.attempt, s.lease_ttl_ms],
        )
        return bool(done)

    async def reject(self, lease: Lease, reason: str) -> bool:
        """Dead-letter a leased group with a reason (e.g. a prompt longer than the context)."""
        payload = lease.group.model_dump_json()
        return await self._dead_letter(
            lease.worker_id, lease.entry_id, lease.attempt, reason, payload, "worker_rejected", lease.group_id
        )

    async def fail(self, lease: Lease, error: str) -> str:
        """Processing this group failed (its reward raised, ...): the attempt stays used and the
        error is recorded; the group goes back to the queue, or to the dead letters after
        max_attempts. Returns "retry", "dead" or "lost" (the lease was no longer held)."""
        s = self.settings
        done = await self._script(
            "FAIL",
            [self.keys.prompts, self.keys.dead, self.keys.stats, self.keys.failures],
            [s.consumer_group, lease.worker_id, lease.entry_id, lease.attempt, lease.group_id,
             error[:MAX_ERROR_TEXT], s.max_attempts, s.lease_ttl_ms, lease.group.model_dump_json()],
        )
        return {0: "lost", 1: "retry", 2: "dead"}[int(done)]

    async def failures(self) -> dict[str, str]:
        """group id -> "attempt worker_id: error" of the last failed attempt of each group."""
        return {decode(k): decode(v) for k, v in (await self.redis.hgetall(self.keys.failures)).items()}

    async def _dead_letter(
        self,
        worker_id: str,
        entry_id: str,
        attempt: int,
        reason: str,
        payload: str,
        counter: str,
        group_id: str,
    ) -> bool:
        done = await self._script(
            "DEAD_LETTER",
            [self.keys.prompts, self.keys.dead, self.keys.stats],
            [self.settings.consumer_group, worker_id, entry_id, attempt, reason, payload, counter, group_id],
        )
        return bool(done)

    async def complete(self, lease: Lease, trajectory: Trajectory) -> bool:
        """Publish the trajectory and finish the lease atomically. True when this result is the
        one counted for the group; False when the group was already completed (or dead-lettered).
        """
        call = self._complete_call(lease, trajectory)
        result = await self._script("COMPLETE", call["keys"], call["args"])
        return int(result) == 1

    async def complete_many(self, items: Sequence[tuple[Lease, Trajectory]]) -> list[bool]:
        """complete() for a batch that finished together (one engine.generate over the claimed
        groups), in one round trip. Each completion is still its own atomic script."""
        if not items:
            return []
        await self.setup()
        calls = [self._complete_call(lease, trajectory) for lease, trajectory in items]
        async with self.redis.pipeline(transaction=False) as pipe:
            for call in calls:
                await self._scripts["COMPLETE"](**call, client=pipe)
            results = await pipe.execute(raise_on_error=False)
        for i, result in enumerate(results):
            if isinstance(result, Exception):  # e.g. the streams vanished: this one alone again
                if not lost_streams(result):
                    raise result
                results[i] = await self._script("COMPLETE", calls[i]["keys"], calls[i]["args"])
        return [int(r) == 1 for r in results]

    def _complete_call(self, lease: Lease, trajectory: Trajectory) -> dict[str, list[Any]]:
        if trajectory.group_id != lease.group_id:
            raise ValueError(f"trajectory is for group {trajectory.group_id!r}, lease for {lease.group_id!r}")
        return {
            "keys": [self.keys.prompts, self.keys.completed, self.keys.trajectories, self.keys.stats],
            "args": [
                self.settings.consumer_group,
                lease.worker_id,
                lease.entry_id,
                lease.attempt,
                lease.group_id,
                trajectory.model_dump_json(),
            ],
        }

    async def leases(self, count: int = 100) -> list[dict[str, Any]]:
        """Leases held now, oldest first (Redis's pending-entries list of the prompt stream):
        entry id, holder (worker id), seconds until the lease expires unless heartbeated, and
        reclaims (deliveries after the first: the group went to another worker, or back to this one)."""
        ttl_s = self.settings.lease_ttl_ms / 1000
        rows = await self._guarded(lambda: self.redis.xpending_range(
            self.keys.prompts, self.settings.consumer_group, min="-", max="+", count=count))
        return [{
            "entry_id": decode(cast(bytes | str, row["message_id"])),
            "holder": decode(cast(bytes | str, row["consumer"])),
            "expires_in_s": round(ttl_s - int(row["time_since_delivered"]) / 1000, 1),
            "reclaims": max(0, int(row["times_delivered"]) - 1),
        } for row in rows]

    async def dead_letters(self, count: int = 100) -> list[dict[str, str]]:
        """The oldest dead-letter entries, each with entry_id, group (raw payload), reason, ..."""
        rows: Any = await self.redis.xrange(self.keys.dead, count=count)
        return [{decode(k): decode(v) for k, v in fields.items()} | {"id": decode(i)} for i, fields in rows]

    # ---- trajectories -------------------------------------------------------------------------

    async def next_trajectories(
        self, max_count: int = 64, min_version: int | None = None, block_ms: int = 0
    ) -> list[Trajectory]:
        """Take up to max_count trajectories for the trainer. Those with policy_version below
        min_version (default: trainer version − max_lag) are dropped and counted, never returned."""
        if min_version is None:
            min_version = await self.trainer_version() - self.settings.max_lag
        try:
            return await self._take_trajectories(max_count, min_version, block_ms)
        except BaseException:
            # What was read may still be pending for the trainer consumer: read it again first.
            self._trainer_backlog = True
            raise

    async def _take_trajectories(self, max_count: int, min_version: int, block_ms: int) -> list[Trajectory]:
        rows: Any = []
        reply: Any
        if self._trainer_backlog:
            reply = await self._guarded(lambda: self.redis.xreadgroup(
                TRAINER_GROUP, TRAINER_GROUP, {self.keys.trajectories: "0"}, count=max_count
            ))
            rows = reply[0][1] if reply else []
            self._trainer_backlog = bool(rows)
        if not rows:
            reply = await self._guarded(lambda: self.redis.xreadgroup(
                TRAINER_GROUP,
                TRAINER_GROUP,
                {self.keys.trajectories: ">"},
                count=max_count,
                block=block_ms if block_ms > 0 else None,
            ))
            if not reply:
                return []
            rows = reply[0][1]
        ids = [decode(i) for i, _ in rows]
        kept: list[Trajectory] = []
        stale = malformed = 0
        for _, fields in rows:
            raw = fields.get(b"trajectory", fields.get("trajectory"))
            try:
                trajectory = Trajectory.model_validate_json(raw)
            except (ValidationError, ValueError, TypeError):
                malformed += 1
                continue
            if trajectory.policy_version < min_version:
                stale += 1
            else:
                kept.append(trajectory)
        # Taken means consumed: ack and delete so the stream holds only unread results; the counters
        # in the same transaction, so a dropped connection leaves all of it or none.
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.xack(self.keys.trajectories, TRAINER_GROUP, *ids)
            pipe.xdel(self.keys.trajectories, *ids)
            pipe.hincrby(self.keys.stats, "trajectories_read", len(kept))
            pipe.hincrby(self.keys.stats, "dropped_stale", stale)
            pipe.hincrby(self.keys.stats, "malformed_trajectories", malformed)
            await pipe.execute()
        return kept

    # ---- workers, versions, scheduling --------------------------------------------------------

    async def register_worker(self, info: WorkerInfo) -> None:
        """Create or refresh a worker's entry; it expires after settings.worker_ttl_s."""
        key = self.keys.worker(info.worker_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(
                key,
                mapping={
                    "info": info.model_dump_json(),
                    # Read by the claim script to refuse workers with stale weights.
                    "weight_version": info.weight_version,
                },
            )
            pipe.pexpire(key, int(self.settings.worker_ttl_s * 1000))
            pipe.sadd(self.keys.workers, info.worker_id)
            await pipe.execute()

    async def deregister_worker(self, worker_id: str) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(self.keys.worker(worker_id))
            pipe.srem(self.keys.workers, worker_id)
            await pipe.execute()

    async def workers(self) -> list[WorkerInfo]:
        """Live workers (entries refreshed within worker_ttl_s), sorted by id."""
        ids = sorted(decode(i) for i in await self.redis.smembers(self.keys.workers))
        if not ids:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for worker_id in ids:
                pipe.hget(self.keys.worker(worker_id), "info")
            raws = await pipe.execute()
        live: list[WorkerInfo] = []
        expired: list[str] = []
        for worker_id, raw in zip(ids, raws, strict=True):
            if raw is None:
                expired.append(worker_id)
            else:
                live.append(WorkerInfo.model_validate_json(raw))
        if expired:
            await self.redis.srem(self.keys.workers, *expired)
        return live

    async def claim_size(self, worker_id: str) -> int:
        """Groups this worker should claim next (scheduling.py); 0 while its weights lag."""
        fleet = await self.workers()
        me = next((w for w in fleet if w.worker_id == worker_id), None)
        return scheduled_claim_size(me, fleet, await self.trainer_version(), self.settings)

    async def set_trainer_version(self, version: int) -> None:
        await self.redis.set(self.keys.trainer_version, int(version))

    async def set_inflight_limit(self, groups: int) -> None:
        """Bound groups leased + trajectories unread (0 = unbounded). The trainer sets it to
        (max_lag − staleness_bound) × groups per step, so no trajectory outlives max_lag."""
        await self.redis.set(self.keys.inflight_limit, max(0, int(groups)))

    async def trainer_version(self) -> int:
        raw = await self.redis.get(self.keys.trainer_version)
        return int(raw) if raw is not None else 0

    # ---- recovery from lost Redis data (the trainer's side) -----------------------------------

    async def check_epoch(self, token: str) -> bool:
        """Make the run's epoch key hold `token`. False when the key was missing: Redis lost the
        run's data (restarted empty, or flushed), and the caller must restore what only it knows.
        Raises CoordError when another process holds the run with a different token."""
        state, current = await self._scripts["EPOCH"](keys=[self.keys.epoch], args=[token])
        if int(state) < 0:
            raise CoordError(f"run {self.keys.base} is held by another trainer (epoch {decode(current)})")
        return int(state) == 1

    async def missing(self, group_ids: Sequence[str]) -> tuple[list[str], list[str]]:
        """Of these groups, (those in no stream: neither queued, leased, completed-unread nor
        dead-lettered; those dead-lettered). One atomic read."""
        if not group_ids:
            return [], []
        keys = [self.keys.prompts, self.keys.trajectories, self.keys.dead]
        gone, dead = await self._scripts["MISSING"](keys=keys, args=list(group_ids))
        return [decode(i) for i in gone], [decode(i) for i in dead]

    async def requeue(self, groups: Sequence[PromptGroup]) -> list[str]:
        """Enqueue again each group that is in no stream (checked atomically), clearing its
        completion mark; returns the ids queued. The caller must know the groups were not trained."""
        if not groups:
            return []
        args: list[Any] = []
        for g in groups:
            args += [g.id, g.model_dump_json()]
        keys = [
            self.keys.prompts,
            self.keys.trajectories,
            self.keys.dead,
            self.keys.completed,
            self.keys.stats,
        ]
        return [decode(i) for i in await self._script("REQUEUE", keys, args)]

    # ---- observability ------------------------------------------------------------------------

    async def stats(self) -> dict[str, int]:
        """Flat numbers for /metrics: depths and leases now, plus the shared counters. Reads only:
        with the streams gone (Redis lost its data) the depths are simply 0."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xlen(self.keys.prompts)
            pipe.xpending(self.keys.prompts, self.settings.consumer_group)
            # Pending entries idle past the lease TTL are not held by anyone: expired leases and
            # released ones (parked idle at the TTL) wait for the next claim, i.e. they are queued.
            pipe.xpending_range(self.keys.prompts, self.settings.consumer_group, min="-", max="+",
                                count=self.settings.max_queue + 1, idle=self.settings.lease_ttl_ms)
            pipe.xlen(self.keys.trajectories)
            pipe.xlen(self.keys.dead)
            pipe.hlen(self.keys.completed)
            pipe.scard(self.keys.workers)
            pipe.get(self.keys.trainer_version)
            pipe.hgetall(self.keys.stats)
            results = await pipe.execute(raise_on_error=False)
        for result in results:
            if isinstance(result, Exception) and not lost_streams(result):
                raise result
        in_stream, pending, expired, trajectories, dead, completed, workers, version, counters = results
        unheld = 0 if isinstance(expired, Exception) else len(expired)
        leased = 0 if isinstance(pending, Exception) else max(0, int(pending["pending"]) - unheld)
        return {
            "prompts_queued": in_stream - leased,
            "leases_pending": leased,
            "leases_expired": unheld,
            "trajectories_queued": trajectories,
            "dead_letter_depth": dead,
            "groups_completed": completed,
            "workers_registered": workers,
            "trainer_version": int(version) if version is not None else 0,
            **counters_from_hash(counters),
        }

