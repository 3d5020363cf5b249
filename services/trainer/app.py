"""HTTP API of the trainer: prompts in, status/versions/metrics out, pause/resume/checkpoint,
and the dashboard. Routes only: services.trainer.service.TrainerService does the work (prompt
intake in services.trainer.intake)."""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import Depends, FastAPI, HTTPException, Query, Request, Response
from fastapi.responses import FileResponse, JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.staticfiles import StaticFiles
from fastapi_offline import FastAPIOffline

from services.trainer.core import Trainer
from services.trainer.intake import IntakeError, PromptsAccepted, PromptsRequest, json_prompts, parse_jsonl
from services.trainer.service import THROUGHPUT_EVERY_S, TrainerService, Unavailable
from services.trainer.settings import TrainerSettings
from shared.http import PROMETHEUS_TEXT, BodyLimit, error_responses, inline_schema, install_error_handling
from shared.tasks import list_tasks

DASHBOARD = Path(__file__).parent / "dashboard"

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


def create_app(settings: TrainerSettings | None = None) -> FastAPI:
    service = TrainerService(settings or TrainerSettings())
    settings, token = service.settings, service.token

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with service.running():
            yield

    # /docs and /redoc with their scripts served by the app itself (no CDN: they work offline).
    app = FastAPIOffline(title="sparsecast trainer", version="0.1.0", lifespan=lifespan,
                         responses=error_responses(422),
                         description="GRPO with Sparse-RL corrections; a sparse weight patch published "
                                     "every step.")
    install_error_handling(app)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    bearer = HTTPBearer(auto_error=False)
    controls = error_responses(401, 503)

    def authorize(creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        if creds is None or not secrets.compare_digest(creds.credentials, token):
            raise HTTPException(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})

    def get_trainer() -> Trainer:
        try:
            return service.running_trainer()
        except Unavailable as exc:
            raise HTTPException(503, str(exc)) from exc

    @app.post("/v1/prompts", dependencies=[Depends(authorize)], openapi_extra=PROMPTS_BODY,
              responses=error_responses(400, 401, 413, 415, 422, 429, 503))
    async def submit_prompts(
        request: Request,
        task: str | None = Query(None, json_schema_extra={"enum": list_tasks()}),
        samples_per_prompt: int | None = Query(None, ge=1, le=1024),
    ) -> PromptsAccepted:
        """JSON body (PromptsRequest), or a JSONL upload (application/x-ndjson or multipart file):
        one object per line with `prompt` (or GSM8K-style `question`) and `answer`."""
        ctype = request.headers.get("content-type", "")
        try:
            if ctype.startswith("application/json"):
                name, samples, items = json_prompts(await request.body(), task, settings.default_task)
                return await service.submit(name, samples or samples_per_prompt, items)
            if ctype.startswith("multipart/form-data"):
                async with request.form() as form:  # closes the spooled upload files
                    upload = form.get("file")
                    if upload is None or isinstance(upload, str):
                        raise HTTPException(422, "multipart upload needs a 'file' field holding JSONL")
                    raw = await upload.read()
            elif ctype.startswith(("application/x-ndjson", "application/jsonl", "text/plain")):
                raw = await request.body()
            else:
                raise HTTPException(
                    415, "send application/json, application/x-ndjson (JSONL) or a multipart 'file'"
                )
            return await service.submit(task, samples_per_prompt, parse_jsonl(raw))
        except IntakeError as exc:
            raise HTTPException(exc.status, exc.detail) from exc

    @app.get("/v1/tasks")
    async def tasks() -> dict:
        return {"tasks": list_tasks(), "default": settings.default_task}

    @app.get("/v1/status")
    async def status() -> dict:
        """Never fails for a Redis fault: with Redis unreachable, queue and workers are null and
        `redis_error` says why."""
        return await service.status()

    @app.get("/v1/versions")
    async def versions() -> dict:
        try:
            return await service.versions()
        except Unavailable as exc:
            raise HTTPException(503, str(exc)) from exc

    @app.get("/v1/metrics/history")
    async def history(since: int = Query(0, ge=0, description="steps after this one")) -> dict:
        return {"history": service.history(since)}

    @app.get("/v1/metrics/throughput")
    async def throughput_history(
            since: float = Query(0.0, ge=0, description="samples after this Unix time")) -> dict:
        """Each rollout worker's tokens/s as the server sampled it every `interval_s` (last hour)."""
        return {"interval_s": THROUGHPUT_EVERY_S, "samples": service.throughput_since(since)}

    @app.get("/v1/leases", responses=error_responses(503))
    async def leases(limit: int = Query(100, ge=1, le=1000, description="rows of each list")) -> dict:
        """Leases held now (holder, seconds to expiry, reclaims; expired or released ones wait for
        the next claim) and the dead letters with their reasons."""
        try:
            return await service.leases(limit)
        except Unavailable as exc:
            raise HTTPException(503, str(exc)) from exc

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
        path = await trainer.checkpoint()
        return {"step": trainer.step, "version": trainer.state_version, "path": str(path)}

    @app.get("/healthz")
    async def healthz(response: Response) -> dict:
        """Liveness: 503 when the step loop died or made no progress for stall_s (waiting out an
        outage counts as progress), so the orchestrator restarts the trainer."""
        report = service.liveness()
        if not report["ok"]:
            response.status_code = 503
        return report

    @app.get("/readyz")
    async def readyz(response: Response) -> dict:
        """Readiness: the model is loaded and running, and Redis and the registry answer now."""
        report = await service.readiness()
        if not report["ready"]:
            response.status_code = 503
        return report

    @app.get("/metrics", responses=PROMETHEUS_TEXT)
    async def metrics() -> Response:
        return Response(await service.metrics_text(), media_type="text/plain; version=0.0.4")

    @app.get("/", include_in_schema=False)
    async def dashboard() -> Response:
        index = DASHBOARD / "index.html"
        if not index.is_file():
            return JSONResponse({"detail": "dashboard not built into this package"}, status_code=404)
        return FileResponse(index)

    if DASHBOARD.is_dir():  # the page's script and stylesheet
        app.mount("/dashboard", StaticFiles(directory=DASHBOARD), name="dashboard")

    app.state.trainer = service.state
    app.state.api_token = token
    return app
