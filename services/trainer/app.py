"""HTTP API of the trainer: prompts in, status/versions/metrics out, pause/resume/checkpoint,
and the dashboard. Thin layer over services.trainer.core.Trainer."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
from fastapi import Depends, FastAPI, HTTPException, Query, Request, Response
from fastapi.responses import FileResponse, JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.staticfiles import StaticFiles
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from services.trainer.core import LOOP, Trainer, TrainerHealth
from services.trainer.ledger import GroupLedger
from services.trainer.settings import TrainerSettings
from shared.coord import Coordinator, QueueFull, connect
from shared.health import HealthMetrics
from shared.http import PROMETHEUS_TEXT, BodyLimit, error_responses, inline_schema, install_error_handling
from shared.registry_client import RegistryClient, RegistryHTTPError
from shared.retry import transient
from shared.schemas import PromptGroup, Text, one_line_error
from shared.tasks import get_task, list_tasks
from shared.tasks.numeric import numeric_row

log = logging.getLogger(__name__)
DASHBOARD = Path(__file__).parent / "dashboard"
MAX_PROMPTS_PER_REQUEST = 10_000
# The trainer's own calls ride out registry outages (shared.retry: logged once, counted), so its
# client retries only once inside, for a blip.
REGISTRY_RETRIES = 1
# How long /readyz waits for Redis and the registry to answer.
PROBE_TIMEOUT_S = 2.0


class PromptIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: Text = Field(min_length=1)
    answer: Text | None = Field(default=None, description="required by every built-in task")
    id: Text | None = Field(default=None, min_length=1, max_length=200)
    max_new_tokens: int | None = Field(default=None, ge=1, description="default: the task's own")
    metadata: dict[str, Any] = Field(default_factory=dict)


class GenerateSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    count: int = Field(ge=1, le=MAX_PROMPTS_PER_REQUEST)
    seed: int = 0
    # Constructor options of the task, e.g. {"min_digits": 6, "max_digits": 12} for addition; the
    # groups then carry the generation budget that task needs.
    options: dict[str, int | float | str] = Field(default_factory=dict)


class PromptsRequest(BaseModel):
    # Exactly one of `prompts` and `generate` (checked in the handler; stated here for clients).
    model_config = ConfigDict(extra="forbid", json_schema_extra={"oneOf": [
        {"required": ["prompts"], "properties": {"prompts": {"type": "array"}}},
        {"required": ["generate"], "properties": {"generate": {"type": "object"}}}]})

    task: Text | None = Field(default=None, description="default: the trainer's default task",
                              json_schema_extra={"enum": [*list_tasks(), None]})
    samples_per_prompt: int | None = Field(default=None, ge=1, le=1024)
    prompts: list[PromptIn] | None = Field(default=None, max_length=MAX_PROMPTS_PER_REQUEST)
    generate: GenerateSpec | None = Field(default=None, description="make prompts from a built-in task")


class PromptsAccepted(BaseModel):
    task: str
    samples_per_prompt: int
    count: int
    ids: list[str] = Field(description="prompt group ids, in the order given")
    entries: list[str] = Field(description="their queue entries")


PROMPTS_BODY = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": inline_schema(PromptsRequest)},
    "application/x-ndjson": {"schema": {
        "type": "string", "format": "binary",  # bytes: what arrives is not always UTF-8
        "description": "JSONL (UTF-8): one object per line with `prompt` (or GSM8K-style `question`) and "
                       "`answer`, plus optional `id` and `metadata`"}},
    "multipart/form-data": {"schema": {
        "type": "object", "required": ["file"],
        "properties": {"file": {"type": "string", "format": "binary", "description": "a JSONL file"}}}},
}}}


def check_prompt(settings: TrainerSettings, task: Any, n: int, item: PromptIn) -> None:
    """422 for a prompt over the size limits or with an answer the task cannot score (which
    would fail on every worker that claims it), before anything reaches Redis."""
    where = f"prompt {n}"
    for field, value, limit in (("prompt", item.prompt, settings.max_prompt_chars),
                                ("answer", item.answer or "", settings.max_answer_chars)):
        if len(value) > limit:
            raise HTTPException(422, f"{where}: {field} has {len(value)} characters; the limit is {limit}")
    try:
        size = len(json.dumps(item.metadata, ensure_ascii=False).encode("utf-8"))
    except (UnicodeEncodeError, ValueError, TypeError, RecursionError) as exc:
        raise HTTPException(422, f"{where}: metadata is not UTF-8 JSON: {type(exc).__name__}") from exc
    if size > settings.max_metadata_bytes:
        raise HTTPException(422, f"{where}: metadata is {size} bytes as JSON; the limit is {settings.max_metadata_bytes}")
    try:
        task.check_answer(item.answer)
    except ValueError as exc:
        raise HTTPException(422, f"{where}: {exc}") from exc


def load_api_token(settings: TrainerSettings) -> str:
    if settings.api_token:
        return settings.api_token
    path = Path(settings.data_dir) / "api-token"
    if path.is_file():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(24)
    path.write_text(token + "\n")
    path.chmod(0o600)
    log.warning("no SPARSECAST_API_TOKEN set: generated one in %s", path)
    return token


def create_app(settings: TrainerSettings | None = None) -> FastAPI:
    settings = settings or TrainerSettings()
    token = load_api_token(settings)
    state: dict[str, Any] = {"trainer": None, "error": None}
    registry = CollectorRegistry()
    gauges = {name: Gauge(f"trainer_{name}", doc, registry=registry) for name, doc in {
        "step": "Optimizer steps taken", "version": "Weight version published last",
        "reward_mean": "Mean reward of the last batch", "accuracy": "Exact-answer rate of the last batch",
        "rejection_rate": "Sequences vetoed by the Sparse-RL correction", "token_mask_rate": "Tokens masked (ξ out of band)",
        "xi_mean": "Mean ξ = π_old_dense/π_sampler", "kl_old_sampler": "KL(π_old_dense ‖ π_sampler) estimate",
        "changed_fraction": "Fraction of bf16 weights changed by the last step", "patch_bytes": "Bytes of the last patch",
        "payload_ratio": "Dense bf16 bytes / patch bytes", "step_seconds": "Wall time of the last step",
        "kv_saved": "KV memory the samplers saved vs a dense cache",
    }.items()}
    coord_gauge = Gauge("coord", "Coordination counters and depths", ["name"], registry=registry)
    fault_gauges = {name: Gauge(f"trainer_{name}", doc, registry=registry) for name, doc in {
        "requeued_groups": "Groups queued again because Redis no longer held them",
        "duplicate_trajectories": "Trajectories dropped because their group was trained or held already",
        "redis_data_losses": "Times Redis was found without the run's data",
    }.items()}
    health = TrainerHealth()
    health_metrics = HealthMetrics(registry, "trainer")
    staleness_gauge = Gauge("trainer_staleness_groups", "Groups of the last batch by version lag", ["lag"],
                            registry=registry)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        redis = connect(settings.redis_url)
        coord = Coordinator(redis, settings.redis_prefix, settings.coord, run=settings.run)
        client = RegistryClient(settings.registry_url, settings.run, token=token, retries=REGISTRY_RETRIES)
        ledger = await asyncio.to_thread(GroupLedger.in_dir, settings.data_dir, settings.run)
        state["coord"], state["registry"], state["ledger"] = coord, client, ledger
        stop = asyncio.Event()

        built: list[Trainer] = []

        async def boot() -> None:
            try:
                trainer = await asyncio.to_thread(Trainer, settings, client, coord, ledger=ledger, health=health)
                built.append(trainer)
                await trainer.start(stop)
                state["trainer"] = trainer
                await trainer.run(stop)
            except Exception as exc:
                if stop.is_set():
                    return  # shutting down: an outage wait was cut short
                state["error"] = f"{type(exc).__name__}: {exc}"
                log.exception("trainer stopped")
                raise  # the loop is dead: /healthz says so, and the orchestrator restarts us

        task = asyncio.create_task(boot())
        health.liveness.watch(LOOP, task, settings.stall_s, may_finish=True)
        try:
            yield
        finally:
            stop.set()
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
                await asyncio.wait_for(task, timeout=60)
            for trainer in built:  # under torchrun: let the other ranks go
                await asyncio.to_thread(trainer.learner.close)
            await client.aclose()
            await redis.aclose()

    app = FastAPI(title="sparsecast trainer", version="0.1.0", lifespan=lifespan, responses=error_responses(422),
                  description="GRPO with Sparse-RL corrections; a sparse weight patch published every step.")
    install_error_handling(app)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    bearer = HTTPBearer(auto_error=False)
    controls = error_responses(401, 503)

    def authorize(creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        if creds is None or not secrets.compare_digest(creds.credentials, token):
            raise HTTPException(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})

    def get_trainer() -> Trainer:
        if state["trainer"] is None:
            raise HTTPException(503, state["error"] or "trainer is starting (loading or warm-starting the model)")
        return state["trainer"]

    async def enqueue(task_name: str | None, samples: int | None, items: list[PromptIn]) -> PromptsAccepted:
        name = task_name or settings.default_task
        try:
            task = get_task(name)
        except KeyError as exc:
            raise HTTPException(400, str(exc.args[0])) from exc
        if not items:
            raise HTTPException(400, "no prompts given")
        for i, item in enumerate(items):
            check_prompt(settings, task, i, item)
        n = samples or settings.samples_per_prompt
        groups = [PromptGroup(id=p.id or f"{settings.run}-{uuid.uuid4().hex[:16]}", task=name, prompt=p.prompt,
                              answer=p.answer, samples=n, max_new_tokens=p.max_new_tokens, metadata=p.metadata)
                  for p in items]
        try:
            ids = await state["ledger"].submit(state["coord"], groups)
        except QueueFull as exc:
            raise HTTPException(429, str(exc)) from exc
        except Exception as exc:
            if not transient(exc):
                raise
            raise HTTPException(503, f"Redis is unreachable, nothing was queued; retry later ({exc})") from exc
        return PromptsAccepted(task=name, samples_per_prompt=n, count=len(groups), ids=[g.id for g in groups],
                               entries=ids)

    @app.post("/v1/prompts", dependencies=[Depends(authorize)], openapi_extra=PROMPTS_BODY,
              responses=error_responses(400, 401, 413, 415, 422, 429, 503))
    async def submit_prompts(request: Request, task: str | None = Query(None, json_schema_extra={"enum": list_tasks()}),
                             samples_per_prompt: int | None = Query(None, ge=1, le=1024)) -> PromptsAccepted:
        """JSON body (PromptsRequest), or a JSONL upload (application/x-ndjson or multipart file):
        one object per line with `prompt` (or GSM8K-style `question`) and `answer`."""
        ctype = request.headers.get("content-type", "")
        if ctype.startswith("application/json"):
            try:
                body = PromptsRequest.model_validate_json(await request.body())
            except ValidationError as exc:
                raise HTTPException(422, one_line_error(exc, "body")) from exc
            if (body.prompts is None) == (body.generate is None):
                raise HTTPException(422, "give exactly one of 'prompts' or 'generate'")
            name = body.task or task or settings.default_task
            if body.generate is not None:
                spec = body.generate
                try:
                    generator = get_task(name, **spec.options)
                except KeyError as exc:
                    raise HTTPException(400, str(exc.args[0])) from exc
                except (TypeError, ValueError) as exc:
                    raise HTTPException(422, f"task {name!r} options {spec.options}: {exc}") from exc
                try:
                    made = generator.make_prompts(spec.count, seed=spec.seed)
                except Exception as exc:  # a task without a generator (e.g. gsm8k needs a source)
                    raise HTTPException(400, f"task {name!r} cannot generate prompts: {exc}") from exc
                budget = generator.max_new_tokens if spec.options else None
                items = [PromptIn(prompt=p, answer=a, max_new_tokens=budget) for p, a in made]
            else:
                items = body.prompts or []
            return await enqueue(name, body.samples_per_prompt or samples_per_prompt, items)
        if ctype.startswith("multipart/form-data"):
            async with request.form() as form:  # closes the spooled upload files
                upload = form.get("file")
                if upload is None or isinstance(upload, str):
                    raise HTTPException(422, "multipart upload needs a 'file' field holding JSONL")
                raw = await upload.read()
        elif ctype.startswith(("application/x-ndjson", "application/jsonl", "text/plain")):
            raw = await request.body()
        else:
            raise HTTPException(415, "send application/json, application/x-ndjson (JSONL) or a multipart 'file'")
        return await enqueue(task, samples_per_prompt, _parse_jsonl(raw))

    @app.get("/v1/tasks")
    async def tasks() -> dict:
        return {"tasks": list_tasks(), "default": settings.default_task}

    @app.get("/v1/status")
    async def status() -> dict:
        """Never fails for a Redis fault: with Redis unreachable, queue and workers are null and
        `redis_error` says why."""
        trainer = state["trainer"]
        coord: Coordinator = state["coord"]
        stats: dict | None = None
        workers: list = []
        redis_error = None
        try:
            stats, workers = await asyncio.gather(coord.stats(), coord.workers())
        except Exception as exc:  # noqa: BLE001 - status reports a broken dependency, it does not fail
            redis_error = f"{type(exc).__name__}: {exc}"
        return {
            "run": settings.run,
            "state": trainer.state if trainer else ("failed" if state["error"] else "starting"),
            "error": state["error"] or (trainer.last_error if trainer else None),
            "paused": bool(trainer and trainer.paused.is_set()),
            "step": trainer.step if trainer else 0,
            "version": trainer.version if trainer else None,
            "max_steps": settings.max_steps,
            "queue": stats,
            "workers": [w.model_dump() for w in workers],
            "redis_error": redis_error,
            "dependencies": {"redis": health.redis.state(), "registry": health.registry.state()},
            "faults": {
                "requeued_groups": trainer.requeued if trainer else 0,
                "duplicate_trajectories": trainer.duplicates_dropped if trainer else 0,
                "redis_data_losses": trainer.redis_data_losses if trainer else 0,
            },
            "last": trainer.history[-1] if trainer and trainer.history else None,
            # Trajectories the trainer would not train on (sampling contract), by reason.
            "refused_trajectories": dict(trainer.refused) if trainer else {},
            "heldout_baseline": trainer.eval_baseline if trainer else None,
        }

    @app.get("/v1/versions")
    async def versions() -> dict:
        try:
            manifests = await state["registry"].versions()
        except (RegistryHTTPError, httpx.HTTPError) as exc:
            raise HTTPException(503, f"the registry is unavailable: {exc}") from exc
        return {"run": settings.run, "versions": [
            m.model_dump(exclude={"patch", "snapshot"}) | {
                "patch_bytes": m.patch.size if m.patch else None,
                "snapshot_bytes": m.snapshot.size if m.snapshot else None,
                "payload_ratio": m.payload_ratio,
                "changed_fraction": m.metrics.get("changed_fraction"),
            } for m in manifests]}

    @app.get("/v1/metrics/history")
    async def history(since: int = Query(0, ge=0, description="steps after this one")) -> dict:
        trainer = state["trainer"]
        rows = trainer.history if trainer else []
        return {"history": [r for r in rows if r.get("step", 0) > since]}

    @app.post("/v1/train/pause", dependencies=[Depends(authorize)], responses=controls)
    async def pause(trainer: Trainer = Depends(get_trainer)) -> dict:
        trainer.paused.set()
        return {"paused": True, "step": trainer.step}

    @app.post("/v1/train/resume", dependencies=[Depends(authorize)], responses=controls)
    async def resume(trainer: Trainer = Depends(get_trainer)) -> dict:
        trainer.paused.clear()
        return {"paused": False, "step": trainer.step}

    @app.post("/v1/checkpoint", dependencies=[Depends(authorize)], responses=controls)
    async def checkpoint(trainer: Trainer = Depends(get_trainer)) -> dict:
        await trainer.wait_published()
        path = await asyncio.to_thread(trainer.save_checkpoint)
        return {"step": trainer.step, "version": trainer.version, "path": str(path)}

    @app.get("/healthz")
    async def healthz(response: Response) -> dict:
        """Liveness: 503 when the step loop died or made no progress for stall_s (waiting out an
        outage counts as progress), so the orchestrator restarts the trainer."""
        problems = health.liveness.problems()
        if problems:
            response.status_code = 503
        return {"ok": not problems, "problems": problems, "loops": health.liveness.loops()}

    @app.get("/readyz")
    async def readyz(response: Response) -> dict:
        """Readiness: the model is loaded and running, and Redis and the registry answer now."""
        trainer = state["trainer"]
        reasons = []
        if trainer is None:
            reasons.append(state["error"] or "starting: loading the model and publishing v0")
        elif state["error"]:
            reasons.append(state["error"])
        reasons += health.liveness.problems()  # a dead or stuck loop cannot work either
        redis_error, registry_error = await asyncio.gather(
            _probe(state["coord"].redis.ping()), _probe(state["registry"].ping(PROBE_TIMEOUT_S)))
        if redis_error:
            reasons.append(f"redis: {redis_error}")
        if registry_error:
            reasons.append(f"registry: {registry_error}")
        if reasons:
            response.status_code = 503
        return {"ready": not reasons, "state": trainer.state if trainer else "starting", "error": state["error"],
                "reasons": reasons}

    @app.get("/metrics", responses=PROMETHEUS_TEXT)
    async def metrics() -> Response:
        trainer = state["trainer"]
        if trainer is not None:
            gauges["step"].set(trainer.step)
            gauges["version"].set(trainer.version)
            last = trainer.history[-1] if trainer.history else {}
            for name, gauge in gauges.items():
                if isinstance(last.get(name), int | float):
                    gauge.set(last[name])
            for lag, count in (last.get("staleness") or {}).items():
                staleness_gauge.labels(lag).set(count)
            fault_gauges["requeued_groups"].set(trainer.requeued)
            fault_gauges["duplicate_trajectories"].set(trainer.duplicates_dropped)
            fault_gauges["redis_data_losses"].set(trainer.redis_data_losses)
        health_metrics.update([health.redis, health.registry], health.liveness)
        with contextlib.suppress(Exception):
            for name, value in (await state["coord"].stats()).items():
                coord_gauge.labels(name).set(value)
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4")

    @app.get("/", include_in_schema=False)
    async def dashboard() -> Response:
        index = DASHBOARD / "index.html"
        if not index.is_file():
            return JSONResponse({"detail": "dashboard not built into this package"}, status_code=404)
        return FileResponse(index)

    if DASHBOARD.is_dir():  # the page's script and stylesheet
        app.mount("/dashboard", StaticFiles(directory=DASHBOARD), name="dashboard")

    app.state.trainer = state
    app.state.api_token = token
    return app


async def _probe(call: Any) -> str | None:
    """None when the awaitable completes within PROBE_TIMEOUT_S, else what went wrong."""
    try:
        await asyncio.wait_for(call, timeout=PROBE_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - any failure means: not ready
        return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return None


def _parse_jsonl(raw: bytes) -> list[PromptIn]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise HTTPException(422, f"line {line}: not UTF-8 (byte {exc.start} of the upload: {exc.reason})") from exc
    items = []
    for n, line in enumerate(text.split("\n"), start=1):  # JSONL lines end at \n only, not at U+2028
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise HTTPException(422, f"line {n}: not JSON ({exc.msg})") from exc
        except RecursionError as exc:
            raise HTTPException(422, f"line {n}: nested too deeply") from exc
        if not isinstance(obj, dict):
            raise HTTPException(422, f"line {n}: expected an object")
        if "prompt" not in obj and "question" in obj:  # GSM8K style: the answer ends with '#### N'
            try:
                prompt, answer = numeric_row(str(obj["question"]), str(obj.get("answer", "")))
            except ValueError as exc:
                raise HTTPException(422, f"line {n}: {exc}") from exc
            obj = {k: v for k, v in obj.items() if k not in ("question", "answer")} | {"prompt": prompt, "answer": answer}
        try:
            items.append(PromptIn.model_validate(obj))
        except ValidationError as exc:
            raise HTTPException(422, f"line {n}: {one_line_error(exc, 'body')}") from exc
    return items

