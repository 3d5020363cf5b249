"""Liveness of a service's background loops, and the health figures every service exports.

Each loop beats once per iteration, including while it waits out an outage, so "alive" means
"still making its rounds", not "its dependency is up" (that is readiness). A loop is dead when its
task ended, or when it has not beaten for longer than its bound (stuck: a deadlock, a hung call),
unless the progress figure it was given still moves (a long download). /healthz answers 503 then,
so Kubernetes restarts the container.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Gauge

from shared.retry import Outage


@dataclass
class _Loop:
    task: asyncio.Task | None
    stall_s: float
    may_finish: bool  # a loop that ends by design (a trainer at max_steps) is not dead for ending
    progress: Callable[[], float] | None
    last_beat: float = field(default_factory=time.monotonic)
    last_progress: float | None = None


class Liveness:
    def __init__(self) -> None:
        self._loops: dict[str, _Loop] = {}

    def watch(self, name: str, task: asyncio.Task | None, stall_s: float, *, may_finish: bool = False,
              progress: Callable[[], float] | None = None) -> None:
        """Start watching a loop (task None: the loop runs inside another watched task)."""
        self._loops[name] = _Loop(task, stall_s, may_finish, progress)

    def beat(self, name: str) -> None:
        loop = self._loops.get(name)
        if loop is not None:
            loop.last_beat = time.monotonic()

    def task(self, name: str) -> asyncio.Task | None:
        loop = self._loops.get(name)
        return loop.task if loop else None

    def forget(self, name: str) -> None:
        self._loops.pop(name, None)

    def problems(self) -> list[str]:
        """Why the service is not alive; empty when every loop is."""
        now = time.monotonic()
        found = []
        for name, loop in self._loops.items():
            task = loop.task
            if task is not None and task.done():
                if task.cancelled():
                    found.append(f"{name} loop was cancelled")
                elif (exc := task.exception()) is not None:
                    found.append(f"{name} loop died: {type(exc).__name__}: {exc}")
                elif not loop.may_finish:
                    found.append(f"{name} loop ended")
                continue
            if loop.progress is not None:
                value = loop.progress()
                if value != loop.last_progress:
                    loop.last_progress, loop.last_beat = value, now
            idle = now - loop.last_beat
            if idle > loop.stall_s:
                found.append(f"{name} loop stuck: no progress for {idle:.0f} s (bound {loop.stall_s:.0f} s)")
        return found

    def loops(self) -> dict[str, float]:
        """Seconds since each loop last beat."""
        now = time.monotonic()
        return {name: round(now - loop.last_beat, 3) for name, loop in self._loops.items()}


class HealthMetrics:
    """Prometheus gauges of a service's dependencies and loops, refreshed at each scrape:
    `<service>_dependency_up`, `_dependency_outages`, `_dependency_failed_tries` (by dependency)
    and `<service>_alive` (1 when /healthz would answer 200)."""

    def __init__(self, registry: CollectorRegistry, service: str) -> None:
        self.up = Gauge(f"{service}_dependency_up", "1 while the dependency answers", ["dependency"],
                        registry=registry)
        self.outages = Gauge(f"{service}_dependency_outages", "Outages of the dependency since start",
                             ["dependency"], registry=registry)
        self.failures = Gauge(
            f"{service}_dependency_failed_tries",
            "Failed calls to the dependency since start",
            ["dependency"],
            registry=registry,
        )
        self.alive = Gauge(f"{service}_alive", "1 while every background loop is alive", registry=registry)

    def update(self, outages: Iterable[Outage], liveness: Liveness) -> None:
        for outage in outages:
            self.up.labels(outage.dependency).set(0 if outage.down else 1)
            self.outages.labels(outage.dependency).set(outage.outages)
            self.failures.labels(outage.dependency).set(outage.failures)
        self.alive.set(0 if liveness.problems() else 1)
