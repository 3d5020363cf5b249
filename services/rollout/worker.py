"""The lease-driven rollout loop: claim prompt groups, generate, score, complete exactly once.

A worker holds nothing worth keeping: if it dies, its leases expire and another worker reclaims
the groups (shared.coord). Claims follow the scheduler's claim size (throughput-proportional, zero
while the weights lag the trainer), so a lagging worker syncs before it takes more work.

Faults: Redis outages are waited out with backoff (shared.retry) and finished results are kept
until their completion lands; a group whose processing fails (its reward function raises, its
prompt breaks the tokenizer) fails alone, with its attempt counted and the error recorded
(Coordinator.fail), never the worker or the other groups of its batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from services.rollout.core import Batch, RolloutCore
from services.rollout.engine.config import GenerationOutput, KVConfig, SamplingParams
from services.rollout.settings import RolloutSettings
from services.rollout.sync import WeightSync
from shared.agreement import served_kv_policy
from shared.coord import Coordinator, Lease
from shared.health import Liveness
from shared.retry import Outage, transient
from shared.schemas import KVStats, Sample, SamplingInfo, Trajectory, WorkerInfo
from shared.signing import sign_trajectory
from shared.tasks import Task, get_task

log = logging.getLogger(__name__)
LOOP, HEARTBEAT = "worker", "heartbeat"  # loop names in Liveness
T = TypeVar("T")


def batch_seed(leases: list[Lease]) -> int:
    """Sampling seed of one engine batch, a pure function of its groups and delivery attempts.

    Same groups on the same weights give the same samples (reproducible runs), while a redelivered
    group (attempt + 1) draws fresh samples instead of repeating the ones that went missing.
    """
    key = "|".join(f"{lease.group_id}:{lease.attempt}" for lease in leases)
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") >> 1


class RolloutWorker:
    def __init__(self, core: RolloutCore, coord: Coordinator, settings: RolloutSettings,
                 sync: WeightSync | None = None, *, redis: Outage | None = None,
                 liveness: Liveness | None = None) -> None:
        self.core = core
        self.coord = coord
        self.settings = settings
        self.sync = sync
        self.redis = redis or Outage("redis", log)
        self.liveness = liveness or Liveness()
        self.held: list[Lease] = []
        self.completed = 0
        self.duplicates = 0
        self.failed_batches = 0
        self.failed_groups = 0  # attempts that failed here (the group goes back or to the dead letters)
        self._stop = asyncio.Event()

    def info(self) -> WorkerInfo:
        core, s = self.core, self.settings
        kv_policy = served_kv_policy(core.engine.name, s.kv.policy)
        return WorkerInfo(
            worker_id=s.worker_id,
            engine=core.engine.name,
            kv_policy=kv_policy,
            kv_budget=core.kv_config().sparse_budget,  # published or its own
            weight_version=core.weights.version,
            tokens_per_s=core.tokens_per_s,
            download_mbps=self.sync.download_mbps if self.sync else 0.0,
            sync_stall=core.sync_stall.share(),
            leases=len(self.held),
            url=s.advertise_url or None,
            sampling=self._sampling(),
            signs=bool(s.worker_token),
        )

    async def heartbeat(self, stop: asyncio.Event) -> None:
        """Keep the worker entry and every held lease alive while a batch generates."""
        while not stop.is_set():
            self.liveness.beat(HEARTBEAT)
            try:
                await self.coord.register_worker(self.info())
                if self.held:
                    still = {lease.entry_id for lease in await self.coord.heartbeat_leases(self.held)}
                    lost = [lease.group_id for lease in self.held if lease.entry_id not in still]
                    if lost:
                        log.warning("leases lost (reclaimed elsewhere): %s", lost)
                self.redis.ok()
            except Exception as exc:
                if not transient(exc):
                    raise
                self.redis.record(exc)  # a missed beat is tolerated; the next one retries
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=self.settings.coord.heartbeat_interval_s)

    async def _call(self, fn: Callable[[], Awaitable[T]]) -> T:
        """A Redis call that waits out outages (the loop stays alive meanwhile)."""
        return await self.redis.call(fn, self._stop, lambda: self.liveness.beat(LOOP))

    async def run(self, stop: asyncio.Event) -> None:
        self._stop = stop
        beats = asyncio.create_task(self.heartbeat(stop))
        self.liveness.watch(HEARTBEAT, beats, max(60.0, 3 * self.settings.coord.heartbeat_interval_s))
        try:
            while not stop.is_set():
                self.liveness.beat(LOOP)
                try:
                    await self.cycle()
                except Exception as exc:
                    if not transient(exc) or stop.is_set():
                        raise
                    await self.redis.failed(exc, stop)
                    continue
                self.redis.ok()
        finally:
            # Graceful shutdown: whatever is still held goes back to the queue at once.
            for lease in self.held:
                with contextlib.suppress(Exception):
                    await self.coord.release(lease)
            self.held = []
            stop.set()
            beats.cancel()
            with contextlib.suppress(BaseException):
                await beats
            with contextlib.suppress(Exception):
                await self.coord.deregister_worker(self.settings.worker_id)

    async def cycle(self) -> None:
        """One round: claim what the scheduler allows, then generate, score and complete it."""
        size = await self.coord.claim_size(self.settings.worker_id)
        if size == 0:  # lagging: let the weight sync catch up before taking work
            t0 = time.perf_counter()
            await self.coord.register_worker(self.info())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), timeout=0.5)
            self.core.sync_stall.add(time.perf_counter() - t0)
            return
        leases = await self.coord.claim(self.settings.worker_id, size, block_ms=500)
        if leases:
            await self.process(leases)

    async def process(self, leases: list[Lease]) -> None:
        """Generate every claimed group's samples in one engine batch, then complete each lease.
        A group that fails fails alone (Coordinator.fail); finished results wait out a Redis
        outage until their completion lands."""
        self.held = list(leases)
        runnable: list[tuple[Lease, list[int]]] = []
        for lease in leases:
            try:
                ids = self.core.encode(lease.group.prompt)
                reason = self._reject_reason(lease, ids)
            except Exception as exc:  # noqa: BLE001 - whatever this group's data breaks
                await self._fail(lease, exc)
                continue
            if reason:
                await self._call(functools.partial(self.coord.reject, lease, reason))
                self.held.remove(lease)
                continue
            runnable.append((lease, ids))
        if not runnable:
            return
        done: list[tuple[Lease, Trajectory]] = []
        for part in await self._generate(runnable):
            lease, prompt_ids, outputs, batch = part
            try:
                done.append((lease, self._trajectory(lease, prompt_ids, outputs, batch)))
            except Exception as exc:  # noqa: BLE001 - e.g. the task's reward raised on this group's answer
                await self._fail(lease, exc)
        if done:
            results = await self._call(lambda: self.coord.complete_many(done))
            for (lease, _), counted in zip(done, results, strict=True):
                if counted:
                    self.completed += 1
                else:
                    self.duplicates += 1  # finished elsewhere first (our lease was reclaimed): not counted
                self.held.remove(lease)

    async def _generate(
        self, runnable: list[tuple[Lease, list[int]]]
    ) -> list[tuple[Lease, list[int], list, Batch]]:
        """One engine batch for all groups; if it raises, each group alone, so a group that breaks
        the engine fails by itself. Returns (lease, prompt ids, its outputs, batch) per group."""
        try:
            batch = await self._run_engine(runnable)
        except Exception as exc:  # noqa: BLE001 - isolate the group at fault
            self.failed_batches += 1
            if len(runnable) == 1:
                await self._fail(runnable[0][0], exc)
                return []
            log.warning("generation of %d groups failed (%s: %s); trying each group alone", len(runnable),
                        type(exc).__name__, exc)
            parts = []
            for one in runnable:
                parts += await self._generate([one])
            return parts
        parts, offset = [], 0
        for lease, prompt_ids in runnable:
            parts.append((lease, prompt_ids, batch.outputs[offset: offset + lease.group.samples], batch))
            offset += lease.group.samples
        return parts

    async def _run_engine(self, runnable: list[tuple[Lease, list[int]]]) -> Batch:
        max_new = max(self._max_new_tokens(lease) for lease, _ in runnable)
        prompts = [ids for lease, ids in runnable for _ in range(lease.group.samples)]
        sampling = self.settings.sampling
        params = SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p,
                                max_new_tokens=max_new, stop_token_ids=self.core.default_stop_ids(),
                                seed=batch_seed([lease for lease, _ in runnable]))
        return await self.core.generate(prompts, params)  # the KV budget of the weights it runs on

    async def _fail(self, lease: Lease, exc: BaseException) -> None:
        error = f"{type(exc).__name__}: {exc}"
        outcome = await self._call(lambda: self.coord.fail(lease, error))
        self.failed_groups += 1
        log.warning(
            "group %s failed on attempt %d (%s): %s",
            lease.group_id,
            lease.attempt,
            {"retry": "queued again", "dead": "dead-lettered", "lost": "lease already gone"}[outcome],
            error,
        )
        self.held.remove(lease)

    def _reject_reason(self, lease: Lease, ids: list[int]) -> str | None:
        try:
            get_task(lease.group.task)
        except KeyError as exc:
            return f"unknown task: {exc}"
        try:
            self.core.check_lengths([ids], self._max_new_tokens(lease))
        except ValueError as exc:
            return str(exc)
        return None

    def _max_new_tokens(self, lease: Lease) -> int:
        return (lease.group.max_new_tokens or self.settings.max_new_tokens
                or get_task(lease.group.task).max_new_tokens)

    def _sampling(self, kv: KVConfig | None = None) -> SamplingInfo:
        """How this worker samples (the trainer refuses trajectories sampled otherwise than it
        assumes); `kv`: what a batch ran with (default: what the next batch would use)."""
        sampling = self.settings.sampling
        return sampling_info(kv or self.core.kv_config(), sampling.temperature, sampling.top_p,
                             self.core.engine.name)

    def _trajectory(self, lease: Lease, prompt_ids: list[int], outputs: list, batch: Batch) -> Trajectory:
        task = get_task(lease.group.task)
        trajectory = Trajectory(
            group_id=lease.group_id, attempt=lease.attempt, policy_version=batch.version,
            worker_id=self.settings.worker_id, task=lease.group.task, prompt=lease.group.prompt,
            samples=score_samples(task, lease.group.answer or "", prompt_ids, outputs, self.core.decode),
            sampling=self._sampling(batch.kv), created_at=time.time(),
        )
        # Signed by the worker credential: the trainer trains only what a holder of it produced.
        token = self.settings.worker_token
        return sign_trajectory(trajectory, token, self.settings.run) if token else trajectory


def sampling_info(kv: KVConfig, temperature: float, top_p: float = 1.0,
                  engine: str = "native") -> SamplingInfo:
    """What a trajectory says of how it was sampled (also bench.learning's, in-process): the whole
    KV config of a sparse batch travels with it, for the trainer's eviction replay."""
    sparse = kv.policy != "dense"
    return SamplingInfo(temperature=temperature, top_p=top_p, top_k=0, engine=engine, kv_policy=kv.policy,
                        kv_budget=kv.sparse_budget, kv_config=kv.model_dump(mode="json") if sparse else None)


def score_samples(task: Task, answer: str, prompt_ids: list[int], outputs: Sequence[GenerationOutput],
                  decode: Callable[[Sequence[int]], str]) -> list[Sample]:
    """The samples of one prompt: decoded, scored by the task's reward, with the sampler's log-probs
    and KV statistics (also what bench.learning trains on, in-process)."""
    samples = []
    for out in outputs:
        text = decode(out.token_ids)
        reward, correct = task.reward(text, answer)
        samples.append(Sample(
            completion=text, prompt_ids=prompt_ids, completion_ids=list(out.token_ids),
            logprobs=list(out.logprobs), reward=reward, correct=correct,
            finish_reason=out.finish_reason, kv=KVStats.model_validate(out.kv, from_attributes=True),
            evicted_at=out.evicted_at,
        ))
    return samples
