"""The registry service without routes: its store, Redis announcer and core (`core.Registry`),
their lifecycle (the maintenance loop), readiness, and the checks every request shares (bearer
tokens, streamed upload bodies). services.registry.app is a thin FastAPI layer over this, as the
trainer's and the rollout's app.py are over their service.py; core.py is the registry itself."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import AsyncIterator
from typing import NoReturn

from fastapi import HTTPException, Request

from services.registry.core import RedisAnnouncer, Registry
from services.registry.errors import TimedOut
from services.registry.settings import RegistrySettings
from services.registry.uploads import UploadCheck, UploadKind
from shared.settings import publish_credential
from shared.storage import ObjectStorage

log = logging.getLogger(__name__)


class RegistryService:
    def __init__(self, settings: RegistrySettings, storage: ObjectStorage | None = None) -> None:
        self.settings = settings
        self.storage = storage or ObjectStorage(settings.store_url, options=settings.store_options)
        self.announcer = (RedisAnnouncer(settings.redis_url, settings.redis_prefix)
                          if settings.redis_url else None)
        self.registry = Registry(self.storage, settings,
                                 announce=self.announcer.announce if self.announcer else None)
        # Publishing (patches, snapshots, model files) needs the publish token, which only the trainer
        # holds; the API token (workers' relay announcements, merge-building plans) cannot publish.
        self.publish_token = publish_credential(settings.publish_token, settings.api_token, "registry")
        if not self.publish_token:
            log.warning("SPARSECAST_PUBLISH_TOKEN is unset: any local process can publish (loopback only)")

    # -- lifecycle --

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """The maintenance loop (scrub, store-full probe) while the app serves; then close."""
        stop = asyncio.Event()
        maintenance = asyncio.create_task(self.registry.maintain(stop))
        try:
            yield
        finally:
            stop.set()
            with contextlib.suppress(Exception):
                await maintenance
            await self.registry.close()
            if self.announcer:
                await self.announcer.aclose()

    async def not_ready(self) -> str | None:
        """Why the registry is not ready (its store cannot be reached), or None."""
        try:
            # obstore retries an unreachable store for minutes; a probe must answer promptly.
            await asyncio.wait_for(self.storage.ping(), timeout=5.0)
        except Exception as exc:  # noqa: BLE001 - any storage failure means not ready
            return str(exc)
        return None

    # -- what every request is checked for --

    @staticmethod
    def carries(request: Request, token: str | None) -> bool:
        """The request carries `token` (never true for an unset one)."""
        given = request.headers.get("authorization", "")
        expected = f"Bearer {token}".encode()
        return bool(token) and hmac.compare_digest(given.encode("utf-8", "replace"), expected)

    def bearer(self, request: Request) -> bool:
        """The request carries the API token or the publish token."""
        return self.carries(request, self.settings.api_token) or self.carries(request, self.publish_token)

    def refuse(self) -> NoReturn:
        self.registry.metrics.rejections.labels("401").inc()
        raise HTTPException(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})

    def require_token(self, request: Request) -> None:
        # Without a token writes are open: allowed on loopback only (__main__ refuses other binds).
        if self.settings.api_token and not self.bearer(request):
            self.refuse()

    def require_publish_token(self, request: Request) -> None:
        if self.publish_token and not self.carries(request, self.publish_token):
            self.refuse()

    async def read_body(self, request: Request, kind: UploadKind) -> bytes:
        """The upload, streamed in: size limit, magic bytes and the body's own declared length are
        checked as bytes arrive, so junk is refused after its first bytes, not once held."""
        settings = self.settings
        declared = request.headers.get("content-length")
        check = UploadCheck(
            kind, settings.max_upload_bytes, int(declared) if declared and declared.isdigit() else None
        )
        # A slow client is refused (408), not waited for: no chunk for upload_idle_s, or longer
        # than upload_timeout_s in all, holds neither memory nor a connection for long.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + settings.upload_timeout_s
        chunks = request.stream().__aiter__()
        while True:
            wait = min(settings.upload_idle_s, deadline - loop.time())
            try:
                chunk = await asyncio.wait_for(anext(chunks), timeout=max(wait, 0.0))
            except StopAsyncIteration:
                break
            except TimeoutError as exc:
                raise TimedOut(f"upload stalled: no bytes for {settings.upload_idle_s:g} s, or over "
                               f"{settings.upload_timeout_s:g} s in all (after {len(check.body)} bytes)"
                               ) from exc
            check.feed(chunk)
        return check.finish()
