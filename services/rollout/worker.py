"""The lease-driven rollout loop: claim prompt groups, generate, score, complete exactly once.

A worker holds nothing worth keeping: if it dies, its leases expire and another worker reclaims
the groups (shared.coord). Claims follow the scheduler's claim size (throughput-proportional, zero
while the weights lag the trainer), so a lagging worker syncs before it takes more work.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Callable, Sequence

from services.rollout.core import Batch, RolloutCore
from services.rollout.engine.config import GenerationOutput, SamplingParams
from services.rollout.settings import RolloutSettings
from services.rollout.sync import WeightSync
from shared.coord import Coordinator, Lease
from shared.schemas import KVStats, Sample, SamplingInfo, Trajectory, WorkerInfo
from shared.tasks import Task, get_task

log = logging.getLogger(__name__)


def batch_seed(leases: list[Lease]) -> int:
    """Sampling seed of one engine batch, a pure function of its groups and delivery attempts.

    Same groups on the same weights give the same samples (reproducible runs), while a redelivered
    group (attempt + 1) draws fresh samples instead of repeating the ones that went missing.
    """
    key = "|".join(f"{lease.group_id}:{lease.attempt}" for lease in leases)
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") >> 1


class RolloutWorker:
    def __init__(self, core: RolloutCore, coord: Coordinator, settings: RolloutSettings,
                 sync: WeightSync | None = None) -> None:
        self.core = core
        self.coord = coord
        self.settings = settings
        self.sync = sync
        self.held: list[Lease] = []
        self.completed = 0
        self.duplicates = 0
        self.failed_batches = 0

    def info(self) -> WorkerInfo:
        core, s = self.core, self.settings
        kv_policy = "dense" if core.engine.name == "vllm" else s.kv_policy
        return WorkerInfo(
            worker_id=s.worker_id,
            engine=core.engine.name,
            kv_policy=kv_policy,
            kv_budget=None if kv_policy == "dense" else s.kv_budget,
            weight_version=core.weights.version,
            tokens_per_s=core.tokens_per_s,
            download_mbps=self.sync.download_mbps if self.sync else 0.0,
            leases=len(self.held),
            url=s.advertise_url or None,
        )

    async def heartbeat(self, stop: asyncio.Event) -> None:
        """Keep the worker entry and every held lease alive while a batch generates."""
        while not stop.is_set():
            with contextlib.suppress(Exception):  # a missed beat is tolerated; the next one retries
                await self.coord.register_worker(self.info())
                if self.held:
                    still = {lease.entry_id for lease in await self.coord.heartbeat_leases(self.held)}
                    lost = [lease.group_id for lease in self.held if lease.entry_id not in still]
                    if lost:
                        log.warning("leases lost (reclaimed elsewhere): %s", lost)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=self.settings.coord.heartbeat_interval_s)

    async def run(self, stop: asyncio.Event) -> None:
        await self.coord.register_worker(self.info())
        beats = asyncio.create_task(self.heartbeat(stop))
        try:
            while not stop.is_set():
                size = await self.coord.claim_size(self.settings.worker_id)
                if size == 0:  # lagging: let the weight sync catch up before taking work
                    await self.coord.register_worker(self.info())
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), timeout=0.5)
                    continue
                leases = await self.coord.claim(self.settings.worker_id, size, block_ms=500)
                if leases:
                    await self.process(leases)
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

    async def process(self, leases: list[Lease]) -> None:
        """Generate every claimed group's samples in one engine batch, then complete each lease."""
        self.held = list(leases)
        runnable: list[tuple[Lease, list[int]]] = []
        for lease in leases:
            ids = self.core.encode(lease.group.prompt)
            reason = self._reject_reason(lease, ids)
            if reason:
                await self.coord.reject(lease, reason)
                self.held.remove(lease)
                continue
            runnable.append((lease, ids))
        if not runnable:
            return
        max_new = max(self._max_new_tokens(lease) for lease, _ in runnable)
        prompts = [ids for lease, ids in runnable for _ in range(lease.group.samples)]
        params = SamplingParams(temperature=self.settings.temperature, top_p=self.settings.top_p,
                                max_new_tokens=max_new, stop_token_ids=self.core.default_stop_ids(),
                                seed=batch_seed([lease for lease, _ in runnable]))
        kv = self.core.kv_config()
        try:
            batch = await self.core.generate(prompts, params, kv)
        except Exception:
            log.exception("generation failed; releasing %d leases", len(runnable))
            self.failed_batches += 1
            for lease, _ in runnable:
                await self.coord.release(lease)
            self.held = []
            return
        sampling = SamplingInfo(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                                engine=self.core.engine.name, kv_policy=kv.policy,
                                kv_budget=None if kv.policy == "dense" else kv.budget)
        offset = 0
        for lease, prompt_ids in runnable:
            outputs = batch.outputs[offset: offset + lease.group.samples]
            offset += lease.group.samples
            trajectory = self._trajectory(lease, prompt_ids, outputs, batch, sampling)
            if await self.coord.complete(lease, trajectory):
                self.completed += 1
            else:
                self.duplicates += 1  # finished elsewhere first (our lease was reclaimed): not counted
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

    def _trajectory(self, lease: Lease, prompt_ids: list[int], outputs: list, batch: Batch,
                    sampling: SamplingInfo) -> Trajectory:
        task = get_task(lease.group.task)
        return Trajectory(
            group_id=lease.group_id, attempt=lease.attempt, policy_version=batch.version,
            worker_id=self.settings.worker_id, task=lease.group.task, prompt=lease.group.prompt,
            samples=score_samples(task, lease.group.answer or "", prompt_ids, outputs, self.core.decode),
            sampling=sampling, created_at=time.time(),
        )


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
        ))
    return samples
