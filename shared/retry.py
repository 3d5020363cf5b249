"""Riding out outages of a dependency (Redis, the registry) inside a background loop.

A loop that talks to a dependency keeps one `Outage` for it: on a transient error it waits a
capped exponential backoff with full jitter (so a fleet of workers does not reconnect in lock
step) and tries again, from where it was; the first failure of an outage logs one warning, the
first success after it one info line; outages and failed tries are counted for /metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import httpx
from redis import exceptions as redis_errors

from shared.errors import ServiceHTTPError

T = TypeVar("T")

# Backoff between tries: 0.2 s doubling up to 10 s, times a uniform factor in [0.5, 1]. The cap
# keeps the wait after a dependency comes back short next to the outage itself.
BASE_BACKOFF_S = 0.2
MAX_BACKOFF_S = 10.0


def transient(exc: BaseException) -> bool:
    """True for errors that mean "the dependency is unreachable or restarting now": worth waiting
    out. Anything else (a refused request, a bug) is not retried here."""
    if isinstance(exc, ServiceHTTPError):  # any service's client (the registry's, ...)
        return exc.transient
    if isinstance(exc, redis_errors.ResponseError):
        # Redis answering while it loads its AOF, a replica that cannot take writes yet, or a full
        # Redis (it drains as the trainer reads).
        return str(exc).startswith(("LOADING", "MASTERDOWN", "TRYAGAIN", "READONLY", "OOM"))
    return isinstance(exc, redis_errors.ConnectionError | redis_errors.TimeoutError | httpx.TransportError
                      | ConnectionError | TimeoutError)


class Outage:
    """One dependency as the loops of one process see it. Share it between the loops that use
    the same dependency, so one outage is logged and counted once."""

    def __init__(self, dependency: str, log: logging.Logger, *, base_s: float = BASE_BACKOFF_S,
                 cap_s: float = MAX_BACKOFF_S) -> None:
        self.dependency = dependency
        self.log = log
        self.base_s = base_s
        self.cap_s = cap_s
        self.since: float | None = None  # time.time() the current outage began; None: up
        self.outages = 0  # outages seen (a run of failed tries ended by a success counts once)
        self.failures = 0  # failed tries in all
        self.last_error: str | None = None
        self._tries = 0  # failed tries in the current outage: the backoff exponent

    @property
    def down(self) -> bool:
        return self.since is not None

    def ok(self) -> None:
        """A call to the dependency succeeded."""
        if self.since is not None:
            self.log.info("%s available again after %.1f s (%d failed tries)", self.dependency,
                          time.time() - self.since, self._tries)
        self.since, self._tries = None, 0

    def record(self, exc: BaseException) -> None:
        """Count a failed call (the first of an outage logs it), without waiting."""
        self.failures += 1
        self.last_error = f"{type(exc).__name__}: {exc}"
        if self.since is None:
            self.since = time.time()
            self.outages += 1
            self.log.warning("%s unavailable (%s); retrying with backoff until it is back", self.dependency,
                             self.last_error)

    async def failed(self, exc: BaseException, stop: asyncio.Event | None = None) -> None:
        """Record a failed call and wait the backoff (returns early when `stop` is set)."""
        self.record(exc)
        delay = min(self.cap_s, self.base_s * 2 ** min(self._tries, 30)) * random.uniform(0.5, 1.0)
        self._tries += 1
        if stop is None:
            await asyncio.sleep(delay)
        else:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=delay)

    async def call(self, fn: Callable[[], Awaitable[T]], stop: asyncio.Event | None = None,
                   beat: Callable[[], None] | None = None,
                   retry_if: Callable[[BaseException], bool] = transient) -> T:
        """fn(), tried again after each failure `retry_if` calls an outage (default: `transient`)
        until it succeeds. Once `stop` is set the last error is raised instead, so a shutting-down
        loop can leave. `beat` is called before every try: a loop waiting out an outage is alive
        (shared.health)."""
        while True:
            if beat is not None:
                beat()
            try:
                result = await fn()
            except BaseException as exc:  # some libraries wrap errors in BaseExceptions (DCP)
                if not retry_if(exc) or (stop is not None and stop.is_set()):
                    raise
                await self.failed(exc, stop)
                continue
            self.ok()
            return result

    def state(self) -> dict:
        """For health endpoints: whether it is down, since when, and the counters."""
        return {"down": self.down, "since": self.since, "outages": self.outages, "failures": self.failures,
                "last_error": self.last_error}
