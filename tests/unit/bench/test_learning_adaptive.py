"""bench.learning's adaptive arm: the trainer's KV budget controller moves the engine's budget
between steps in-process, and every step row records the budget its rollouts used."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.learning import ARMS, PRESETS, configure, judge, main, rejudge, summarise
from services.trainer.kv_budget import KVControlSettings
from tests.unit.bench.arm_steps import arm_step_rows


def _steps_of(arm: str, model_dir: str, tmp_path: Path) -> list[dict]:
    """Three steps of `arm` with a controller whose target any mismatch is over, so the budget
    rises a step after every step (8 -> 16 -> 20, clamped at max_budget); the step rows."""
    control = KVControlSettings(metric="kl_old_sampler", target=1e-9, smoothing=1.0, min_sequences=1,
                                min_budget=8, max_budget=20, step=8)
    return arm_step_rows(arm, model_dir, tmp_path, steps=3, kv_control=control)


def test_the_adaptive_arm_moves_the_rollout_budget(tiny_model_dir: str, tmp_path: Path) -> None:
    assert "adaptive" in ARMS
    steps = _steps_of("adaptive", tiny_model_dir, tmp_path)
    assert [r["rollout_kv_budget"] for r in steps] == [8, 16, 20]  # clamped at max_budget
    assert [r["kv_budget"] for r in steps] == [16, 20, 20]
    assert all(r["kl_old_sampler"] > 1e-9 for r in steps)


def test_the_adaptive_replayed_arm_steers_by_the_dense_mismatch(tiny_model_dir: str, tmp_path: Path) -> None:
    """Under replay the trainer's own mismatch is ~0 at any budget; the controller reads the mismatch
    of the same batch against a dense recompute, logged as dense_*."""
    assert ARMS["adaptive_replayed"] == ARMS["replayed"]
    steps = _steps_of("adaptive_replayed", tiny_model_dir, tmp_path)
    assert [r["rollout_kv_budget"] for r in steps] == [8, 16, 20]
    assert all(r["dense_kl_old_sampler"] > 1e-9 for r in steps)
    assert all(0.0 <= r["dense_rejection_rate"] <= 1.0 for r in steps)


def test_the_replayed_arm_learns_from_the_samplers_record_not_a_replay(
        tiny_model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bench's sampler records its evictions, as the demo's workers do, so the learner replays
    nothing (the record gives the same masks: tests/unit/services/trainer/test_eviction_replay.py)."""
    from services.trainer.learner import Learner

    replayed: list[int] = []
    train_step = Learner.train_step

    def counted(self: Learner, *args: object, **kwargs: object) -> dict:
        metrics = train_step(self, *args, **kwargs)  # type: ignore[arg-type]
        replayed.append(self.replayed_samples)
        return metrics

    monkeypatch.setattr(Learner, "train_step", counted)
    steps = _steps_of("adaptive_replayed", tiny_model_dir, tmp_path)
    assert len(steps) == 3 and replayed == [0, 0, 0]
    assert all(r["kl_old_sampler"] < 0.05 for r in steps)  # under the sampler's own attention


def test_the_adaptive_veto_negative_arm_runs_the_default_rule_under_the_controller(
        tiny_model_dir: str, tmp_path: Path) -> None:
    assert ARMS["adaptive_veto_negative"] == ARMS["veto_negative"]
    assert ARMS["veto_negative"][1].corrections.divergence_rule == "veto_negative"
    steps = _steps_of("adaptive_veto_negative", tiny_model_dir, tmp_path)
    assert [r["rollout_kv_budget"] for r in steps] == [8, 16, 20]


def _evals(*accs: float) -> list[dict]:
    """Evaluation rows every 20 steps, dense and sparse T = 1 accuracy alike."""
    return [{"type": "eval", "step": 20 * i, "modes": {m: {"accuracy": a} for m in ("dense_t1", "sparse_t1")}}
            for i, a in enumerate(accs)]


def test_a_run_stopped_at_the_deadline_is_summarised_from_what_it_logged() -> None:
    full, cut = _evals(0.4, 0.5, 0.6), _evals(0.4, 0.3)
    summary = summarise({"dense": [full, full], "sparse_rl": [full, cut]})
    assert summary["sparse_rl"]["eval_steps"] == [0, 20, 40]
    assert summary["sparse_rl"]["curve"]["dense_t1"] == pytest.approx([0.4, 0.4, 0.6])  # step 40: one run
    assert summary["sparse_rl"]["worst_vs_start_per_seed"] == pytest.approx([0.0, -0.1])


def test_arms_stopped_at_different_steps_are_compared_at_the_last_common_evaluation() -> None:
    # dense reached step 60, the corrected arm only 40 (a deadline): (c) compares both at 40.
    runs = {"dense-1": _evals(0.5, 0.6, 0.7, 0.9), "sparse_rl-1": _evals(0.5, 0.55, 0.68)}
    judged = judge(runs, ["dense", "sparse_rl"], [1], steps=60)
    assert judged["judged_at_step"] == 40
    assert judged["summary"]["dense"]["final_mean"]["dense_t1"] == pytest.approx(0.7)
    assert judged["criteria"]["c"]["gap_to_dense"] == pytest.approx(0.02)
    # ... but the claims about the end of training are not judged on a run stopped before it
    assert judged["criteria"]["c"]["met"] is None and "not_judged" in judged["criteria"]["c"]
    assert judged["criteria"]["a"]["met"] is None and judged["criteria"]["d"]["met"] is None
    # (e), about every evaluation, is judged through the common step
    assert judged["criteria"]["e"]["met"] is True and judged["criteria"]["e"]["through_step"] == 40


def test_per_step_means_stop_at_the_common_step_with_each_runs_own_thirds() -> None:
    def run(rejections: list[float]) -> list[dict]:
        others = ("reward_mean", "accuracy", "completion_tokens_mean", "entropy", "token_mask_rate",
                  "kl_old_sampler", "clip_fraction", "kv_saved", "xi_p01", "xi_p99")
        steps = [{"type": "step", "step": i + 1, "seconds": 1.0, "rejection_rate": x}
                 | dict.fromkeys(others, 0.0) for i, x in enumerate(rejections)]
        return _evals(0.5) + steps
    # one run stopped at step 3, the other went on to 6 with a late rise that the common step excludes
    summary = summarise({"sparse_rl": [run([0.1, 0.2, 0.3]), run([0.1, 0.2, 0.3, 0.9, 0.9, 0.9])]}, at_step=3)
    assert summary["sparse_rl"]["per_step"]["rejection_rate"] == pytest.approx(
        {"first_third": 0.1, "last_third": 0.3})
    # without a common step each run's thirds are its own: 0.1 and 0.1+0.2 first, 0.3 and 0.9+0.9 last
    whole = summarise({"sparse_rl": [run([0.1, 0.2, 0.3]), run([0.1, 0.2, 0.3, 0.9, 0.9, 0.9])]})
    assert whole["sparse_rl"]["per_step"]["rejection_rate"] == pytest.approx(
        {"first_third": (0.1 + 0.1 + 0.2) / 3, "last_third": (0.3 + 0.9 + 0.9) / 3})


def test_complete_runs_are_judged_at_their_last_step(tmp_path: Path) -> None:
    runs = {"dense-1": _evals(0.5, 0.6, 0.9), "sparse_rl-1": _evals(0.5, 0.55, 0.8)}
    judged = judge(runs, ["dense", "sparse_rl"], [1], steps=40)
    assert judged["judged_at_step"] == 40
    assert judged["criteria"]["a"]["met"] is True  # +40 points
    assert judged["criteria"]["c"]["met"] is False  # 10 points below dense
    assert "not_judged" not in judged["criteria"]["c"] and "through_step" not in judged["criteria"]["e"]
    # a stored result re-judged from its logged runs
    path = tmp_path / "learning.json"
    path.write_text(json.dumps({"arms": ["dense", "sparse_rl"], "seeds": [1], "config": {"steps": 60},
                                "criteria": {"c": {"met": True}}, "runs": runs}))
    rejudge(path)
    stored = json.loads(path.read_text())
    assert stored["judged_at_step"] == 40 and stored["criteria"]["c"]["met"] is None
    assert stored["runs"] == runs


def test_a_dotted_override_sets_a_field_of_the_warm_start_recipe() -> None:
    kv = {"policy": "rkv", "budget": 32, "buffer": 16, "keep_prompt": True}
    cfg = configure(PRESETS["gpu"].model_dump(),
                    ["lr=3e-5", "recipe.evict_share=0.5", f"recipe.evict_kv={json.dumps(kv)}"])
    assert cfg.lr == 3e-5
    assert cfg.recipe.evict_share == 0.5 and cfg.recipe.evict_kv == kv
    assert cfg.recipe.fingerprint() != PRESETS["gpu"].recipe.fingerprint()  # another warm start
    with pytest.raises(ValueError):  # validated like any other field
        configure(PRESETS["gpu"].model_dump(), ["recipe.evict_share=2"])


def test_an_override_takes_a_bare_word_and_names_a_misspelt_key() -> None:
    cfg = configure(PRESETS["gpu"].model_dump(), ["kv_control.metric=kl_old_sampler"])
    assert cfg.kv_control.metric == "kl_old_sampler"  # JSON would need '"kl_old_sampler"'
    with pytest.raises(ValueError, match="kv_control has no field 'targt'"):
        configure(PRESETS["gpu"].model_dump(), ["kv_control.targt=0.1"])  # pydantic would drop it
    with pytest.raises(ValueError, match="the config has no field 'lrr'"):
        configure(PRESETS["gpu"].model_dump(), ["lrr=1e-4"])
    with pytest.raises(ValueError, match="expected KEY=VALUE"):
        configure(PRESETS["gpu"].model_dump(), ["lr"])
    with pytest.raises(ValueError, match="lr holds no fields"):
        configure(PRESETS["gpu"].model_dump(), ["lr.x=1"])
    with pytest.raises(ValueError, match="metric"):  # a bare word the field does not take
        configure(PRESETS["gpu"].model_dump(), ["kv_control.metric=veto"])


def test_a_bad_override_is_a_usage_error_not_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--preset", "smoke", "--set", "kv_control.targt=0.1"])
    assert exit_.value.code == 2 and "no field 'targt'" in capsys.readouterr().err


def test_the_gpu_presets_controller_is_the_one_measured_at_parity() -> None:
    """0.45 divergent, 2 steps of 512 sequences per move, 16-96 tokens: the settings of the three
    warm starts' runs; a `kv_control=` override replaces them whole (as the documented commands do)."""
    control = PRESETS["gpu"].kv_control
    assert (control.metric, control.target, control.min_sequences) == ("divergent_rate", 0.45, 1024)
    assert (control.min_budget, control.max_budget, control.step) == (16, 96, 4)
    cfg = configure(PRESETS["gpu"].model_dump(), ['kv_control={"target": 0.3}'])
    assert (cfg.kv_control.target, cfg.kv_control.max_budget) == (0.3, 512)
