"""Claim-size formula and coordination settings (no Redis)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from shared.coord import CoordSettings, StallMeter, claim_size, effective_rate, is_lagging
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


@pytest.mark.parametrize(("version", "trainer", "lagging"), [(7, 7, False), (6, 7, False), (5, 7, True), (9, 7, False)])
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


def test_claim_share_follows_sync_stall() -> None:
    """Same GPU speed, but one worker waits on weight sync half the time (a slow link): it gets
    about half the share of the other."""
    fast = worker("fast", 200)
    slow = WorkerInfo(worker_id="slow", tokens_per_s=200, weight_version=7, sync_stall=0.5)
    fleet = [fast, slow]
    assert [claim_size(w, fleet, 7, SETTINGS) for w in fleet] == [5, 3]
    assert effective_rate(slow) == 100
    stalled = WorkerInfo(worker_id="x", tokens_per_s=200, weight_version=7, sync_stall=1.0)
    assert claim_size(stalled, [stalled], 7, SETTINGS) == SETTINGS.base_claim  # nobody to compare with
    with pytest.raises(ValidationError):
        WorkerInfo(worker_id="bad", sync_stall=1.5)


def test_stall_meter_is_a_decayed_share_of_wall_time() -> None:
    now = [0.0]
    meter = StallMeter(tau_s=100.0, clock=lambda: now[0])
    assert meter.share() == 0.0
    now[0] = 10.0
    meter.add(2.0)  # 2 of the last 10 s were spent applying weights
    assert meter.share() == pytest.approx(0.2, rel=0.06)
    now[0] = 510.0  # long quiet: the stall fades away
    assert meter.share() < 0.01
