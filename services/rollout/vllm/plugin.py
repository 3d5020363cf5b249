"""vLLM plugins (entry points in pyproject.toml) that make the registry a weight source of a stock
`vllm serve` (docs/vllm.md, "Stock `vllm serve` with the registry as weight source").

- `register` (`vllm.general_plugins`, loaded in every vLLM process): registers the weight-transfer
  backend "sparsecast" (`services.rollout.vllm.transfer`), chosen with
  `--weight-transfer-config '{"backend": "sparsecast"}'`.
- `SparsecastEndpoints` (`vllm.endpoint_plugins`, opt-in by `VLLM_PLUGINS=sparsecast`): the routes
  an operator or `python -m services.rollout.vllm.pull` drives, under /v1 so vLLM's `--api-key`
  guards them, without vLLM's dev mode (which would also open /collective_rpc and friends):
  `POST /v1/sparsecast/pull` and `GET /v1/sparsecast/weights`.

A pull pauses generation (in-flight requests finish on the old weights: no sequence mixes two
versions), runs vLLM's weight-update protocol with the backend, and resumes; queued requests then
run on the new version. vLLM's own RL routes (`VLLM_SERVER_DEV_MODE=1`: /pause,
/init_weight_transfer_engine, /start_weight_update, /update_weights, /finish_weight_update,
/resume) drive the same backend.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from argparse import Namespace
from typing import TYPE_CHECKING, Any, Literal

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from shared.http import is_loopback
from shared.registry.client import RegistryClient
from shared.registry.errors import RegistryHTTPError
from shared.retry import transient
from shared.schemas import DEFAULT_RUN

if TYPE_CHECKING:
    from starlette.datastructures import State
    from vllm.engine.protocol import EngineClient

# Under vLLM's logger tree: vllm serve prints these with its own (it configures only "vllm.*").
log = logging.getLogger("vllm.sparsecast")

PLUGIN = "sparsecast"  # the entry points' name, what VLLM_PLUGINS must list
BACKEND = "sparsecast"  # the weight-transfer backend: --weight-transfer-config '{"backend": "sparsecast"}'
PULL_PATH = "/v1/sparsecast/pull"
WEIGHTS_PATH = "/v1/sparsecast/weights"
# How a failed pull's error (raised in a vLLM worker) names the version the served weights hold.
HELD = "the served weights are v{version}"
_HELD_RE = re.compile(r"the served weights are v(-?\d+)")


def held_version(message: str) -> int | None:
    """The version a failed pull's error says the weights hold (None: not said, or unpublished)."""
    match = _HELD_RE.search(message)
    return int(match.group(1)) if match and int(match.group(1)) >= 0 else None


def register() -> None:
    """`vllm.general_plugins` entry point: vLLM calls it in every process, possibly more than once."""
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "services.rollout.vllm.transfer", "RegistryWeightTransferEngine"
        )
    except ValueError:  # registered already (vLLM loads plugins once per process, tests more)
        pass


class PullRequest(BaseModel):
    """Which version of which run to serve. Registry fields left out come from the server's
    environment (SPARSECAST_REGISTRY_URL, SPARSECAST_RUN, SPARSECAST_REGISTRY_TOKEN)."""

    version: int | None = Field(default=None, ge=0, description="None: the run's head")
    registry_url: str | None = None
    run: str | None = None
    token: str | None = None
    # wait: in-flight requests finish on the old weights first; abort: they are cut off now.
    mode: Literal["wait", "abort"] = "wait"


class _Source(BaseModel):
    registry_url: str
    run: str
    token: str | None = None


def _error(status: int, detail: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"detail": detail, **extra}, status_code=status)


class SparsecastEndpoints:
    """`vllm.endpoint_plugins` entry point: the pull and status routes on vLLM's API server."""

    name = PLUGIN
    required_tasks = ("generate",)

    def __init__(self) -> None:
        self.engine: EngineClient | None = None
        self.source: _Source | None = None
        self.version: int | None = None  # None: unknown until the first pull
        self.last: dict[str, Any] | None = None
        self._lock = asyncio.Lock()

    async def init_state(self, engine_client: EngineClient | None, state: State, args: Namespace) -> None:
        host = getattr(args, "host", None) or "0.0.0.0"
        api_key = getattr(args, "api_key", None) or os.environ.get("VLLM_API_KEY")
        if not api_key and not getattr(args, "uds", None) and not is_loopback(host):
            # Anyone reaching this address could make the server load other weights.
            raise SystemExit(f"sparsecast vLLM plugin: refusing {PULL_PATH} on {host} without an API key; "
                             "start vllm serve with --api-key (or VLLM_API_KEY), or --host 127.0.0.1")
        self.engine = engine_client

    def attach_router(self, app: FastAPI) -> None:
        router = APIRouter()
        router.add_api_route(PULL_PATH, self.pull, methods=["POST"])
        router.add_api_route(WEIGHTS_PATH, self.weights, methods=["GET"])
        app.include_router(router)

    def _source(self, body: PullRequest) -> _Source | None:
        env = os.environ.get
        url = body.registry_url or env("SPARSECAST_REGISTRY_URL")
        if not url:
            return None
        return _Source(registry_url=url, run=body.run or env("SPARSECAST_RUN") or DEFAULT_RUN,
                       token=body.token or env("SPARSECAST_REGISTRY_TOKEN") or None)

    async def weights(self, request: Request) -> JSONResponse:
        """The version served (null until the first pull), the run and registry, the last pull."""
        source = self.source
        return JSONResponse({
            "version": self.version,
            "run": source.run if source else None,
            "registry_url": source.registry_url if source else None,
            "last_pull": self.last,
        })

    async def pull(self, body: PullRequest) -> JSONResponse:
        """Serve `version` (or the head) of the run: 200 with the version, 404 for a version the
        run does not have, 503 while the registry or the engine is unreachable, 502 when the
        pull failed (the answer says which verified version the weights then hold)."""
        engine = self.engine
        if engine is None:
            return _error(503, "the vLLM engine is not up")
        source = self._source(body)
        if source is None:
            return _error(422, "no registry: give registry_url or set SPARSECAST_REGISTRY_URL for vllm serve")
        async with self._lock:
            # Resolve the target before pausing anything: an unknown version costs no generation.
            try:
                async with RegistryClient(source.registry_url, source.run, token=source.token,
                                          retries=2) as client:
                    head = await client.latest()
                    if head is None:
                        return _error(404, f"run {source.run!r} has no versions yet")
                    target = head.version if body.version is None else body.version
                    if target > head.version:
                        return _error(404, f"run {source.run!r} has no version {target} "
                                           f"(its head is v{head.version})")
                    await client.manifest(target)
            except RegistryHTTPError as exc:
                if exc.status == 404:
                    return _error(404, f"run {source.run!r} has no version {body.version}: {exc}")
                return _error(503 if transient(exc) else 502, f"registry {source.registry_url}: {exc}")
            except Exception as exc:  # noqa: BLE001 - connection errors of any kind
                if not transient(exc):
                    raise
                return _error(503, f"registry {source.registry_url} unreachable: {exc}")

            from vllm.distributed.weight_transfer.base import (
                WeightTransferInitRequest,
                WeightTransferUpdateRequest,
            )

            if source != self.source:
                try:
                    await engine.init_weight_transfer_engine(
                        WeightTransferInitRequest(init_info=source.model_dump()))
                except Exception as exc:  # noqa: BLE001 - the worker's message is the answer
                    return _error(409, f"weight source not set up: {exc}")
                self.source, self.version = source, None
            if target == self.version:
                return JSONResponse({"version": target, "pulled": False})
            return await self._update(engine, target, body.mode, WeightTransferUpdateRequest)

    async def _update(self, engine: EngineClient, target: int, mode: Literal["wait", "abort"],
                      request_cls: Any) -> JSONResponse:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        # The pause clears the prefix cache once the engine is idle, before the new weights land.
        await engine.pause_generation(mode=mode, clear_cache=True)
        paused = loop.time()
        try:
            await engine.start_weight_update()
            try:
                await engine.update_weights(request=request_cls(update_info={"version": target}))
            except Exception as exc:  # noqa: BLE001 - a failed pull must not take the server down
                self.version = held_version(str(exc))
                if self.version is not None:
                    await engine.update_weight_version(str(self.version))
                self.last = {"version": target, "ok": False, "error": str(exc)}
                log.warning("sparsecast pull of v%d failed: %s", target, exc)
                return _error(502, str(exc), version=self.version)
            await engine.finish_weight_update(weight_version=str(target))
        finally:
            await engine.resume_generation()
        self.version = target
        self.last = {"version": target, "ok": True, "drain_s": round(paused - t0, 3),
                     "update_s": round(loop.time() - paused, 3)}
        log.info("sparsecast: serving v%d of run %r", target, self.source.run if self.source else "?")
        return JSONResponse({"version": target, "pulled": True, **self.last})
