"""One run's HTTP plumbing: paths, auth, error answers, retries with exponential backoff."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx

from shared.registry.errors import RegistryHTTPError

log = logging.getLogger(__name__)

# How long an idle connection is kept, by clients and servers alike (the registry's, a worker's
# relay endpoint): longer than the time between versions, so that the next version's transfers
# reuse connections whose congestion and receive windows already grew (with
# net.ipv4.tcp_slow_start_after_idle=0) instead of new ones starting from TCP's initial window,
# which costs seconds at 100 ms round trips (docs/registry.md). uvicorn's and httpx's own are 5 s.
KEEP_ALIVE_S = 300


@dataclass
class Counters:
    """What this client has moved since it was made (read by benchmarks and tests)."""

    bytes: int = 0
    retries: int = 0
    resumed_pieces: int = 0
    pieces: int = 0


class RegistryTransport:
    """HTTP to one run of the registry. `streams` sizes the connection pool."""

    def __init__(
        self,
        base_url: str,
        run: str,
        *,
        token: str | None = None,
        streams: int = 4,
        retries: int = 8,
        backoff_s: float = 0.2,
        max_backoff_s: float = 4.0,
        timeout_s: float = 120.0,
    ) -> None:
        if streams < 1:
            raise ValueError("streams must be >= 1")
        self.base_url = base_url.rstrip("/")
        self.run = run
        self.token = token
        self.streams = streams
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.counters = Counters()
        # Plans may merge patches on demand: reads get a long timeout, connects fail fast (retried).
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=httpx.Timeout(timeout_s, connect=5.0),
            limits=httpx.Limits(max_connections=streams + 2, max_keepalive_connections=streams + 2,
                                keepalive_expiry=KEEP_ALIVE_S),
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    def _path(self, suffix: str) -> str:
        return f"/v1/runs/{self.run}/{suffix}"

    def _auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    async def _backoff(self, attempt: int) -> None:
        self.counters.retries += 1
        delay = min(self.max_backoff_s, self.backoff_s * 2**attempt)
        await asyncio.sleep(delay * (0.5 + random.random() / 2))

    async def _retrying(self, action: Callable[[], Awaitable[Any]], what: str) -> Any:
        """Run action, retrying transport errors and 5xx answers with exponential backoff."""
        for attempt in range(self.retries + 1):
            try:
                return await action()
            except httpx.TransportError as exc:
                error: Exception = exc
            except RegistryHTTPError as exc:
                if exc.status < 500:
                    raise
                error = exc
            if attempt == self.retries:
                raise error
            # debug: callers that ride out outages log those once (shared.retry)
            log.debug("%s failed (%s), retrying", what, error)
            await self._backoff(attempt)
        raise AssertionError("unreachable")

    @staticmethod
    def _raise_for(response: httpx.Response) -> None:
        if response.status_code >= 400:
            try:
                detail = response.json().get("detail", response.text)
            except ValueError:
                detail = response.text
            raise RegistryHTTPError(response.status_code, str(detail))

    async def _get_json(self, suffix: str, params: dict[str, Any] | None = None) -> Any:
        async def action() -> Any:
            # The token also lets a plan have a missing merged patch built at once (docs/registry.md).
            response = await self._http.get(self._path(suffix), params=params, headers=self._auth())
            self._raise_for(response)
            return response.json()

        return await self._retrying(action, f"GET {suffix}")

    async def _put(self, suffix: str, data: bytes, headers: dict[str, str] | None = None) -> Any:
        # Only a refused connection is retried: the request never reached the registry, so a
        # retry cannot publish twice (a lost answer to a sent upload is reported, not retried).
        async def action() -> Any:
            try:
                response = await self._http.put(
                    self._path(suffix),
                    content=data,
                    headers={"Content-Type": "application/octet-stream", **self._auth(), **(headers or {})},
                )
            except httpx.ConnectError:
                raise
            except httpx.TransportError as exc:
                raise RegistryHTTPError(0, f"upload interrupted: {exc}") from exc
            self._raise_for(response)
            return response.json()

        return await self._retrying(action, f"PUT {suffix}")
