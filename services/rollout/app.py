"""HTTP API of a rollout worker: sparse-KV generation, an OpenAI completions subset, weights.

Routes only: services.rollout.service.RolloutService does the work (and runs the lease-driven
worker loop and the weight sync in the background when Redis and the registry are configured).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
from collections.abc import AsyncIterator, Iterator

from fastapi import Depends, FastAPI, HTTPException, Request, Response
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi_offline import FastAPIOffline

from services.rollout.api import CompletionRequest, GenerateRequest, GenerateResponse, WeightsInfo
from services.rollout.core import RolloutCore
from services.rollout.service import Refused, RolloutService
from services.rollout.settings import RolloutSettings
from shared.http import PROMETHEUS_TEXT, error_responses, install_error_handling
from shared.relay import RELAY_PATH, relay_endpoint
from shared.schemas import one_line_error

log = logging.getLogger(__name__)


def create_app(settings: RolloutSettings | None = None, core: RolloutCore | None = None) -> FastAPI:
    service = RolloutService(settings or RolloutSettings(), core, log)
    settings = service.settings

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with service.running():
            yield

    # /docs and /redoc with their scripts served by the app itself (no CDN: they work offline).
    app = FastAPIOffline(title="sparsecast rollout", version="0.1.0", lifespan=lifespan,
                         responses=error_responses(422),
                         description="Sparse-KV generation, an OpenAI completions subset, live weight sync.")
    install_error_handling(app)
    if settings.sync.relay:  # peers fetch the pieces this worker verified (shared.relay)
        app.add_route(RELAY_PATH, relay_endpoint(service.holdings), methods=["GET"], include_in_schema=False)
    bearer = HTTPBearer(auto_error=False)
    generation = error_responses(400, 401, 413, 503)

    def authorize(creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        if settings.api_token and (
            creds is None or not secrets.compare_digest(creds.credentials, settings.api_token)
        ):
            raise HTTPException(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})

    def loaded() -> None:
        """503 while the model loads (before the body is looked at, as a dependency)."""
        with refusals():
            service.loaded_core()

    @app.post("/v1/generate", response_model=GenerateResponse, responses=generation,
              dependencies=[Depends(authorize), Depends(loaded)])
    async def generate(req: GenerateRequest) -> GenerateResponse:
        with refusals():
            return await service.generate(req)

    @app.post("/v1/completions", responses=generation, dependencies=[Depends(authorize), Depends(loaded)])
    async def completions(req: CompletionRequest) -> dict:
        with refusals():
            return await service.completions(req)

    @app.get("/v1/models")
    async def models() -> dict:
        return service.models()

    @app.get("/v1/weights", response_model=WeightsInfo, responses=error_responses(503),
             dependencies=[Depends(loaded)])
    async def weights() -> WeightsInfo:
        with refusals():
            return service.weights()

    @app.get("/healthz")
    async def healthz(response: Response) -> dict:
        """Liveness: 503 when a background loop (boot, weight sync, worker, heartbeats) died or
        made no progress for stall_s, so the orchestrator restarts the worker. Waiting out an
        outage, or for the run's first version, is progress."""
        report = service.liveness_report()
        if not report["ok"]:
            response.status_code = 503
        return report

    @app.get("/readyz")
    async def readyz(response: Response) -> dict:
        """Readiness: weights of a published version are loaded, and Redis and the registry
        (when configured) answer now."""
        report = await service.readiness()
        if not report["ready"]:
            response.status_code = 503
        return report

    @app.get("/metrics", responses=PROMETHEUS_TEXT)
    async def prometheus() -> Response:
        return Response(service.metrics_text(), media_type="text/plain; version=0.0.4")

    @app.exception_handler(ValueError)
    async def value_error(_: Request, exc: ValueError) -> Response:
        return JSONResponse({"detail": one_line_error(exc)}, status_code=422)

    app.state.rollout = service
    app.state.liveness = service.liveness
    return app


@contextlib.contextmanager
def refusals() -> Iterator[None]:
    """A service's Refused as the HTTP error of its status."""
    try:
        yield
    except Refused as exc:
        raise HTTPException(exc.status, exc.detail) from exc
