"""The trainer core: GRPO with Sparse-RL corrections, a sparse patch published every step.

No HTTP here. One step: collect trajectories (Redis) → recompute dense old-policy log-probs →
corrections + PPO-clip loss → AdamW on fp32 master weights → capture the bf16 weights (the
learner keeps the last published ones, whole or one shard per process) → build the patch against
the last published weights → publish to the registry. Building and upload run in the background
while the next batch is collected; the next step waits for the previous publish (and the
checkpoint due after it), so versions stay a chain.

Faults (docs/coordination.md): every call to Redis or the registry rides out outages with backoff
(shared.retry), so a step waits for the registry instead of being dropped; a ledger of prompt
groups (ledger.py) lets the trainer queue again what Redis lost, and never train a group twice.

Progress is the registry's head: step k makes version k, `max_steps` counts versions, and a
restarted trainer goes on at head + 1. The learner's state (master weights, Adam moments, step
counter, RNG) is checkpointed for a version *before* that version is published, so after any crash
the trainer holds the exact state of the head; each manifest lists the groups trained into it, so
the registry, not a ledger row written after the commit, says which groups are trained.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import shutil
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from transformers import AutoTokenizer

from services.trainer.admission import refusal
from services.trainer.distributed import make_learner
from services.trainer.kv_budget import KVBudgetController, evidence_from_step, signal_key
from services.trainer.learner import Captured, LearnerConfig
from services.trainer.ledger import GroupLedger, disk_full, fsync_dir, fsync_tree
from services.trainer.model_dir import resolve_model_dir
from services.trainer.settings import TrainerSettings
from shared.agreement import sampling_mismatch
from shared.coord import Coordinator
from shared.health import Liveness
from shared.patch import PatchHeader, read_header, save_snapshot
from shared.registry.client import RegistryClient
from shared.registry.errors import RegistryHTTPError
from shared.registry.sync import sync_weights
from shared.registry.wire import MODEL_FILES, Manifest, RolloutDirective
from shared.retry import Outage, transient
from shared.schemas import Trajectory
from shared.tasks import get_task

log = logging.getLogger(__name__)
T = TypeVar("T")

LOOP = "trainer"  # the name of the step loop in Liveness
CHECKPOINTS = "checkpoints"  # in the data dir: one folder per version, v00000012
KEEP_CHECKPOINTS = 2  # the head's, and the one before it (the newest may be of an unpublished step)
EVAL_SEED = 424_242  # held-out prompts and their sampling: the same at every evaluation


@dataclass
class TrainerHealth:
    """What the trainer's loops report to /healthz, /readyz and /metrics."""

    redis: Outage = field(default_factory=lambda: Outage("redis", log))
    registry: Outage = field(default_factory=lambda: Outage("registry", log))
    disk: Outage = field(default_factory=lambda: Outage("disk", log))  # the data dir full: waited out
    liveness: Liveness = field(default_factory=Liveness)


class Trainer:
    def __init__(self, settings: TrainerSettings, registry: RegistryClient, coord: Coordinator,
                 model_dir: Path | None = None, *, ledger: GroupLedger | None = None,
                 health: TrainerHealth | None = None) -> None:
        self.settings = settings
        self.registry = registry
        self.coord = coord
        self.health = health or TrainerHealth()
        self.model_dir = model_dir or resolve_model_dir(settings)
        self.data_dir = Path(settings.data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.learner = make_learner(LearnerConfig.of(settings), self.model_dir, pad_id)
        self.version = 0  # the version published (and announced) last
        # The version the learner's state is at: version + 1 between a step's update and its publish.
        self.state_version = 0
        self.dense_bytes, self.numel = self.learner.dense_bytes, self.learner.numel
        self.history: list[dict[str, Any]] = []
        self.metrics_path = self.data_dir / "metrics.jsonl"
        self.checkpoint_root = self.data_dir / CHECKPOINTS
        # Held from a step's update until its checkpoint is written: a checkpoint asked for over
        # HTTP waits, so it never records a state between two versions (nor races a collective).
        self.state_lock = asyncio.Lock()
        self.paused = asyncio.Event()  # set = paused
        self.finished = asyncio.Event()
        self.state = "starting"
        self.last_error: str | None = None
        self._publish_task: asyncio.Task | None = None
        self._pending: list[Trajectory] = []  # collected when a pause came; trained after resume
        # Trajectories refused by the sampling contract, by reason (not trained on; their groups
        # are unsettled, so reconcile queues them again for a worker that samples as assumed).
        self.refused: dict[str, int] = {}
        self._refused_this_step = 0
        self.eval_baseline: dict[str, float] | None = None  # held-out figures before the first step
        self.resumed: dict[str, Any] | None = None  # the checkpoint this process resumed from, checked
        self.ledger = ledger or GroupLedger.in_dir(self.data_dir, settings.run)
        self._ledger_existed = self.ledger.existed
        self.held: set[str] = set()  # groups whose trajectories the trainer holds, not yet published
        self.requeued = 0  # groups queued again because Redis no longer held them
        self.duplicates_dropped = 0  # trajectories of groups already trained or held: never trained twice
        self.redis_data_losses = 0  # times Redis was found without the run's data
        self._next_reconcile = 0.0
        self._stop = asyncio.Event()  # the run's stop event: ends outage waits at shutdown
        # The workers' KV budget published with each version (services.trainer.kv_budget).
        self.kv_control = KVBudgetController(settings.kv_control)

    # -- riding out outages --

    def beat(self) -> None:
        self.health.liveness.beat(LOOP)

    async def _redis(self, fn: Callable[[], Awaitable[T]]) -> T:
        return await self.health.redis.call(fn, self._stop, self.beat)

    async def _registry(self, fn: Callable[[], Awaitable[T]]) -> T:
        return await self.health.registry.call(fn, self._stop, self.beat)

    # -- startup and resume --

    async def start(self, stop: asyncio.Event | None = None) -> None:
        """Resume from the checkpoint of the registry's head (or the newest one before it), settle
        the groups the published versions trained, and make the registry hold our current version.
        Waits (with backoff) for a registry or Redis that is not reachable yet."""
        if stop is not None:
            self._stop = stop
        latest = await self._registry(self.registry.latest)
        checkpoint = self._usable_checkpoint(latest.version if latest is not None else None)
        if checkpoint is not None:
            await asyncio.to_thread(self._load_checkpoint, checkpoint)
        fp = self.learner.published_fingerprint
        if latest is None:
            await self._publish_model_files()
            full = self._cpu(await asyncio.to_thread(self.learner.full_published))
            data = await asyncio.to_thread(save_snapshot, full, run=self.settings.run, version=self.version)
            rollout = self.rollout_directive()
            await self._registry(lambda: self.registry.publish_snapshot(self.version, data, rollout))
            log.info("published snapshot v%d (%s) to a new run %r", self.version, fp, self.settings.run)
        elif latest.version == self.version and latest.fingerprint == fp:
            log.info("registry head v%d matches our weights (%s)", latest.version, fp)
        elif latest.version > self.version:
            # No checkpoint of the head (checkpoint_every > 1, or the data dir was lost): continue
            # from the registry's weights so the chain stays intact. The optimizer state is the
            # older checkpoint's (or fresh): what such a crash costs (docs/coordination.md).
            moments = f"{latest.version - self.version} versions old" if checkpoint is not None else "fresh"
            log.warning("registry is at v%d, the newest usable checkpoint at v%s: loading the registry's "
                        "weights; Adam moments are %s", latest.version,
                        self.version if checkpoint is not None else "-", moments)
            state = self._cpu(await asyncio.to_thread(self.learner.full_published))
            base = self.version if self.version or self.step else None
            result = await self._registry(lambda: sync_weights(self.registry, state, base, latest.version))
            await asyncio.to_thread(self._load_published, state, result.version)
            self.learner.set_step(self.version)  # progress is the head: step k makes version k
        else:
            raise RuntimeError(
                f"registry run {self.settings.run!r} is at v{latest.version} ({latest.fingerprint}) but the "
                f"trainer holds v{self.version} ({fp}): use another run name or the matching checkpoint")
        self.state_version = self.version
        if latest is not None:
            self.resume_kv_control(latest)
            await self._settle_from_registry()
        await self._redis(self.maintain)
        if self.settings.eval_every and self.step == 0:
            self.eval_baseline = await asyncio.to_thread(self.evaluate)
            log.info("held-out accuracy before training: %.3f", self.eval_baseline["heldout_accuracy"])
        self.state = "running"

    async def _settle_from_registry(self) -> None:
        """Mark trained every group a published version lists that the ledger does not: a crash
        between the registry's commit and the ledger row must not let a group be trained again."""
        manifests = await self._registry(self.registry.versions)
        settled = 0
        for manifest in sorted(manifests, key=lambda m: m.version):
            fresh = [g for g in manifest.groups if g not in self.ledger.trained]
            if fresh:
                await self._on_disk(functools.partial(self.ledger.settle_trained, fresh, manifest.version))
                settled += len(fresh)
        if settled:
            log.warning("%d groups were trained into published versions the ledger had not recorded "
                        "(a crash after a publish): settled, not trained again", settled)

    async def _publish_model_files(self) -> None:
        for name in MODEL_FILES:
            path = self.model_dir / name
            if path.is_file():
                data = path.read_bytes()
                await self._registry(functools.partial(self.registry.put_model_file, name, data))

    def resume_kv_control(self, head: Manifest) -> None:
        """Continue the KV budget from the head manifest (what the workers use now), not from the
        controller's start; a checkpoint's controller state is older or the same."""
        self.kv_control.resume(head.rollout.kv_budget, head.metrics, head.version)

    def rollout_directive(self) -> RolloutDirective:
        return RolloutDirective(kv_budget=self.kv_control.budget)

    def _load_published(self, state: dict[str, torch.Tensor], version: int) -> None:
        self.learner.load_published(state)
        self.version = version

    @property
    def step(self) -> int:
        return self.learner.step

    @staticmethod
    def _cpu(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.cpu() for k, v in state.items()}

    # -- the loop --

    async def run(self, stop: asyncio.Event) -> None:
        self._stop = stop
        try:
            while not stop.is_set():
                self.beat()
                if self.done:
                    break
                if self.paused.is_set():
                    self.state = "paused"
                    await asyncio.sleep(0.2)
                    continue
                self.state = "collecting"
                trajectories = await self.collect(stop)
                if not trajectories:
                    continue
                await self.wait_published()  # versions stay a chain
                self.state = "training"
                t0 = time.perf_counter()
                target = self.version + 1
                async with self.state_lock:
                    metrics = await asyncio.to_thread(self.train_step, trajectories)
                    metrics["train_seconds"] = time.perf_counter() - t0
                    t_capture = time.perf_counter()
                    every = self.settings.publish.snapshot_every
                    snapshot = bool(every and target % every == 0)
                    captured = await asyncio.to_thread(self.learner.capture, snapshot)
                    metrics["capture_seconds"] = time.perf_counter() - t_capture
                    self.state_version = target
                    # The state of `target` is on disk before `target` exists anywhere else.
                    every = self.settings.checkpoint_every
                    if every and target % every == 0:
                        t_save = time.perf_counter()
                        await self._on_disk(self.save_checkpoint)
                        metrics["checkpoint_seconds"] = time.perf_counter() - t_save
                group_ids = [t.group_id for t in trajectories]
                self._publish_task = asyncio.create_task(
                    self.publish(captured, metrics, t0, group_ids, self.rollout_directive()))
            await self.wait_published()
        finally:
            published = self.settings.max_steps and self.version >= self.settings.max_steps
            self.state = "finished" if published else "stopped"
            self.finished.set()

    @property
    def done(self) -> bool:
        """`max_steps` versions are trained (0: never done); the last may still be publishing."""
        return bool(self.settings.max_steps and self.state_version >= self.settings.max_steps)

    async def wait_published(self) -> None:
        if self._publish_task is not None:
            task, self._publish_task = self._publish_task, None
            await task

    async def _on_disk(self, fn: Callable[[], T]) -> T:
        """fn() in a thread, waited out while the data dir is full (ENOSPC/EDQUOT): logged once per
        outage, counted, /healthz degraded; resumes by itself when space returns."""
        return await self.health.disk.call(lambda: asyncio.to_thread(fn), self._stop, self.beat,
                                           retry_if=disk_full)

    async def collect(self, stop: asyncio.Event) -> list[Trajectory]:
        """Up to groups_per_step trajectories; after collect_timeout_s, whatever arrived. Redis
        outages are waited out here; each round also keeps the run's Redis state (maintain)."""
        wanted = self.settings.groups_per_step
        got, self._pending = self._pending, []
        deadline = time.monotonic() + self.settings.collect_timeout_s
        while len(got) < wanted and not stop.is_set():
            self.beat()
            if self.paused.is_set():
                self._pending = got
                return []
            try:
                await self.maintain()
                batch = await self.coord.next_trajectories(wanted - len(got), block_ms=500)
            except Exception as exc:
                if not transient(exc):
                    raise
                await self.health.redis.failed(exc, stop)
                continue
            self.health.redis.ok()
            got += self._admit([t for t in batch if self._accept(t)])
            if time.monotonic() > deadline and got:
                break
        if stop.is_set():
            return []  # unfinished batch: not trained; its groups stay unsettled in the ledger
        return got

    def _admit(self, batch: Sequence[Trajectory]) -> list[Trajectory]:
        """Hold the new trajectories; drop those of groups trained already or held (Redis handed
        them out again after losing its last writes, or a group was re-enqueued): never twice."""
        kept = []
        for trajectory in batch:
            gid = trajectory.group_id
            if gid in self.held or gid in self.ledger.trained:
                self.duplicates_dropped += 1
                log.warning("dropped a second trajectory of group %s (already %s)", gid,
                            "held" if gid in self.held else "trained")
                continue
            self.held.add(gid)
            kept.append(trajectory)
        return kept

    # -- keeping Redis whole --

    async def maintain(self) -> None:
        """Check that Redis still holds the run (its epoch key); if it lost the data, create the
        streams again and reconcile at once. Reconcile every reconcile_every_s anyway: an AOF
        restart can lose the last second of writes without losing the epoch."""
        epoch = self.ledger.epoch
        assert epoch is not None, "the ledger is opened before the run is maintained"
        if not await self.coord.check_epoch(epoch):
            if self._ledger_existed or self.version or self.step:
                self.redis_data_losses += 1
                log.warning("Redis lost run %r's data: creating its streams again and re-enqueueing every "
                            "group neither trained nor queued", self.settings.run)
            await self.coord.reset()
            self._next_reconcile = 0.0
        self._ledger_existed = True
        if time.monotonic() >= self._next_reconcile:
            await self.reconcile()
            self._next_reconcile = time.monotonic() + self.settings.reconcile_every_s

    async def reconcile(self) -> list[str]:
        """Restore the run's settings in Redis and queue again every submitted group that is in no
        stream and not held or trained here (lost by Redis, or dropped as stale). Returns those ids."""
        await self.coord.set_trainer_version(self.version)
        await self.coord.set_inflight_limit(self.settings.coord.inflight_limit(self.settings.groups_per_step))
        async with self.ledger.lock:
            candidates = self.ledger.unsettled(self.held)
            missing, dead = await self.coord.missing([g.id for g in candidates])
            if dead:
                await asyncio.to_thread(self.ledger.settle_dead, dead)
            if not missing:
                return []
            by_id = {g.id: g for g in candidates}
            queued = await self.coord.requeue([by_id[gid] for gid in missing])
        self.requeued += len(queued)
        if queued:
            log.warning("re-enqueued %d groups Redis no longer held (first: %s)", len(queued), queued[:5])
        return queued

    def sampling_mismatch(self, trajectory: Trajectory) -> str | None:
        """Why the trainer cannot correct for how this trajectory was sampled, or None (shared.agreement)."""
        return sampling_mismatch(self.settings.sampling, trajectory.sampling)

    def _accept(self, trajectory: Trajectory) -> bool:
        """Train only admitted data sampled as assumed: the sampling contract, then admission
        (signature, a group this ledger admitted, its prompt, the task's own rewards)."""
        reason = self.sampling_mismatch(trajectory) or refusal(
            trajectory, self.ledger, self.settings.worker_token, self.tokenizer)
        if reason is None:
            return True
        if reason not in self.refused:
            log.warning("refusing trajectories (first from worker %r): %s", trajectory.worker_id, reason)
        self.refused[reason] = self.refused.get(reason, 0) + 1
        self._refused_this_step += 1
        return False

    def train_step(self, trajectories: list[Trajectory]) -> dict[str, Any]:
        metrics = self.learner.train_step(trajectories, version=self.version)
        metrics["refused_trajectories"], self._refused_this_step = self._refused_this_step, 0
        # The budget published with the version this step makes, from evidence at the budget in force.
        key = signal_key(self.settings.kv_control.metric, self.learner.config.dense_mismatch)
        evidence = evidence_from_step(trajectories, metrics, self.version, key)
        metrics |= self.kv_control.update(evidence, next_version=self.version + 1)
        if self.settings.eval_every and self.step % self.settings.eval_every == 0:
            metrics |= self.evaluate()
        return metrics

    def evaluate(self) -> dict[str, float]:
        """Held-out T = 1 accuracy of the current policy (dense cache) on the fixed eval prompts."""
        task = get_task(self.settings.default_task, **self.settings.eval_task_options)
        prompts = task.make_prompts(self.settings.eval_prompts, seed=EVAL_SEED)
        result = self.learner.evaluate(self.tokenizer, task, prompts, seed=EVAL_SEED)
        return {"heldout_accuracy": result["accuracy"], "heldout_reward": result["mean_reward"]}

    # -- publishing --

    async def publish(self, captured: Captured, metrics: dict[str, Any], t0: float,
                      group_ids: Sequence[str] = (), rollout: RolloutDirective | None = None) -> None:
        """Build and upload the patch; while the registry is unreachable, wait for it (the step
        is never dropped). `group_ids` are the groups trained in this step (settled once published);
        `rollout` what the workers should use from this version on (the KV budget)."""
        base, target = self.version, self.version + 1
        t_extract = time.perf_counter()
        patch = await asyncio.to_thread(captured.make_patch, self.settings.run, base, target)
        header = read_header(patch)
        # Capture (comparing and encoding the weights, per process) and building the container.
        extract_seconds = time.perf_counter() - t_extract + metrics.get("capture_seconds", 0.0)
        metrics |= {
            "version": target,
            "changed_fraction": header.changed / self.numel if self.numel else 0.0,
            "patch_bytes": len(patch),
            "dense_bytes": self.dense_bytes,
            "payload_ratio": self.dense_bytes / len(patch),
            "extract_seconds": extract_seconds,
        }
        t_up = time.perf_counter()
        try:
            await self._registry(lambda: self._put_patch(target, patch, header, _jsonable(metrics), rollout,
                                                         list(group_ids)))
            if captured.state is not None:
                data = await asyncio.to_thread(save_snapshot, self._cpu(captured.state),
                                               run=self.settings.run, version=target)
                await self._registry(lambda: self.registry.publish_snapshot(target, data))
        except RegistryHTTPError as exc:
            self.last_error = str(exc)
            log.error("publishing v%d failed: %s", target, exc)
            raise
        metrics["upload_seconds"] = time.perf_counter() - t_up
        metrics["step_seconds"] = time.perf_counter() - t0
        metrics["time"] = time.time()
        self.version = target
        await self._on_disk(functools.partial(self.ledger.settle_trained, list(group_ids), target))
        self.held.difference_update(group_ids)
        await self._redis(lambda: self.coord.set_trainer_version(target))
        self.history.append(metrics)
        await self._on_disk(functools.partial(self._append_metrics, metrics))
        log.info("step %d → v%d: reward %.3f acc %.3f changed %.2f%% patch %d B (%.0fx smaller)",
                 metrics["step"], target, metrics["reward_mean"], metrics["accuracy"],
                 100 * metrics["changed_fraction"], len(patch), metrics["payload_ratio"])

    def _append_metrics(self, metrics: dict[str, Any]) -> None:
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(_jsonable(metrics)) + "\n")

    async def _put_patch(self, target: int, patch: bytes, header: PatchHeader, metrics: dict[str, Any],
                         rollout: RolloutDirective | None = None, groups: list[str] | None = None) -> None:
        try:
            await self.registry.publish_patch(target, patch, metrics=metrics, rollout=rollout, groups=groups)
        except RegistryHTTPError as exc:
            # A try whose answer was lost may have landed: then the version is ours, not a conflict.
            if exc.status == 409:
                landed = await self.registry.manifest(target) if await self._has_version(target) else None
                if landed is not None and landed.fingerprint == header.target_fingerprint:
                    log.info("v%d had landed in the registry before its answer was lost", target)
                    return
            raise

    async def _has_version(self, version: int) -> bool:
        latest = await self.registry.latest()
        return latest is not None and latest.version >= version

    # -- checkpoints --

    def save_checkpoint(self) -> Path:
        """Master weights and optimizer (the learner's, sharded with several processes), the step,
        RNG and KV controller, as of `state_version`, written atomically to a folder of their own;
        older ones beyond KEEP_CHECKPOINTS are removed. Call with `state_lock` held (or no step
        running): the learner's state must be that of one version."""
        version = self.state_version
        final = self.checkpoint_root / f"v{version:08d}"
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        self.learner.save(tmp)
        torch.save({
            "version": version,
            "fingerprint": self.learner.published_fingerprint,
            "state_checksum": self.learner.state_checksum(),
            "history": self.history,
            "rng": torch.get_rng_state(),
            "numpy_rng": np.random.get_state(),
            "kv_control": self.kv_control.state(),
        }, tmp / "trainer.pt")
        fsync_tree(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        fsync_dir(self.checkpoint_root)
        for old in self._checkpoints()[:-KEEP_CHECKPOINTS]:
            shutil.rmtree(old[1], ignore_errors=True)
        log.debug("checkpoint at step %d, v%d", self.step, version)
        return final

    async def checkpoint(self) -> Path:
        """A checkpoint now (POST /v1/checkpoint), between two steps' updates."""
        async with self.state_lock:
            return await asyncio.to_thread(self.save_checkpoint)

    def _checkpoints(self) -> list[tuple[int, Path]]:
        """Complete checkpoints by version, oldest first (a `.tmp` folder is a crash mid-write)."""
        found = []
        if self.checkpoint_root.is_dir():
            for path in self.checkpoint_root.iterdir():
                if path.name.startswith("v") and path.name[1:].isdigit() and (path / "trainer.pt").is_file():
                    found.append((int(path.name[1:]), path))
        return sorted(found)

    def _usable_checkpoint(self, head: int | None) -> Path | None:
        """The newest checkpoint at or before the registry's head; newer ones are of steps whose
        version was never published (their groups go back to the queue): removed."""
        usable = None
        for version, path in self._checkpoints():
            if head is not None and version > head:
                log.warning("checkpoint v%d was never published (head v%d): discarded", version, head)
                shutil.rmtree(path, ignore_errors=True)
            else:
                usable = path
        return usable

    def _load_checkpoint(self, path: Path) -> None:
        ckpt = torch.load(path / "trainer.pt", weights_only=False)
        self.learner.load(path)
        self.version, self.history = ckpt["version"], ckpt["history"]
        torch.set_rng_state(ckpt["rng"])
        np.random.set_state(ckpt["numpy_rng"])
        if self.kv_control.adaptive and "kv_control" in ckpt:  # the head manifest, if newer, wins (start)
            self.kv_control.load_state(ckpt["kv_control"])
        # The resume check: the state now equals the state the saving process held (both taken
        # from live tensors, so a faulty save or load shows as a mismatch).
        self.resumed = {"version": self.version, "saved_checksum": ckpt.get("state_checksum"),
                        "loaded_checksum": self.learner.state_checksum()}
        if self.resumed["saved_checksum"] not in (None, self.resumed["loaded_checksum"]):
            log.error("the optimizer state loaded from %s differs from the one saved: %s", path, self.resumed)
        log.info("resumed from checkpoint: step %d, v%d", self.step, self.version)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not np.isfinite(value):
        return None
    return value
