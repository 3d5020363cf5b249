"""Claim-size rule: throughput-proportional, bounded, zero for workers with stale weights.

size = clamp(round(base_claim * r_w / mean(r_fleet)), min_claim, max_claim), where r are measured
tokens/s of the workers that may claim. Every worker then holds work for about the same wall time,
so the claims a worker gets over time follow its throughput (docs/coordination.md).
"""

from __future__ import annotations

from collections.abc import Sequence

from shared.coord.settings import CoordSettings
from shared.schemas import WorkerInfo


def is_lagging(weight_version: int, trainer_version: int, settings: CoordSettings) -> bool:
    """True when the weights are more than staleness_bound versions behind the trainer."""
    return weight_version < trainer_version - settings.staleness_bound


def claim_size(
    worker: WorkerInfo | None, fleet: Sequence[WorkerInfo], trainer_version: int, settings: CoordSettings
) -> int:
    """How many groups `worker` should claim next. An unregistered worker gets min_claim."""
    if worker is None:
        return settings.min_claim
    if is_lagging(worker.weight_version, trainer_version, settings):
        return 0
    rates = [
        w.tokens_per_s
        for w in fleet
        if w.tokens_per_s > 0 and not is_lagging(w.weight_version, trainer_version, settings)
    ]
    if worker.tokens_per_s <= 0 or not rates:
        # Not measured yet: give the average share until the first measurement arrives.
        return settings.base_claim
    mean_rate = sum(rates) / len(rates)
    size = round(settings.base_claim * worker.tokens_per_s / mean_rate)
    return max(settings.min_claim, min(settings.max_claim, size))
