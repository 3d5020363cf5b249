"""The KV budget calibration on a partly trained model of the demo's shape: the tightest budget
that keeps a share of the dense accuracy, measured on the rollout engine; and the demo's
`--kv-calibrate` over it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from services.demo.launcher import Stack
from services.demo.options import DemoOptions
from services.rollout.calibration import calibrate
from services.rollout.engine import KVConfig, LLMEngine
from shared.tasks import get_task

SPARSE = KVConfig(policy="rkv", buffer=2, keep_prompt=False)


@pytest.fixture(scope="module")
def engine_and_tokenizer(partial_model_dir: Path) -> tuple[LLMEngine, AutoTokenizer]:
    return LLMEngine.from_pretrained(partial_model_dir), AutoTokenizer.from_pretrained(partial_model_dir)


def test_the_tightest_passing_budget_is_chosen(engine_and_tokenizer: tuple) -> None:
    engine, tokenizer = engine_and_tokenizer
    task = get_task("addition")
    every = calibrate(engine, tokenizer, task, SPARSE, [64, 8, 16], min_ratio=0.0, prompts=64,
                      stop_at_first=False)
    assert every.met and every.budget == 8 and [r["budget"] for r in every.rows] == [8, 16, 64]
    assert every.dense["accuracy"] > 0.2 and every.dense["kv_saved"] < 0.05  # a partly trained model
    saved = [r["kv_saved"] for r in every.rows]
    assert saved[0] > saved[1] > saved[2] > every.dense["kv_saved"]  # a tighter budget keeps less
    for row in every.rows:
        assert row["ratio"] == pytest.approx(row["accuracy"] / every.dense["accuracy"])
    # The budget 8 row needs no larger one: the first passing budget ends the sweep.
    first = calibrate(engine, tokenizer, task, SPARSE, [8, 16, 64], min_ratio=0.0, prompts=64)
    assert first.rows == every.rows[:1] and first.dense == every.dense  # seeded: the same samples
    # A ratio the eviction cannot keep at 8 tokens (a dense cache would never evict at 200).
    between = calibrate(engine, tokenizer, task, SPARSE, [8, 200], min_ratio=every.rows[0]["ratio"] + 0.3,
                        prompts=64)
    assert between.met and between.budget == 200 and between.rows[1]["kv_saved"] == every.dense["kv_saved"]


def test_no_budget_keeping_the_ratio_takes_the_largest(engine_and_tokenizer: tuple) -> None:
    engine, tokenizer = engine_and_tokenizer
    result = calibrate(engine, tokenizer, get_task("addition"), SPARSE, [8, 12], min_ratio=1.0, prompts=32)
    assert not result.met and result.budget == 12 and len(result.rows) == 2
    assert all(r["ratio"] < 1.0 for r in result.rows)


def test_demo_runs_its_workers_at_the_calibrated_budget(partial_model_dir: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the calibration cache lives under ./.cache
    stack = Stack(DemoOptions(kv_budget=8, kv_calibrate=0.05, folder=tmp_path / "demo"))
    stack.prepare()
    stack.calibrate_kv(partial_model_dir)
    result = stack.calibration
    assert result is not None and [r["budget"] for r in result["rows"]][0] == 8
    passing = [r["budget"] for r in result["rows"] if r["ratio"] >= 0.05]
    # 8, 12, 16 (steps of 4 up to twice the budget): the first that passes, else the largest.
    assert stack.o.kv_budget == result["budget"] == (passing[0] if passing else 16)
    assert result["met"] == bool(passing)
    [cached] = (tmp_path / ".cache" / "kv-calibration").iterdir()
    assert json.loads(cached.read_text()) == stack.calibration
    # Cached per model and settings: a second demo measures nothing (no child process).
    again = Stack(DemoOptions(kv_budget=8, kv_calibrate=0.05, folder=tmp_path / "demo"))
    again.prepare()
    again.calibrate_kv(partial_model_dir)
    assert again.calibration == stack.calibration and not list(again.procs.log_dir.iterdir())
    # Off by default: the budget stays as given.
    plain = Stack(DemoOptions(kv_budget=8, folder=tmp_path / "demo"))
    plain.calibrate_kv(partial_model_dir)
    assert plain.o.kv_budget == 8 and plain.calibration is None
