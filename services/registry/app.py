"""HTTP surface of the registry: a thin FastAPI layer over core.Registry."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.registry.core import BadRange, RedisAnnouncer, Registry, RegistryError, TooLarge
from services.registry.settings import RegistrySettings
from shared.registry_client import METRICS_HEADER, Manifest, Plan
from shared.storage import ObjectStorage

log = logging.getLogger(__name__)

SMALL_READ_BYTES = 16 << 20  # ranges up to this are read at once; larger ones are streamed


def create_app(settings: RegistrySettings | None = None, storage: ObjectStorage | None = None) -> FastAPI:
    settings = settings or RegistrySettings()
    storage = storage or ObjectStorage(settings.store_url, s3=settings.s3_options())
    announcer = RedisAnnouncer(settings.redis_url, settings.redis_prefix) if settings.redis_url else None
    registry = Registry(storage, settings, announce=announcer.announce if announcer else None)
    if not settings.api_token:
        log.warning("SPARSECAST_API_TOKEN is unset: anyone who reaches the registry can publish")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await registry.close()
        if announcer:
            await announcer.aclose()

    app = FastAPI(title="sparsecast registry", lifespan=lifespan)
    app.state.registry = registry

    @app.exception_handler(RegistryError)
    async def registry_error(request: Request, exc: RegistryError) -> JSONResponse:
        registry.metrics.rejections.labels(str(exc.status)).inc()
        headers = {"Content-Range": f"bytes */{exc.size}"} if isinstance(exc, BadRange) else None
        return JSONResponse({"detail": str(exc)}, status_code=exc.status, headers=headers)

    def require_token(request: Request) -> None:
        if not settings.api_token:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {settings.api_token}".encode()):
            registry.metrics.rejections.labels("401").inc()
            raise HTTPException(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})

    async def read_body(request: Request) -> bytes:
        """The upload, streamed in with the size limit enforced as bytes arrive."""
        limit = settings.max_upload_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise TooLarge(f"body of {declared} bytes exceeds the limit of {limit}")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise TooLarge(f"body exceeds the limit of {limit} bytes")
        if not body:
            raise RegistryError("empty body")
        return bytes(body)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        try:
            # obstore retries an unreachable store for minutes; a probe must answer promptly.
            await asyncio.wait_for(storage.ping(), timeout=5.0)
        except Exception as exc:  # noqa: BLE001 - any storage failure means not ready
            return JSONResponse({"status": "unavailable", "detail": str(exc)}, status_code=503)
        return JSONResponse({"status": "ready"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/runs/{run}/versions")
    async def versions(run: str) -> list[Manifest]:
        return await registry.versions(run)

    @app.get("/v1/runs/{run}/latest")
    async def latest(run: str) -> Manifest:
        return await registry.manifest(run)

    @app.get("/v1/runs/{run}/manifests/{version}")
    async def manifest(run: str, version: int) -> Manifest:
        return await registry.manifest(run, version)

    @app.get("/v1/runs/{run}/plan")
    async def plan(
        run: str, from_version: int = Query(-1, alias="from"), to_version: int | None = Query(None, alias="to")
    ) -> Plan:
        return await registry.plan(run, from_version, to_version)

    @app.get("/v1/runs/{run}/objects/{key:path}")
    async def get_object(run: str, key: str, request: Request) -> Response:
        store_key, start, end, size, partial = await registry.object_range(run, key, request.headers.get("range"))
        headers = {"Accept-Ranges": "bytes", "Content-Length": str(end - start)}
        if partial:
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
        status = 206 if partial else 200
        registry.metrics.bytes_served.inc(end - start)
        if end - start <= SMALL_READ_BYTES:  # a piece: one read beats a stream's per-chunk hops
            data = await storage.get_range(store_key, start, end)
            return Response(data, status_code=status, headers=headers, media_type="application/octet-stream")
        return StreamingResponse(
            storage.stream(store_key, start, end), status_code=status, headers=headers,
            media_type="application/octet-stream",
        )

    @app.put("/v1/runs/{run}/patches/{version}", dependencies=[Depends(require_token)])
    async def put_patch(run: str, version: int, request: Request, metrics: str | None = None) -> Manifest:
        raw = request.headers.get(METRICS_HEADER) or metrics or "{}"
        try:
            step_metrics = json.loads(raw)
        except ValueError as exc:
            raise HTTPException(422, f"metrics are not JSON: {exc}") from exc
        if not isinstance(step_metrics, dict):
            raise HTTPException(422, "metrics must be a JSON object")
        return await registry.publish_patch(run, version, await read_body(request), step_metrics)

    @app.put("/v1/runs/{run}/snapshots/{version}", dependencies=[Depends(require_token)])
    async def put_snapshot(run: str, version: int, request: Request) -> Manifest:
        return await registry.publish_snapshot(run, version, await read_body(request))

    @app.get("/v1/runs/{run}/model")
    async def model_files(run: str) -> list[str]:
        return await registry.model_files(run)

    @app.put("/v1/runs/{run}/model/{name}", dependencies=[Depends(require_token)])
    async def put_model_file(run: str, name: str, request: Request) -> dict[str, str]:
        await registry.put_model_file(run, name, await read_body(request))
        return {"stored": name}

    @app.get("/v1/runs/{run}/model/{name}")
    async def get_model_file(run: str, name: str) -> Response:
        return Response(await registry.get_model_file(run, name), media_type="application/json")

    return app
