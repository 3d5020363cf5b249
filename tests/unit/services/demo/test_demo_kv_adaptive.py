"""The demo's trainer options: the adaptive KV budget (on by default, passed as the
SPARSECAST_KV_CONTROL__* settings the trainer reads, and shown in the summary) and the loss's anchor."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from services import cli
from services.demo.launcher import Stack
from services.demo.live import summary
from services.demo.options import DemoOptions
from services.trainer.kv_budget import KVControlSettings
from services.trainer.settings import TrainerSettings


def _options(monkeypatch: pytest.MonkeyPatch, *argv: str) -> DemoOptions:
    seen: list[DemoOptions] = []
    monkeypatch.setattr("services.demo.supervisor.run_demo", lambda options: seen.append(options) or 0)
    assert cli.main(["demo", *argv]) == 0
    return seen[0]


def _trainer_settings(monkeypatch: pytest.MonkeyPatch, options: DemoOptions,
                      tmp_path: Path) -> TrainerSettings:
    stack = Stack(options)
    for key, value in stack.kv_control_env().items():
        monkeypatch.setenv(key, value)
    stack.http.close()
    return TrainerSettings(data_dir=str(tmp_path))


def test_on_by_default_from_the_demo_budget_with_the_trainer_defaults(monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path: Path) -> None:
    options = _options(monkeypatch)
    assert options == DemoOptions()  # the demo's defaults are untouched
    kv = _trainer_settings(monkeypatch, options, tmp_path).kv_control
    defaults = TrainerSettings(data_dir=str(tmp_path)).kv_control  # what the demo leaves to the trainer
    assert (kv.mode, kv.start_budget) == ("adaptive", 32)  # unresolved (no model yet): DEMO_KV's
    assert (kv.metric, kv.target, kv.min_budget, kv.max_budget) == (
        defaults.metric, defaults.target, defaults.min_budget, defaults.max_budget)
    # The demo's floor on the KV saved (the trainer has none by default), and 0 for none.
    assert (kv.min_saved, KVControlSettings().min_saved) == (0.4, None)
    stack = Stack(_options(monkeypatch, "--kv-min-saved", "0"))
    assert "SPARSECAST_KV_CONTROL__MIN_SAVED" not in stack.kv_control_env()
    stack.http.close()


def test_no_kv_adaptive_keeps_the_trainer_fixed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    options = _options(monkeypatch, "--no-kv-adaptive")
    assert options.kv_adaptive is False
    stack = Stack(options)
    assert stack.kv_control_env() == {}
    stack.http.close()
    assert _trainer_settings(monkeypatch, options, tmp_path).kv_control.mode == "fixed"


def test_the_options_reach_the_trainer(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    options = _options(monkeypatch, "--kv-adaptive", "--kv-target", "0.4", "--kv-min", "24", "--kv-max", "48",
                       "--kv-min-saved", "0.4")
    assert (options.kv_adaptive, options.kv_target, options.kv_min, options.kv_max, options.kv_min_saved) == (
        True, 0.4, 24, 48, 0.4)
    kv = _trainer_settings(monkeypatch, options, tmp_path).kv_control
    assert (kv.mode, kv.target, kv.min_budget, kv.max_budget, kv.start_budget, kv.min_saved) == (
        "adaptive", 0.4, 24, 48, 32, 0.4)
    for bad in ("1", "-0.1", "nan"):  # a cache saves less than all of the KV
        assert cli.main(["demo", "--kv-min-saved", bad]) == cli.EXIT_USAGE
    # A start outside the bounds given starts at the nearest bound (the trainer would refuse it).
    above = _trainer_settings(monkeypatch, DemoOptions(kv_adaptive=True, kv_min=40), tmp_path).kv_control
    assert (above.start_budget, above.min_budget) == (40, 40)
    assert cli.main(["demo", "--kv-adaptive", "--kv-min", "64", "--kv-max", "32"]) == cli.EXIT_USAGE
    assert cli.main(["demo", "--kv-max", "20"]) == cli.EXIT_USAGE  # under the default lowest, 26


def test_the_first_budget_is_where_the_floor_lets_the_controller_go(monkeypatch: pytest.MonkeyPatch,
                                                                    tmp_path: Path) -> None:
    """Without --kv-budget the workers and the controller start at the largest budget that saves the
    floor on the task's reference completions (30 for addition 3-6 with the sum scratchpad and the
    prompt kept, at 40 %); a given budget, no controller or no floor keep the budget as before."""
    from shared.tokenizer import build_tokenizer

    model_dir = tmp_path / "model"
    build_tokenizer().save_pretrained(model_dir)

    def first_budget(*argv: str, where: Path = model_dir) -> tuple[int | None, dict[str, str]]:
        stack = Stack(_options(monkeypatch, *argv))
        stack.say = lambda text: None  # type: ignore[method-assign]
        stack.resolve_kv_budget(where)
        stack.http.close()
        return stack.o.kv_budget, stack.kv_control_env()

    budget, env = first_budget()
    assert budget == 30 and env["SPARSECAST_KV_CONTROL__START_BUDGET"] == "30"
    assert first_budget("--kv-min-saved", "0.45")[0] == 26  # 27 + 2 saves 44.5 %: below
    assert first_budget("--kv-max", "28")[0] == 28  # within the controller's bounds
    assert first_budget("--kv-budget", "20")[0] == 20  # given: as given
    assert first_budget("--no-kv-adaptive")[0] == 32  # a fixed budget: the demo's cache
    assert first_budget("--kv-min-saved", "0")[0] == 32  # no floor: nothing to size it on
    assert first_budget(where=tmp_path / "no-tokenizer")[0] == 32
    # The digits asked for size it: 6-8 digit sums are longer, so a larger budget still saves 40 %.
    assert first_budget("--digits", "6-8")[0] > 30
    # Sparse-RL's semantics (the prompt evictable): the budget counts the prompt too, so it is larger.
    assert first_budget("--no-kv-keep-prompt")[0] > 30


def test_the_summary_shows_the_budget_it_moved(tmp_path: Path) -> None:
    figures: dict[str, Any] = {
        "steps": 60, "wall_seconds": 74.0, "versions": 61, "patches": 60, "dense_bytes": 1_207_424,
        "patch_bytes_mean": 139_093.0, "reward_first3": 0.075, "reward_last3": 0.085,
        "accuracy_first3": 0.2, "accuracy_last3": 0.35, "heldout_accuracy_start": 0.5,
        "heldout_accuracy_end": 0.7, "changed_fraction": 0.26, "kv_saved": 0.4,
        "kv_sparse_bytes_mean": 52_221.0, "kv_dense_bytes_mean": 111_830.0, "rejection_rate": 0.3,
        "token_mask_rate": 0.01, "workers": {}, "kv_budget_first": 32, "kv_budget_last": 44,
    }

    def text(options: DemoOptions) -> str:
        console = Console(record=True, width=300)
        console.print(summary(options, figures, "http://127.0.0.1:1", tmp_path))
        return console.export_text()

    assert "budget 32 → 44 (adaptive) tokens" in text(DemoOptions(kv_adaptive=True))
    assert "budget 32 tokens" in text(DemoOptions(kv_adaptive=False, kv_budget=32))  # as resolved


def test_the_anchor_reaches_the_trainer_only_when_given(monkeypatch: pytest.MonkeyPatch,
                                                        tmp_path: Path) -> None:
    default = TrainerSettings(data_dir=str(tmp_path)).loss.kl_coef
    for argv, expected in ((["--kl-coef", "0.04"], 0.04), ([], default)):
        stack = Stack(_options(monkeypatch, *argv))
        env = stack.loss_env()
        stack.http.close()
        assert ("SPARSECAST_LOSS__KL_COEF" in env) == bool(argv)
        with monkeypatch.context() as m:
            for key, value in env.items():
                m.setenv(key, value)
            loss = TrainerSettings(data_dir=str(tmp_path)).loss
        assert (loss.kl_coef, loss.recompute) == (expected, DemoOptions().recompute)
    for bad in ("-0.1", "nan", "inf"):
        assert cli.main(["demo", "--kl-coef", bad]) == 2  # a usage error, before anything starts


def test_the_scratchpad_reaches_the_prompts_the_heldout_check_and_the_first_budget(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """--scratchpad asks the prompts API for that scratchpad (the groups then carry its generation
    budget), the trainer's held-out check uses it, and its completions size the first budget."""
    from shared.tasks import get_task
    from shared.tokenizer import build_tokenizer

    model_dir = tmp_path / "model"
    build_tokenizer().save_pretrained(model_dir)
    options = _options(monkeypatch, "--scratchpad", "column", "--digits", "3-5")
    assert options.task_options() == {"min_digits": 3, "max_digits": 5, "scratchpad": "column"}
    assert DemoOptions().task_options() == {}  # the task's own
    assert cli.main(["demo", "--scratchpad", "diagonal"]) == cli.EXIT_USAGE
    stack = Stack(_options(monkeypatch, "--scratchpad", "column"))
    stack.say = lambda text: None  # type: ignore[method-assign]
    stack.urls["registry"] = "http://127.0.0.1:1"  # not started: only its settings are read
    for key, value in stack.trainer_env(model_dir, 1).items():
        if key.startswith("SPARSECAST_"):
            monkeypatch.setenv(key, value)
    settings = TrainerSettings(data_dir=str(tmp_path))
    assert settings.eval_task_options == {"scratchpad": "column"}
    eval_task = get_task(settings.default_task, **settings.eval_task_options)
    assert eval_task.max_new_tokens < get_task(settings.default_task).max_new_tokens  # the sum's
    stack.resolve_kv_budget(model_dir)
    stack.http.close()
    assert stack.o.kv_budget is not None and stack.o.kv_budget < 30  # the default's is 30 (above)
