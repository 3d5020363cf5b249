"""Claim-size rule: throughput-proportional, bounded, zero for workers with stale weights.

size = clamp(round(base_claim * r_w / mean(r_fleet)), min_claim, max_claim), where r is a worker's
effective rate: its measured tokens/s while generating times the share of wall time it is not
stalled by weight sync (1 - sync_stall), over the workers that may claim. Every worker then holds
work for about the same wall time, so the claims a worker gets over time follow its throughput
and its link: a worker on a slow link that waits for weights more gets less (docs/coordination.md).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

from shared.coord.settings import CoordSettings
from shared.schemas import WorkerInfo


def is_lagging(weight_version: int, trainer_version: int, settings: CoordSettings) -> bool:
    """True when the weights are more than staleness_bound versions behind the trainer."""
    return weight_version < trainer_version - settings.staleness_bound


def effective_rate(worker: WorkerInfo) -> float:
    """Tokens/s over wall time: generation speed less the share spent waiting on weight sync."""
    return worker.tokens_per_s * (1.0 - worker.sync_stall)


class StallMeter:
    """A worker's share of recent wall time stalled on weight sync, decayed over tau_s: both the
    stalled seconds and the elapsed wall time fade by exp(-dt / tau_s)."""

    def __init__(self, tau_s: float = 120.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.tau_s = tau_s
        self._clock = clock
        self._last = clock()
        self._stalled = 0.0
        self._wall = 0.0

    def _advance(self) -> None:
        now = self._clock()
        dt, self._last = max(0.0, now - self._last), now
        fade = math.exp(-dt / self.tau_s)
        self._stalled *= fade
        self._wall = self._wall * fade + dt

    def add(self, seconds: float) -> None:
        """`seconds` of generation were just lost to weight sync (ending now)."""
        self._advance()
        self._stalled += seconds

    def share(self) -> float:
        self._advance()
        return min(1.0, self._stalled / self._wall) if self._wall > 0 else 0.0


def claim_size(
    worker: WorkerInfo | None, fleet: Sequence[WorkerInfo], trainer_version: int, settings: CoordSettings
) -> int:
    """How many groups `worker` should claim next. An unregistered worker gets min_claim."""
    if worker is None:
        return settings.min_claim
    if is_lagging(worker.weight_version, trainer_version, settings):
        return 0
    rates = [
        effective_rate(w)
        for w in fleet
        if w.tokens_per_s > 0 and not is_lagging(w.weight_version, trainer_version, settings)
    ]
    if worker.tokens_per_s <= 0 or not rates:
        # Not measured yet: give the average share until the first measurement arrives.
        return settings.base_claim
    mean_rate = sum(rates) / len(rates)
    if mean_rate <= 0:  # everyone stalled all the time: shares are equal
        return settings.base_claim
    size = round(settings.base_claim * effective_rate(worker) / mean_rate)
    return max(settings.min_claim, min(settings.max_claim, size))
