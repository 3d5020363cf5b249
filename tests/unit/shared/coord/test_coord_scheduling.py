"""Claim-size formula and coordination settings (no Redis)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from shared.coord import CoordSettings, claim_size, is_lagging
from shared.schemas import WorkerInfo

SETTINGS = CoordSettings(base_claim=4, min_claim=1, max_claim=10, staleness_bound=1)


def worker(name: str, rate: float, version: int = 7) -> WorkerInfo:
    return WorkerInfo(worker_id=name, tokens_per_s=rate, weight_version=version)


def test_claim_size_proportional_to_throughput() -> None:
    fleet = [worker("a", 100), worker("b", 300)]
    assert [claim_size(w, fleet, 7, SETTINGS) for w in fleet] == [2, 6]


def test_claim_size_clamped_to_bounds() -> None:
    fleet = [worker("tiny", 1), worker("huge", 10_000), worker("mid", 500)]
    sizes = [claim_size(w, fleet, 7, SETTINGS) for w in fleet]
    assert sizes == [SETTINGS.min_claim, SETTINGS.max_claim, 1]


def test_unmeasured_worker_gets_base_and_unknown_worker_min() -> None:
    fleet = [worker("new", 0), worker("b", 300)]
    assert claim_size(fleet[0], fleet, 7, SETTINGS) == SETTINGS.base_claim
    assert claim_size(None, fleet, 7, SETTINGS) == SETTINGS.min_claim


@pytest.mark.parametrize(
    ("version", "trainer", "lagging"), [(7, 7, False), (6, 7, False), (5, 7, True), (9, 7, False)]
)
def test_staleness_bound(version: int, trainer: int, lagging: bool) -> None:
    assert is_lagging(version, trainer, SETTINGS) is lagging
    me = worker("w", 200, version)
    assert (claim_size(me, [me], trainer, SETTINGS) == 0) is lagging


def test_lagging_workers_do_not_count_in_fleet_mean() -> None:
    me, stale = worker("me", 100), worker("stale", 10_000, version=1)
    assert claim_size(me, [me, stale], 7, SETTINGS) == SETTINGS.base_claim


def test_settings_reject_inconsistent_claim_bounds() -> None:
    with pytest.raises(ValidationError, match="min_claim"):
        CoordSettings(min_claim=8, base_claim=4)
    assert CoordSettings(lease_ttl_s=0.25).lease_ttl_ms == 250
