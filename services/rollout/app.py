"""HTTP API of a rollout worker: sparse-KV generation, an OpenAI completions subset, weights.

Thin layer over RolloutCore; the lease-driven worker loop and the weight sync run as background
tasks when Redis and the registry are configured.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import Depends, FastAPI, HTTPException, Request, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi_offline import FastAPIOffline
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from pydantic import ValidationError

from services.rollout.api import (
    Completion,
    CompletionRequest,
    GenerateRequest,
    GenerateResponse,
    WeightsInfo,
)
from services.rollout.core import RolloutCore
from services.rollout.engine.config import SamplingParams
from services.rollout.settings import RolloutSettings
from services.rollout.sync import LOOP as SYNC_LOOP
from services.rollout.sync import (
    RunNotReady,
    WeightSync,
    bootstrap_model,
    check_run_ready,
)
from services.rollout.worker import LOOP as WORKER_LOOP
from services.rollout.worker import RolloutWorker
from shared.agreement import kv_policy_refusal
from shared.coord import Coordinator, connect
from shared.health import HealthMetrics, Liveness
from shared.http import PROMETHEUS_TEXT, error_responses, install_error_handling
from shared.registry.client import RegistryClient
from shared.relay import RELAY_PATH, Holdings, Relay, relay_endpoint
from shared.retry import Outage, transient
from shared.schemas import one_line_error

log = logging.getLogger(__name__)
BOOT = "boot"  # the start-up task's name in Liveness
PROBE_TIMEOUT_S = 2.0  # how long /readyz waits for Redis to answer


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


class Metrics:
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


def create_app(settings: RolloutSettings | None = None, core: RolloutCore | None = None) -> FastAPI:
    settings = settings or RolloutSettings()
    metrics = Metrics()
    state: dict = {"core": core, "sync": None, "worker": None, "waiting": None, "redis": None}
    liveness = Liveness()
    outages = {"redis": Outage("redis", log), "registry": Outage("registry", log)}
    holdings = Holdings()
    health_metrics = HealthMetrics(metrics.registry, "rollout")

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        stop = asyncio.Event()
        tasks: list[asyncio.Task] = []
        client = None
        if settings.registry_url:
            bps = settings.sync_bandwidth_mbps * 1e6 if settings.sync_bandwidth_mbps else None
            client = RegistryClient(settings.registry_url, settings.run, streams=settings.sync_streams,
                                    bandwidth_bps=bps, redis_url=settings.redis_url,
                                    redis_prefix=settings.redis_prefix, token=settings.registry_token)
            if settings.relay:
                client.downloader.relay = Relay(settings.worker_id, settings.advertise_url, holdings)
        if settings.redis_url:
            state["redis"] = connect(settings.redis_url)
        first_try = asyncio.Event()

        async def boot() -> None:
            """Load the model, waiting (readiness false, logged once) for a registry that is not up
            yet or a run whose trainer has not published v0; then start the loops."""
            while state["core"] is None or state["core"].weights.version < 0:
                liveness.beat(BOOT)
                try:
                    if client is not None:
                        await check_run_ready(client)
                    if state["core"] is None:
                        state["core"] = await build_core(settings, client)
                    if state["core"].weights.version < 0 and client is not None:
                        # local weights that are no published version
                        sync = WeightSync(state["core"], client, poll_s=settings.sync_poll_s)
                        await sync.sync_to(None)
                except Exception as exc:
                    first_try.set()
                    if not (isinstance(exc, RunNotReady) or transient(exc)) or stop.is_set():
                        raise
                    state["waiting"] = f"{type(exc).__name__}: {exc}"
                    await outages["registry"].failed(exc, stop)
                    continue
                first_try.set()
                outages["registry"].ok()
            state["waiting"] = None
            if client is not None:
                state["sync"] = WeightSync(state["core"], client, poll_s=settings.sync_poll_s,
                                           registry=outages["registry"], liveness=liveness)
                task = asyncio.create_task(state["sync"].run(stop))
                liveness.watch(SYNC_LOOP, task, settings.stall_s, progress=lambda: client.counters.bytes)
                tasks.append(task)
            if state["redis"] is not None:
                coord = Coordinator(state["redis"], settings.redis_prefix, settings.coord, run=settings.run)
                state["worker"] = RolloutWorker(state["core"], coord, settings, state["sync"],
                                                redis=outages["redis"], liveness=liveness)
                task = asyncio.create_task(state["worker"].run(stop))
                liveness.watch(WORKER_LOOP, task, settings.stall_s)
                tasks.append(task)

        booting = asyncio.create_task(boot())
        liveness.watch(BOOT, booting, settings.stall_s, may_finish=True)
        # The usual start (registry up, run published) completes here, so the server starts ready;
        # a model that cannot load fails the start-up at once, as before.
        await asyncio.wait(
            {booting, asyncio.create_task(first_try.wait())}, return_when=asyncio.FIRST_COMPLETED
        )
        if booting.done() and (failure := booting.exception()) is not None:
            raise failure
        if state["waiting"]:
            log.warning("rollout worker is up but not ready: %s", state["waiting"])
        try:
            yield
        finally:
            stop.set()  # the worker finishes its batch or releases its leases
            for task in [booting, *tasks]:
                with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
                    await asyncio.wait_for(task, timeout=30)
            if client is not None:
                if isinstance(client.downloader.relay, Relay):
                    await client.downloader.relay.aclose()
                await client.aclose()
            if state["redis"] is not None:
                await state["redis"].aclose()

    # /docs and /redoc with their scripts served by the app itself (no CDN: they work offline).
    app = FastAPIOffline(title="sparsecast rollout", version="0.1.0", lifespan=lifespan,
                         responses=error_responses(422),
                         description="Sparse-KV generation, an OpenAI completions subset, live weight sync.")
    install_error_handling(app)
    if settings.relay:  # peers fetch the pieces this worker verified (shared.relay)
        app.add_route(RELAY_PATH, relay_endpoint(holdings), methods=["GET"], include_in_schema=False)
    bearer = HTTPBearer(auto_error=False)
    generation = error_responses(400, 401, 413, 503)

    def get_core() -> RolloutCore:
        if state["core"] is None:
            raise HTTPException(503, "model not loaded yet")
        return state["core"]

    def authorize(creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        if settings.api_token and (
            creds is None or not secrets.compare_digest(creds.credentials, settings.api_token)
        ):
            raise HTTPException(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})

    def check_budget(core: RolloutCore, sequences: int, max_tokens: int) -> None:
        if sequences > settings.max_batch:
            raise HTTPException(
                413,
                f"request asks for {sequences} sequences (prompts × n); the limit is {settings.max_batch}",
            )
        if max_tokens > settings.max_new_tokens_limit:
            raise HTTPException(
                400, f"max_tokens={max_tokens} is over this server's limit of {settings.max_new_tokens_limit}"
            )

    @app.post(
        "/v1/generate",
        response_model=GenerateResponse,
        dependencies=[Depends(authorize)],
        responses=generation,
    )
    async def generate(req: GenerateRequest, core: RolloutCore = Depends(get_core)) -> GenerateResponse:
        prompts = (
            req.prompt_ids if req.prompt_ids is not None else [core.encode(t) for t in req.prompts or []]
        )
        check_budget(core, len(prompts) * req.n, req.max_tokens)
        if refusal := kv_policy_refusal(core.engine.name, req.kv_policy):
            raise HTTPException(400, refusal)
        try:
            core.check_lengths(prompts, req.max_tokens)
            kv = core.kv_config(req.kv_policy, req.kv_budget, **req.kv)
            params = SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                                    max_new_tokens=req.max_tokens, seed=req.seed,
                                    stop_token_ids=tuple(req.stop_token_ids) if req.stop_token_ids is not None
                                    else core.default_stop_ids())
        except (ValueError, TypeError, ValidationError) as exc:
            raise HTTPException(422, one_line_error(exc)) from exc
        expanded = [ids for ids in prompts for _ in range(req.n)]
        batch = await core.generate(expanded, params, kv)
        metrics.requests.labels("generate").inc()
        _observe(metrics, core, batch)
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

    @app.post("/v1/completions", dependencies=[Depends(authorize)], responses=generation)
    async def completions(req: CompletionRequest, core: RolloutCore = Depends(get_core)) -> dict:
        raw = req.prompt_list()
        prompts = [core.encode(p) if isinstance(p, str) else list(p) for p in raw]
        check_budget(core, len(prompts) * req.n, req.max_tokens)
        try:
            core.check_lengths(prompts, req.max_tokens)
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from exc
        params = SamplingParams(temperature=req.temperature, top_p=req.top_p, max_new_tokens=req.max_tokens,
                                seed=req.seed, stop_token_ids=core.default_stop_ids())
        batch = await core.generate([ids for ids in prompts for _ in range(req.n)], params)
        metrics.requests.labels("completions").inc()
        _observe(metrics, core, batch)
        choices = []
        for i, out in enumerate(batch.outputs):
            ids, logprobs, finish = _cut_at_stop(
                core, out.token_ids, out.logprobs, out.finish_reason, req.stops()
            )
            choice = {"index": i, "text": core.decode(ids), "finish_reason": finish, "logprobs": None}
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
            "model": req.model or settings.served_model_name, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens},
            "system_fingerprint": batch.fingerprint,
        }

    @app.get("/v1/models")
    async def models() -> dict:
        return {
            "object": "list",
            "data": [{"id": settings.served_model_name, "object": "model", "owned_by": "sparsecast"}],
        }

    @app.get("/v1/weights", response_model=WeightsInfo, responses=error_responses(503))
    async def weights(core: RolloutCore = Depends(get_core)) -> WeightsInfo:
        w, sync = core.weights, state["sync"]
        return WeightsInfo(version=w.version, fingerprint=w.fingerprint, sync_state=w.sync_state,
                           last_error=w.last_error, last_sync=w.last_sync, engine=core.engine.name,
                           history=list(sync.history) if sync else [],
                           registry_url=settings.registry_url, kv_budget=core.kv_config().sparse_budget)

    @app.get("/healthz")
    async def healthz(response: Response) -> dict:
        """Liveness: 503 when a background loop (boot, weight sync, worker, heartbeats) died or
        made no progress for stall_s, so the orchestrator restarts the worker. Waiting out an
        outage, or for the run's first version, is progress."""
        problems = liveness.problems()
        if problems:
            response.status_code = 503
        return {"ok": not problems, "problems": problems, "loops": liveness.loops()}

    @app.get("/readyz")
    async def readyz(response: Response) -> dict:
        """Readiness: weights of a published version are loaded, and Redis and the registry
        (when configured) answer now."""
        core = state["core"]
        reasons = []
        if core is None or core.weights.version < 0:
            reasons.append(state["waiting"] or "loading the model")
        reasons += liveness.problems()  # a dead or stuck loop cannot work either
        if state["redis"] is not None:
            try:
                await asyncio.wait_for(state["redis"].ping(), timeout=PROBE_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - any failure means: not ready
                reasons.append(f"redis: {type(exc).__name__}: {exc}")
        if settings.registry_url and outages["registry"].down:
            reasons.append(f"registry: {outages['registry'].last_error}")
        if reasons:
            response.status_code = 503
        return {"ready": not reasons, "version": core.weights.version if core else None, "reasons": reasons}

    @app.get("/metrics", responses=PROMETHEUS_TEXT)
    async def prometheus() -> Response:
        core, worker, sync = state["core"], state["worker"], state["sync"]
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
        health_metrics.update(outages.values(), liveness)
        return Response(generate_latest(metrics.registry), media_type="text/plain; version=0.0.4")

    @app.exception_handler(ValueError)
    async def value_error(_: Request, exc: ValueError) -> Response:
        from fastapi.responses import JSONResponse

        return JSONResponse({"detail": one_line_error(exc)}, status_code=422)

    app.state.rollout = state
    app.state.liveness = liveness
    return app


def _observe(metrics: Metrics, core: RolloutCore, batch) -> None:
    metrics.tokens.inc(batch.generated_tokens)
    if batch.outputs:
        metrics.kv_peak.set(max(o.kv.peak_bytes for o in batch.outputs))


def _cut_at_stop(core: RolloutCore, ids: list[int], logprobs: list[float], finish: str,
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

