"""The rollout service without HTTP: its lifecycle (boot the model, the weight sync and the
lease-driven worker loop when the registry and Redis are configured) and what its endpoints do
(generate, completions, weights, readiness, Prometheus metrics). services.rollout.app is a thin
FastAPI layer over this, as services.trainer.app is over TrainerService; RolloutCore is the engine
with its tokenizer and weights.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import ValidationError
from redis import asyncio as aioredis

from services.rollout.api import Completion, CompletionRequest, GenerateRequest, GenerateResponse, WeightsInfo
from services.rollout.core import Batch, RolloutCore
from services.rollout.engine.config import SamplingParams
from services.rollout.settings import RolloutSettings
from services.rollout.sync import LOOP as SYNC_LOOP
from services.rollout.sync import RunNotReady, SyncFailed, WeightSync, bootstrap_model, check_run_ready
from services.rollout.worker import LOOP as WORKER_LOOP
from services.rollout.worker import RolloutWorker
from shared.agreement import kv_policy_refusal
from shared.coord import Coordinator, connect
from shared.health import HealthMetrics, Liveness
from shared.registry.client import RegistryClient
from shared.registry.errors import RegistryHTTPError, SyncError
from shared.relay import Holdings, Relay
from shared.retry import Outage, transient
from shared.schemas import one_line_error

BOOT = "boot"  # the start-up task's name in Liveness
PROBE_TIMEOUT_S = 2.0  # how long /readyz waits for Redis to answer


class Refused(Exception):
    """A request this worker will not serve, with the HTTP status that says why."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


async def build_core(settings: RolloutSettings, client: RegistryClient | None) -> RolloutCore:
    """Load the model named in settings, or (no model given) bootstrap it from the registry."""
    if settings.model:
        core = await asyncio.to_thread(RolloutCore.from_model_dir, settings, Path(settings.model))
        if client is not None:
            known = await client.version_of(core.weights.fingerprint)
            if known is not None:
                core.weights.version = known
            else:  # local weights are not a published version: take the registry's snapshot path
                core.weights.version = -1
        return core
    if client is None:
        raise RuntimeError("set SPARSECAST_MODEL (a HF model directory) or SPARSECAST_REGISTRY_URL")
    model_dir = Path(settings.data_dir) / f"model-{settings.run}-{uuid.uuid4().hex[:8]}"
    version = await bootstrap_model(client, model_dir)
    return await asyncio.to_thread(RolloutCore.from_model_dir, settings, model_dir, version)


class RolloutMetrics:
    """The worker's Prometheus counters and gauges (gauges refreshed on each scrape)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "rollout_requests_total", "Generation requests", ["endpoint"], registry=self.registry
        )
        self.tokens = Counter("rollout_generated_tokens_total", "Tokens generated", registry=self.registry)
        self.version = Gauge("rollout_weight_version", "Weight version served", registry=self.registry)
        self.tokens_per_s = Gauge(
            "rollout_tokens_per_second", "Mean generation throughput", registry=self.registry
        )
        self.kv_peak = Gauge(
            "rollout_kv_peak_bytes", "Peak KV bytes of the last batch", registry=self.registry
        )
        self.leases = Gauge("rollout_leases_held", "Prompt-group leases held", registry=self.registry)
        self.completed = Gauge(
            "rollout_groups_completed", "Groups completed and counted", registry=self.registry
        )
        self.failed_groups = Gauge(
            "rollout_group_failures",
            "Group attempts that failed here (reward raised, ...)",
            registry=self.registry,
        )
        self.syncs = Gauge("rollout_weight_syncs", "Weight syncs done", registry=self.registry)
        self.sync_fallbacks = Gauge("rollout_weight_sync_fallbacks", "Syncs that fell back to a snapshot",
                                    registry=self.registry)
        self.swap_pause = Histogram(
            "rollout_weight_swap_pause_seconds",
            "Generation pause per weight swap: how long the engine was held to write a version",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0),
            registry=self.registry,
        )
        self.health = HealthMetrics(self.registry, "rollout")

    def observe(self, batch: Batch) -> None:
        self.tokens.inc(batch.generated_tokens)
        if batch.outputs:
            self.kv_peak.set(max(o.kv.peak_bytes for o in batch.outputs))


class RolloutService:
    """One rollout worker process. `core` is None until the model is loaded; `sync` and `worker`
    exist once booted when the registry (sync) and Redis (worker) are configured; `waiting` says
    what boot waits for (a registry not up yet, a run without v0), None otherwise.

    `log` names the service in its log lines (the app passes its own logger: operators and the
    fault tests read the outage lines under services.rollout.app)."""

    def __init__(self, settings: RolloutSettings, core: RolloutCore | None = None,
                 log: logging.Logger | None = None) -> None:
        self.settings = settings
        self.log = log or logging.getLogger(__name__)
        self.metrics = RolloutMetrics()
        self.core = core
        if core is not None:
            core.swap_observers.append(self.metrics.swap_pause.observe)
        self.sync: WeightSync | None = None
        self.worker: RolloutWorker | None = None
        self.waiting: str | None = None
        self.redis: aioredis.Redis | None = None
        self.liveness = Liveness()
        self.redis_outage = Outage("redis", self.log)
        self.registry_outage = Outage("registry", self.log)
        self.holdings = Holdings()  # pieces this worker verified, served to peers when relay is on

    # -- lifecycle --

    def _registry_client(self) -> RegistryClient | None:
        settings = self.settings
        if not settings.registry_url:
            return None
        sync = settings.sync
        bps = sync.bandwidth_mbps * 1e6 if sync.bandwidth_mbps else None
        client = RegistryClient(settings.registry_url, settings.run, streams=sync.streams,
                                bandwidth_bps=bps, redis_url=settings.redis_url,
                                redis_prefix=settings.redis_prefix, token=settings.registry_token)
        if sync.relay:
            client.downloader.relay = Relay(settings.worker_id, settings.advertise_url, self.holdings)
        return client

    async def _boot(self, client: RegistryClient | None, stop: asyncio.Event, first_try: asyncio.Event,
                    tasks: list[asyncio.Task]) -> None:
        """Load the model, waiting (readiness false, logged once) for a registry that is not up
        yet or a run whose trainer has not published v0; then start the loops."""
        settings = self.settings
        while self.core is None or self.core.weights.version < 0:
            self.liveness.beat(BOOT)
            try:
                if client is not None:
                    await check_run_ready(client)
                if self.core is None:
                    self.core = await build_core(settings, client)
                    self.core.swap_observers.append(self.metrics.swap_pause.observe)
                if self.core.weights.version < 0 and client is not None:
                    # local weights that are no published version
                    await WeightSync(self.core, client, poll_s=settings.sync.poll_s).sync_to(None)
            except Exception as exc:
                first_try.set()
                # No good path to the head now (a corrupt object: the sync failed, or no plan
                # reaches it, 404): the registry routes around it once the trainer uploads a
                # snapshot, so wait, not ready.
                unreachable = isinstance(exc, SyncError | SyncFailed) or (
                    isinstance(exc, RegistryHTTPError) and exc.status == 404)
                if not (isinstance(exc, RunNotReady) or unreachable or transient(exc)) or stop.is_set():
                    raise
                self.waiting = f"{type(exc).__name__}: {exc}"
                await self.registry_outage.failed(exc, stop)
                continue
            first_try.set()
            self.registry_outage.ok()
        self.waiting = None
        core = self.core
        if client is not None:
            self.sync = WeightSync(core, client, poll_s=settings.sync.poll_s, registry=self.registry_outage,
                                   liveness=self.liveness, warm_up_bytes=settings.sync.warm_up_mb << 20)
            task = asyncio.create_task(self.sync.run(stop))
            self.liveness.watch(SYNC_LOOP, task, settings.stall_s, progress=lambda: client.counters.bytes)
            tasks.append(task)
        if self.redis is not None:
            coord = Coordinator(self.redis, settings.redis_prefix, settings.coord, run=settings.run)
            self.worker = RolloutWorker(core, coord, settings, self.sync, redis=self.redis_outage,
                                        liveness=self.liveness)
            task = asyncio.create_task(self.worker.run(stop))
            self.liveness.watch(WORKER_LOOP, task, self.settings.stall_s)
            tasks.append(task)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Connect, boot in the background (the usual start completes before this yields), and on
        exit stop the loops (the worker finishes its batch or releases its leases) and close the
        connections."""
        settings = self.settings
        stop = asyncio.Event()
        tasks: list[asyncio.Task] = []
        client = self._registry_client()
        if settings.redis_url:
            self.redis = connect(settings.redis_url)
        first_try = asyncio.Event()
        booting = asyncio.create_task(self._boot(client, stop, first_try, tasks))
        self.liveness.watch(BOOT, booting, settings.stall_s, may_finish=True)
        # The usual start (registry up, run published) completes here, so the server starts ready;
        # a model that cannot load fails the start-up at once, as before.
        await asyncio.wait(
            {booting, asyncio.create_task(first_try.wait())}, return_when=asyncio.FIRST_COMPLETED
        )
        if booting.done() and (failure := booting.exception()) is not None:
            raise failure
        if self.waiting:
            self.log.warning("rollout worker is up but not ready: %s", self.waiting)
        try:
            yield
        finally:
            stop.set()
            for task in [booting, *tasks]:
                with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
                    await asyncio.wait_for(task, timeout=30)
            if client is not None:
                if isinstance(client.downloader.relay, Relay):
                    await client.downloader.relay.aclose()
                await client.aclose()
            if self.redis is not None:
                await self.redis.aclose()

    # -- requests --

    def loaded_core(self) -> RolloutCore:
        """The core, or Refused(503) while the model loads."""
        if self.core is None:
            raise Refused(503, "model not loaded yet")
        return self.core

    def check_budget(self, sequences: int, max_tokens: int) -> None:
        settings = self.settings
        if sequences > settings.max_batch:
            raise Refused(413, f"request asks for {sequences} sequences (prompts × n); the limit is "
                               f"{settings.max_batch}")
        if max_tokens > settings.max_new_tokens_limit:
            raise Refused(400, f"max_tokens={max_tokens} is over this server's limit of "
                               f"{settings.max_new_tokens_limit}")

    async def generate(self, req: GenerateRequest) -> GenerateResponse:
        core = self.loaded_core()
        prompts = (
            req.prompt_ids if req.prompt_ids is not None else [core.encode(t) for t in req.prompts or []]
        )
        self.check_budget(len(prompts) * req.n, req.max_tokens)
        if refusal := kv_policy_refusal(core.engine.name, req.kv_policy):
            raise Refused(400, refusal)
        try:
            core.check_lengths(prompts, req.max_tokens)
            kv = core.kv_config(req.kv_policy, req.kv_budget, **req.kv)
            params = SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                                    max_new_tokens=req.max_tokens, seed=req.seed,
                                    stop_token_ids=tuple(req.stop_token_ids) if req.stop_token_ids is not None
                                    else core.default_stop_ids())
        except (ValueError, TypeError, ValidationError) as exc:
            raise Refused(422, one_line_error(exc)) from exc
        expanded = [ids for ids in prompts for _ in range(req.n)]
        batch = await core.generate(expanded, params, kv)
        self.metrics.requests.labels("generate").inc()
        self.metrics.observe(batch)
        return GenerateResponse(
            weight_version=batch.version, fingerprint=batch.fingerprint, engine=core.engine.name,
            kv_policy=batch.kv.policy, kv_budget=batch.kv.sparse_budget,
            seconds=batch.seconds,
            tokens_per_s=batch.generated_tokens / batch.seconds if batch.seconds else 0.0,
            completions=[
                Completion(prompt_index=i // req.n, text=core.decode(o.token_ids), token_ids=o.token_ids,
                           logprobs=o.logprobs, finish_reason=o.finish_reason, kv=o.kv)
                for i, o in enumerate(batch.outputs)
            ],
        )

    async def completions(self, req: CompletionRequest) -> dict[str, Any]:
        """The OpenAI completions subset: texts or token ids in, choices with optional logprobs."""
        core = self.loaded_core()
        raw = req.prompt_list()
        prompts = [core.encode(p) if isinstance(p, str) else list(p) for p in raw]
        self.check_budget(len(prompts) * req.n, req.max_tokens)
        try:
            core.check_lengths(prompts, req.max_tokens)
        except ValueError as exc:
            raise Refused(400, str(exc)) from exc
        params = SamplingParams(temperature=req.temperature, top_p=req.top_p, max_new_tokens=req.max_tokens,
                                seed=req.seed, stop_token_ids=core.default_stop_ids())
        batch = await core.generate([ids for ids in prompts for _ in range(req.n)], params)
        self.metrics.requests.labels("completions").inc()
        self.metrics.observe(batch)
        choices = []
        for i, out in enumerate(batch.outputs):
            ids, logprobs, finish = cut_at_stop(core, out.token_ids, out.logprobs, out.finish_reason,
                                                req.stops())
            choice: dict[str, Any] = {"index": i, "text": core.decode(ids), "finish_reason": finish,
                                      "logprobs": None}
            if req.logprobs is not None:
                tokens = [core.tokenizer.decode([t]) for t in ids]
                offsets, pos = [], 0
                for tok in tokens:
                    offsets.append(pos)
                    pos += len(tok)
                choice["logprobs"] = {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": None,
                                      "text_offset": offsets}
            choices.append(choice)
        completion_tokens = sum(len(o.token_ids) for o in batch.outputs)
        prompt_tokens = sum(len(p) for p in prompts) * req.n
        return {
            "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": req.model or self.settings.served_model_name, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens},
            "system_fingerprint": batch.fingerprint,
        }

    def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": self.settings.served_model_name, "object": "model", "owned_by": "sparsecast"}],
        }

    def weights(self) -> WeightsInfo:
        core = self.loaded_core()
        w, sync = core.weights, self.sync
        return WeightsInfo(version=w.version, fingerprint=w.fingerprint, sync_state=w.sync_state,
                           last_error=w.last_error, last_sync=w.last_sync, engine=core.engine.name,
                           history=list(sync.history) if sync else [],
                           registry_url=self.settings.registry_url, kv_budget=core.kv_config().sparse_budget,
                           swap_pause=core.pause_summary())

    # -- health --

    def liveness_report(self) -> dict[str, Any]:
        """A background loop (boot, weight sync, worker, heartbeats) died or made no progress for
        stall_s: `ok` is false. Waiting out an outage, or for the run's first version, is progress."""
        problems = self.liveness.problems()
        return {"ok": not problems, "problems": problems, "loops": self.liveness.loops()}

    async def readiness(self) -> dict[str, Any]:
        """Weights of a published version are loaded, and Redis and the registry (when
        configured) answer now."""
        core = self.core
        reasons = []
        if core is None or core.weights.version < 0:
            reasons.append(self.waiting or "loading the model")
        reasons += self.liveness.problems()  # a dead or stuck loop cannot work either
        if self.redis is not None:
            try:
                await asyncio.wait_for(self.redis.ping(), timeout=PROBE_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - any failure means: not ready
                reasons.append(f"redis: {type(exc).__name__}: {exc}")
        if self.settings.registry_url and self.registry_outage.down:
            reasons.append(f"registry: {self.registry_outage.last_error}")
        if self.sync is not None and self.sync.stuck:
            reasons.append(self.sync.stuck)
        return {"ready": not reasons, "version": core.weights.version if core else None, "reasons": reasons}

    def metrics_text(self) -> bytes:
        metrics, core, worker, sync = self.metrics, self.core, self.worker, self.sync
        if core is not None:
            metrics.version.set(core.weights.version)
            metrics.tokens_per_s.set(core.tokens_per_s)
        if worker is not None:
            metrics.leases.set(len(worker.held))
            metrics.completed.set(worker.completed)
            metrics.failed_groups.set(worker.failed_groups)
        if sync is not None:
            metrics.syncs.set(sync.syncs)
            metrics.sync_fallbacks.set(sync.fallbacks)
        metrics.health.update([self.redis_outage, self.registry_outage], self.liveness)
        return generate_latest(metrics.registry)


def cut_at_stop(core: RolloutCore, ids: list[int], logprobs: list[float], finish: str,
                stops: list[str]) -> tuple[list[int], list[float], str]:
    """Truncate a completion before the first stop string (OpenAI semantics: stop text excluded)."""
    if not stops:
        return ids, logprobs, finish
    text = ""
    for n, token in enumerate(ids):
        text += str(core.tokenizer.decode([token]))
        if any(s in text for s in stops):
            return ids[:n], logprobs[:n], "stop"
    return ids, logprobs, finish
