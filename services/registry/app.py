"""HTTP surface of the registry: routes over service.RegistryService (lifecycle, request checks)
and its core.Registry."""

from __future__ import annotations

import json
import logging
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Path, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi_offline import FastAPIOffline
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from services.registry.core import KEY_PART, OBJECT_FOLDERS, RUN_NAME
from services.registry.errors import BadRange, InsufficientStorage, RegistryError
from services.registry.ranges import parse_range
from services.registry.service import RegistryService
from services.registry.settings import RegistrySettings
from shared.http import PROMETHEUS_TEXT, error_responses, install_error_handling
from shared.registry.wire import (
    GROUPS_HEADER,
    METRICS_HEADER,
    MODEL_FILES,
    ROLLOUT_HEADER,
    Manifest,
    Plan,
    RepairStatus,
    RolloutDirective,
    Verdict,
)
from shared.relay import PeerAnnouncement, PeerList
from shared.schemas import MAX_GROUP_ID_CHARS, one_line_error
from shared.storage import ObjectStorage

log = logging.getLogger(__name__)

SMALL_READ_BYTES = 16 << 20  # ranges up to this are read at once; larger ones are streamed


# Path parameters as the OpenAPI describes them. The core checks them (one place, one message);
# these only tell clients and fuzzers what is valid.
Run = Annotated[str, Path(description="run name", json_schema_extra={"pattern": RUN_NAME.pattern})]
ObjectKey = Annotated[str, Path(description="an object key, e.g. patches/3-4.patch", json_schema_extra={
    "pattern": f"^({'|'.join(f.rstrip('/') for f in OBJECT_FOLDERS)})/{KEY_PART.pattern}$"})]
ModelFile = Annotated[
    str, Path(description="a config or tokenizer file", json_schema_extra={"enum": list(MODEL_FILES)})
]


def upload_body(description: str) -> dict:
    """openapi_extra of a PUT whose raw body the handler streams in itself."""
    return {"requestBody": {"required": True, "description": description, "content": {
        "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}}


def create_app(settings: RegistrySettings | None = None, storage: ObjectStorage | None = None) -> FastAPI:
    service = RegistryService(settings or RegistrySettings(), storage)
    registry, storage = service.registry, service.storage

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async with service.running():
            yield

    # /docs and /redoc with their scripts served by the app itself (no CDN: they work offline).
    app = FastAPIOffline(title="sparsecast registry", lifespan=lifespan, responses=error_responses(422))
    app.state.registry = registry
    install_error_handling(app)
    reads = error_responses(404)
    writes = error_responses(400, 401, 408, 409, 413, 507)
    require_token, require_publish_token = service.require_token, service.require_publish_token
    read_body, bearer = service.read_body, service.bearer

    @app.exception_handler(RegistryError)
    async def registry_error(request: Request, exc: RegistryError) -> JSONResponse:
        registry.metrics.rejections.labels(str(exc.status)).inc()
        headers = {"Content-Range": f"bytes */{exc.size}"} if isinstance(exc, BadRange) else None
        if isinstance(exc, InsufficientStorage):  # an outage: clients wait and retry (shared.retry)
            headers = {"Retry-After": str(exc.retry_after_s)}
        return JSONResponse({"detail": str(exc)}, status_code=exc.status, headers=headers)

    def rollout_directive(request: Request) -> RolloutDirective | None:
        """The upload's X-Sparsecast-Rollout header (None when absent); anything but a JSON object
        of RolloutDirective's fields, each valid, is a 422."""
        raw = request.headers.get(ROLLOUT_HEADER)
        if raw is None:
            return None
        try:
            value = json.loads(raw)
        except ValueError as exc:
            raise HTTPException(422, f"{ROLLOUT_HEADER} is not JSON: {exc}") from exc
        if not isinstance(value, dict):
            raise HTTPException(422, f"{ROLLOUT_HEADER} must be a JSON object")
        unknown = sorted(set(value) - set(RolloutDirective.model_fields))
        if unknown:
            raise HTTPException(422, f"{ROLLOUT_HEADER}: unknown fields {unknown}; known: "
                                     f"{sorted(RolloutDirective.model_fields)}")
        try:
            return RolloutDirective.model_validate(value, strict=True)
        except ValidationError as exc:
            raise HTTPException(422, f"{ROLLOUT_HEADER}: {one_line_error(exc)}") from exc

    def group_ids(request: Request) -> list[str]:
        """The upload's X-Sparsecast-Groups header: a JSON list of group ids (the prompt groups the
        version trained), [] when absent; anything else is a 422."""
        raw = request.headers.get(GROUPS_HEADER)
        if raw is None:
            return []
        try:
            value = json.loads(raw)
        except ValueError as exc:
            raise HTTPException(422, f"{GROUPS_HEADER} is not JSON: {exc}") from exc
        if not isinstance(value, list) or not all(
                isinstance(g, str) and 0 < len(g) <= MAX_GROUP_ID_CHARS for g in value):
            raise HTTPException(422, f"{GROUPS_HEADER} must be a JSON list of group ids "
                                     f"(strings of 1-{MAX_GROUP_ID_CHARS} characters)")
        return value

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        """Alive (always 200): `status` is `degraded`, with `reasons`, while the store is full, the
        scrub cannot reach it or a run's head cannot be reached from a good snapshot."""
        return registry.health()

    @app.get("/readyz", responses={503: {"description": "the store cannot be reached"}})
    async def readyz() -> JSONResponse:
        if (why := await service.not_ready()) is not None:
            return JSONResponse({"status": "unavailable", "detail": why}, status_code=503)
        return JSONResponse({"status": "ready"})

    @app.get("/metrics", responses=PROMETHEUS_TEXT)
    async def metrics() -> Response:
        registry.health()  # refreshes the quarantine gauges
        return Response(generate_latest(registry.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/runs/{run}/quarantine", responses=reads)
    async def quarantine(run: Run) -> RepairStatus:
        """Stored objects found corrupt or gone (plans route around them), and the version a
        snapshot is wanted of while no good snapshot and chain reach the head (the trainer polls
        this and uploads one)."""
        return await registry.repair_status(run)

    @app.post("/v1/runs/{run}/quarantine/{key:path}", responses=reads)
    async def report_corrupt(run: Run, key: ObjectKey) -> Verdict:
        """A reader found this object failing its sha256. The registry re-checks what it stores and
        quarantines it if bad (a report alone proves nothing; a good object is not re-checked for
        a minute)."""
        return await registry.report_corrupt(run, key)

    @app.get("/v1/runs/{run}/versions", responses=reads)
    async def versions(run: Run) -> list[Manifest]:
        return await registry.versions(run)

    @app.get("/v1/runs/{run}/latest", responses=reads)
    async def latest(run: Run) -> Manifest:
        return await registry.manifest(run)

    @app.get("/v1/runs/{run}/manifests/{version}", responses=reads)
    async def manifest(run: Run, version: int) -> Manifest:
        return await registry.manifest(run, version)

    @app.get("/v1/runs/{run}/plan", responses=reads)
    async def plan(
        run: Run, request: Request, from_version: int = Query(-1, alias="from"),
        to_version: int | None = Query(None, alias="to"),
        peer: str | None = Query(None, description="the asking worker's id: left out of `peers`"),
    ) -> Plan:
        """Cheapest way from `from` to `to`. Reads never write: only a request with the bearer
        token may have a missing merged patch built now; others get what is stored (the next
        publish builds the merges such plans wanted). `peers` lists workers serving each object."""
        return await registry.plan(run, from_version, to_version, build_merges=bearer(request), peer=peer)

    @app.put("/v1/runs/{run}/peers/{worker}", dependencies=[Depends(require_token)], responses=writes)
    async def announce_peer(run: Run, worker: str, body: PeerAnnouncement) -> PeerList:
        """A worker serves these objects (held or being fetched) at `url`; answers the peers it
        should fetch each of them from (shared.relay)."""
        return await registry.announce_peer(run, worker, body)

    @app.delete("/v1/runs/{run}/peers/{worker}", dependencies=[Depends(require_token)],
                responses=writes | error_responses(404))
    async def leave_peer(run: Run, worker: str) -> dict[str, str]:
        await registry.leave_peer(run, worker)
        return {"left": worker}

    @app.get("/v1/runs/{run}/objects/{key:path}", responses={
        200: {"content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
              "description": "the object, or the requested range (206)"},
        206: {"description": "a range of the object"}, **reads, **error_responses(416)})
    async def get_object(run: Run, key: ObjectKey, request: Request) -> Response:
        store_key, size = await registry.object_size(run, key)
        span = parse_range(request.headers.get("range"), size)
        start, end = span if span else (0, size)
        partial = span is not None
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

    @app.put("/v1/runs/{run}/patches/{version}", dependencies=[Depends(require_publish_token)],
             responses=writes,
             openapi_extra=upload_body("a patch, docs/patch-format.md"))
    async def put_patch(run: Run, version: int, request: Request, metrics: str | None = None) -> Manifest:
        raw = request.headers.get(METRICS_HEADER) or metrics or "{}"
        try:
            step_metrics = json.loads(raw)
        except ValueError as exc:
            raise HTTPException(422, f"metrics are not JSON: {exc}") from exc
        if not isinstance(step_metrics, dict):
            raise HTTPException(422, "metrics must be a JSON object")
        rollout = rollout_directive(request)
        groups = group_ids(request)
        return await registry.publish_patch(run, version, await read_body(request, "patch"), step_metrics,
                                            rollout, groups)

    @app.put("/v1/runs/{run}/snapshots/{version}", dependencies=[Depends(require_publish_token)],
             responses=writes,
             openapi_extra=upload_body("a snapshot: safetensors with sparsecast metadata"))
    async def put_snapshot(run: Run, version: int, request: Request) -> Manifest:
        rollout = rollout_directive(request)
        return await registry.publish_snapshot(run, version, await read_body(request, "snapshot"),
                                               rollout=rollout)

    @app.get("/v1/runs/{run}/model", responses=reads)
    async def model_files(run: Run) -> list[str]:
        return await registry.model_files(run)

    @app.put(
        "/v1/runs/{run}/model/{name}",
        dependencies=[Depends(require_publish_token)],
        responses=writes,
        openapi_extra={
            "requestBody": {
                "required": True,
                "description": "a config or tokenizer JSON file",
                "content": {"application/json": {"schema": {"type": "object"}}},
            }
        },
    )
    async def put_model_file(run: Run, name: ModelFile, request: Request) -> dict[str, str]:
        await registry.put_model_file(run, name, await read_body(request, "model"))
        return {"stored": name}

    @app.get(
        "/v1/runs/{run}/model/{name}",
        responses={
            200: {"content": {"application/json": {"schema": {"type": "object"}}}, "description": "the file"},
            **reads,
        },
    )
    async def get_model_file(run: Run, name: ModelFile) -> Response:
        return Response(await registry.get_model_file(run, name), media_type="application/json")

    return app
