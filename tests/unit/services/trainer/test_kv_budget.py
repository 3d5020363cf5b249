"""The adaptive KV budget controller: pure, fed with per-version evidence (services.trainer.kv_budget)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.trainer.kv_budget import (
    Evidence,
    KVBudgetController,
    KVControlSettings,
    evidence_from_step,
    kv_saved_share,
)
from services.trainer.settings import TrainerSettings
from shared.schemas import SamplingInfo, Trajectory


def _controller(**overrides) -> KVBudgetController:
    values = {"mode": "adaptive", "target": 0.3, "deadband": 0.2, "smoothing": 1.0, "min_sequences": 10,
              "min_budget": 16, "max_budget": 64, "start_budget": 32, "step": 8} | overrides
    return KVBudgetController(KVControlSettings(**values))


def _at(budget: int | None, value: float, version: int = 0, sequences: int = 100,
        saved: float | None = None, per_token: float | None = None) -> list[Evidence]:
    return [Evidence(version=version, budget=budget, sequences=sequences, value=value, saved=saved,
                     saved_per_token=per_token)]


def test_raises_the_budget_when_the_signal_is_over_target() -> None:
    c = _controller()
    report = c.update(_at(32, 0.5), next_version=1)
    # The report says what the decision saw; a move starts a fresh signal.
    assert (report["kv_budget"], report["kv_budget_since"], report["kv_signal"], report["kv_evidence"]) == (
        40, 1, 0.5, 100)
    assert (c.signal, c.evidence) == (None, 0)


def test_lowers_the_budget_when_under_target() -> None:
    c = _controller()
    assert c.update(_at(32, 0.1), next_version=1)["kv_budget"] == 24


def test_holds_inside_the_deadband() -> None:
    c = _controller()
    for v, value in enumerate((0.25, 0.35, 0.3, 0.34)):  # band: 0.24 .. 0.36
        report = c.update(_at(32, value, version=v), next_version=v + 1)
        assert report["kv_budget"] == 32
    assert report["kv_signal"] == pytest.approx(0.34) and report["kv_evidence"] == 400


def test_clamps_to_the_bounds() -> None:
    c = _controller(start_budget=60)
    assert c.update(_at(60, 0.9), next_version=1)["kv_budget"] == 64
    assert c.update(_at(64, 0.9, version=1), next_version=2)["kv_budget"] == 64
    low = _controller(start_budget=20)
    assert low.update(_at(20, 0.0), next_version=1)["kv_budget"] == 16
    assert low.update(_at(16, 0.0, version=1), next_version=2)["kv_budget"] == 16


def test_ignores_evidence_sampled_at_another_budget_or_before_the_move() -> None:
    c = _controller()
    assert c.update(_at(32, 0.9), next_version=1)["kv_budget"] == 40  # moved at v1
    # The next batches were still sampled at 32 (workers swap budgets with their weights) or mix
    # budgets (None): no evidence about 40, no move and no signal.
    for v in (1, 2):
        report = c.update(_at(32, 0.9, version=v) + _at(None, 0.9, version=v), next_version=v + 1)
        assert (report["kv_budget"], report["kv_signal"], report["kv_evidence"]) == (40, None, 0)
    # Sampled at 40 but before v1 published it (a worker with a budget of its own): not counted.
    assert c.update(_at(40, 0.9, version=0), next_version=4)["kv_evidence"] == 0
    report = c.update(_at(40, 0.31, version=3), next_version=5)
    assert (report["kv_budget"], report["kv_signal"], report["kv_evidence"]) == (40, pytest.approx(0.31), 100)


def test_stale_share_weighs_the_smoothing_and_hysteresis_waits_for_evidence() -> None:
    c = _controller(smoothing=0.5, min_sequences=150)
    assert c.update(_at(32, 0.3), next_version=1)["kv_signal"] == pytest.approx(0.3)  # first sets it
    # One quarter of the step is current: weight 0.5 × 0.25.
    report = c.update(_at(32, 0.7, version=1, sequences=25) + _at(24, 0.0, version=0, sequences=75),
                      next_version=2)
    assert report["kv_signal"] == pytest.approx(0.3 + 0.125 * 0.4)
    assert report["kv_budget"] == 32  # 0.35 is inside the band anyway
    c2 = _controller(min_sequences=150)
    assert c2.update(_at(32, 0.9), next_version=1)["kv_budget"] == 32  # 100 < 150 sequences: wait
    assert c2.update(_at(32, 0.9, version=1), next_version=2)["kv_budget"] == 40


def test_fixed_mode_never_moves_and_publishes_its_start() -> None:
    fixed = KVBudgetController(KVControlSettings(start_budget=48))
    assert fixed.update(_at(48, 0.99), next_version=1)["kv_budget"] == 48
    fixed.resume(24, {"kv_budget": 24}, version=5)
    assert fixed.budget == 48
    default = KVBudgetController(KVControlSettings())
    assert default.update(_at(32, 0.99), next_version=1)["kv_budget"] is None  # nothing published


def test_adaptive_without_a_start_adopts_the_workers_budget() -> None:
    c = _controller(start_budget=None)
    report = c.update(_at(32, 0.3, sequences=90) + _at(48, 0.3, version=1, sequences=10), next_version=2)
    assert report["kv_budget"] == 32 and report["kv_evidence"] == 90
    clamped = _controller(start_budget=None, min_budget=40)
    report = clamped.update(_at(32, 0.9), next_version=1)
    assert report["kv_budget"] == 40 and report["kv_evidence"] == 0  # sampled at 32: no evidence about 40


def test_resumes_from_the_head_manifest() -> None:
    before = _controller()
    moved = before.update(_at(32, 0.9), next_version=1)
    head_metrics = before.update(_at(40, 0.33, version=1, sequences=5), next_version=2)
    after = _controller()  # a restarted trainer: its start would be 32
    after.resume(head_metrics["kv_budget"], head_metrics, version=2)
    assert after.state() == before.state() | {"kv_moves": 0}
    # 5 more sequences reach min_sequences (10): the resumed evidence counts.
    assert after.update(_at(40, 0.9, version=2, sequences=5), next_version=3)["kv_budget"] == 48
    # Resumed at the version the budget moved with: the signal behind that move is the old budget's.
    fresh = _controller()
    fresh.resume(moved["kv_budget"], moved, version=1)
    assert (fresh.budget, fresh.since, fresh.signal, fresh.evidence) == (40, 1, None, 0)
    # A manifest whose metrics do not describe its budget: the budget, counted from that version.
    other = _controller()
    other.resume(56, {"kv_budget": 40, "kv_signal": 0.1}, version=7)
    assert (other.budget, other.since, other.signal, other.evidence) == (56, 7, None, 0)
    # A checkpoint's state round-trips too.
    restored = _controller()
    restored.load_state(before.state())
    assert restored.state() == before.state()


def test_evidence_is_split_by_sampling_version() -> None:
    def traj(version: int, budget: int | None) -> Trajectory:
        return Trajectory(group_id=f"g{version}{budget}", attempt=1, policy_version=version, worker_id="w",
                          task="addition", prompt="p", samples=[],
                          sampling=SamplingInfo(temperature=1.0, kv_policy="rkv", kv_budget=budget))

    metrics = {"by_staleness": {"0": {"rejection_rate": 0.5, "kl_old_sampler": 0.1, "sequences": 8},
                                "1": {"rejection_rate": 0.2, "kl_old_sampler": 0.05, "sequences": 16}}}
    cells = evidence_from_step([traj(5, 40), traj(4, 32), traj(4, 40)], metrics, version=5,
                               key="kl_old_sampler")
    assert sorted(cells, key=lambda c: c.version) == [Evidence(4, None, 16, 0.05), Evidence(5, 40, 8, 0.1)]


def test_the_divergent_share_can_be_the_signal() -> None:
    """divergent_rate: the share of sequences with a divergent token, which a rule that vetoes only some
    of them (veto_negative, the authors' token rule) does not show in its veto rate."""
    assert KVControlSettings(metric="divergent_rate").metric == "divergent_rate"
    traj = Trajectory(group_id="g", attempt=1, policy_version=3, worker_id="w", task="addition", prompt="p",
                      samples=[], sampling=SamplingInfo(temperature=1.0, kv_policy="rkv", kv_budget=32))
    metrics = {"by_staleness": {"0": {"rejection_rate": 0.03, "divergent_rate": 0.35, "sequences": 64}}}
    evidence = evidence_from_step([traj], metrics, version=3, key="divergent_rate")
    assert evidence == [Evidence(3, 32, 64, 0.35)]
    # 35 % divergent is over a 20 % target (3 % vetoed would have been under it): the budget rises.
    control = _controller(metric="divergent_rate", target=0.2)
    assert control.update(evidence, next_version=4)["kv_budget"] == 40


def test_settings_validate_and_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValidationError):
        KVControlSettings(min_budget=64, max_budget=32)
    with pytest.raises(ValidationError):
        KVControlSettings(start_budget=8, min_budget=16)
    monkeypatch.setenv("SPARSECAST_KV_CONTROL__MODE", "adaptive")
    monkeypatch.setenv("SPARSECAST_KV_CONTROL__TARGET", "0.1")
    monkeypatch.setenv("SPARSECAST_KV_CONTROL__MAX_BUDGET", "96")
    kv = TrainerSettings(data_dir="x").kv_control
    assert (kv.mode, kv.target, kv.max_budget, kv.min_budget) == ("adaptive", 0.1, 96, 16)
    # The divergent share by default: under the default rule (veto_negative) the veto rate counts
    # only the divergent losers (docs/training.md, "Which signal").
    rule = TrainerSettings(data_dir="x").loss.corrections.divergence_rule
    assert kv.metric == "divergent_rate" and rule == "veto_negative"


def test_a_reversal_halves_the_step_so_the_budget_settles() -> None:
    """The veto rate is over target at 56 and under it at 64 (a GPU run swung 56 <-> 64 every
    version with a fixed step of 8): halving the step on each reversal settles it in between."""
    c = _controller(start_budget=56, max_budget=96, step=8)

    def rate(budget: int) -> float:  # falls with the budget; inside the band (0.24-0.36) at 60-61
        return 0.30 + (60.5 - budget) * 0.02 if 58 <= budget <= 63 else (0.5 if budget < 58 else 0.1)

    budgets = []
    for v in range(12):
        budgets.append(c.update(_at(c.budget, rate(c.budget), version=v), next_version=v + 1)["kv_budget"])
    assert budgets[:3] == [64, 60, 60]  # up by 8, down by 4 (reversal), then inside the band
    assert set(budgets[2:]) == {60}
    c2 = _controller(start_budget=32, step=8)
    # Same direction twice: the step stays whole.
    moves = [c2.update(_at(c2.budget, 0.9, version=v), next_version=v + 1)["kv_budget"] for v in range(2)]
    assert moves == [40, 48]


def test_the_step_grows_back_on_the_move_regrow_after_sets() -> None:
    """The divergent share a capped CPU demo measured per budget (one step of 128 sequences each):
    over target up to 30, inside the band at 31, under it from 32. Doubling the step on the second
    move the same way (the default) cycled 32 -> 28 -> 30 -> 34 -> 32 -> 28 for the whole run;
    doubling on the third settles at 31."""
    shares = {28: 0.81, 29: 0.6, 30: 0.43, 31: 0.33, 32: 0.22, 33: 0.15}

    def run(c: KVBudgetController) -> list[int]:
        budgets = []
        for v in range(16):
            share = shares.get(c.budget, 0.81 if c.budget < 28 else 0.08)
            budgets.append(c.update(_at(c.budget, share, version=v), next_version=v + 1)["kv_budget"])
        return budgets

    assert run(_controller(start_budget=36, step=4)) == [32, 28, 30, 34, 32, 28, 30, 34] * 2
    settles = run(_controller(start_budget=36, step=4, regrow_after=3))
    assert settles[:6] == [32, 28, 30, 32, 31, 31]  # down 4, down 4, up 2 (reversal), up 2, down 1
    assert set(settles[5:]) == {31}
    # The third move the same way doubles it back, so a target that drifts far off is still reached
    # in a few moves: here the mismatch rises at every budget after the first step.
    drift = _controller(start_budget=64, max_budget=96, step=8, regrow_after=3)
    moves = [drift.update(_at(64, 0.05, version=0), next_version=1)["kv_budget"]]
    for v in range(1, 5):
        moves.append(drift.update(_at(drift.budget, 0.9, version=v), next_version=v + 1)["kv_budget"])
    assert moves == [56, 60, 64, 72, 80]  # down 8; up 4 (reversal), up 4, up 8 (third), up 8
    state = drift.state()
    assert (state["kv_step"], state["kv_direction"], state["kv_streak"]) == (8, 1, 4)


def test_the_kv_floor_comes_before_the_mismatch() -> None:
    """min_saved (rule 5): under the floor the budget goes down even with the mismatch over target; a
    raise is cut to the tokens that keep the floor, or not made."""
    c = _controller(min_saved=0.4)
    # 35 % saved at 32 with the mismatch far over target: down, by the step.
    report = c.update(_at(32, 0.9, saved=0.35, per_token=0.01), next_version=1)
    assert (report["kv_budget"], report["kv_saved_signal"]) == (24, 0.35)
    # Over target at 24 with 46 % saved, one token costing at most 1 %: 6 tokens would keep 40 %, the
    # step (halved on the reversal) is 4: up by 4. With a step of 16 the raise is cut to 6; then
    # 40.5 % leaves no room: hold, whatever the signal.
    c = _controller(min_saved=0.4)
    assert c.update(_at(32, 0.9, saved=0.35, per_token=0.01), next_version=1)["kv_budget"] == 24
    assert c.update(_at(24, 0.9, version=1, saved=0.46, per_token=0.01), next_version=2)["kv_budget"] == 28
    c = _controller(min_saved=0.4, step=16)
    assert c.update(_at(32, 0.9, saved=0.46, per_token=0.01), next_version=1)["kv_budget"] == 38
    report = c.update(_at(38, 0.9, version=1, saved=0.405, per_token=0.01), next_version=2)
    assert (report["kv_budget"], c.step, c.direction) == (38, 16, 1)  # held: the step as it was
    # Without a floor the same evidence raises by the step; without KV figures the floor cannot act.
    assert _controller().update(_at(32, 0.9, saved=0.35, per_token=0.01), next_version=1)["kv_budget"] == 40
    assert _controller(min_saved=0.4).update(_at(32, 0.9), next_version=1)["kv_budget"] == 40
    # Nothing compressed (a raise changes nothing): no limit from the floor.
    assert _controller(min_saved=0.4).update(_at(32, 0.9, saved=0.5, per_token=0.0),
                                             next_version=1)["kv_budget"] == 40


def test_the_kv_saved_comes_from_the_step_and_survives_a_restart() -> None:
    traj = Trajectory(group_id="g", attempt=1, policy_version=3, worker_id="w", task="addition", prompt="p",
                      samples=[], sampling=SamplingInfo(temperature=1.0, kv_policy="rkv", kv_budget=32))
    metrics = {"by_staleness": {"0": {"divergent_rate": 0.35, "sequences": 64, "kv_saved": 0.45,
                                      "kv_saved_per_token": 0.02}}}
    assert evidence_from_step([traj], metrics, version=3, key="divergent_rate") == [
        Evidence(3, 32, 64, 0.35, saved=0.45, saved_per_token=0.02)]
    before = _controller(min_saved=0.4, min_sequences=150)
    head = before.update(_at(32, 0.3, saved=0.45, per_token=0.02), next_version=1)  # waits: 100 < 150
    assert head["kv_saved_signal"] == 0.45
    after = _controller(min_saved=0.4, min_sequences=150)
    after.resume(head["kv_budget"], head | {"kv_budget_since": 0}, version=1)
    assert after.saved == 0.45
    # The smoothed saved share, like the signal: 0.45 then 0.35 at weight 1: under the floor, down.
    report = after.update(_at(32, 0.3, version=1, saved=0.35, per_token=0.02), next_version=2)
    assert report["kv_budget"] == 24
    restored = _controller(min_saved=0.4)
    restored.load_state(before.state())
    assert restored.state() == before.state()
    old = {k: v for k, v in before.state().items() if k not in ("kv_saved_signal", "kv_saved_per_token")}
    restored.load_state(old)  # a checkpoint from before the floor
    assert restored.saved is None


def test_kv_saved_share_counts_the_peak_before_each_compression() -> None:

    # (prompt, completion) tokens: 40 and 20 seen; peaks min(40, 12) + min(20, 12) = 24 of 60 kept.
    lengths = [(10, 30), (5, 15)]
    assert kv_saved_share(lengths, budget=10, buffer=2, keep_prompt=False) == pytest.approx(1 - 24 / 60)
    # A kept prompt is stored whole besides the budget: (10 + 12) + (5 + 12) = 39 of 60.
    assert kv_saved_share(lengths, budget=10, buffer=2, keep_prompt=True) == pytest.approx(1 - 39 / 60)
    assert kv_saved_share([(10, 30)], budget=64, buffer=2, keep_prompt=False) == 0.0  # never compressed
    assert kv_saved_share([], budget=8, buffer=2, keep_prompt=False) == 0.0


def test_each_report_says_what_held_the_budget() -> None:
    """`kv_held_by`: None when the budget moved, else why not; a controller held by its floor has a
    target it cannot reach there, which the budget alone does not show."""
    c = _controller(min_sequences=150)
    assert c.update(_at(32, 0.9), next_version=1)["kv_held_by"] == "evidence"  # 100 < 150 sequences
    assert c.update(_at(32, 0.9, version=1), next_version=2)["kv_held_by"] is None  # moved up
    band = _controller()
    report = band.update(_at(32, 0.3), next_version=1)
    assert (report["kv_held_by"], report["kv_metric"], report["kv_target"]) == (
        "target", "divergent_rate", 0.3)
    floor = _controller(min_saved=0.4)
    report = floor.update(_at(32, 0.9, saved=0.405, per_token=0.01), next_version=1)
    assert (report["kv_budget"], report["kv_held_by"]) == (32, "floor")
    top = _controller(start_budget=64)
    assert top.update(_at(64, 0.9), next_version=1)["kv_held_by"] == "max_budget"
    bottom = _controller(start_budget=16)
    assert bottom.update(_at(16, 0.0), next_version=1)["kv_held_by"] == "min_budget"
    fixed = _controller(mode="fixed").update(_at(32, 0.9), next_version=1)
    assert (fixed["kv_held_by"], fixed["kv_metric"], fixed["kv_target"]) == ("fixed", None, None)
    restored = _controller()
    restored.load_state(floor.state())
    assert restored.held_by == "floor"
