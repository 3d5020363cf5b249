"""Liveness while the trainer starts (issue 28 row 9): a warm start or model load that makes
progress keeps /healthz at 200 past SPARSECAST_STALL_S; a start blocked on nothing is still
reported stuck."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

import services.trainer.service as service_module
import services.trainer.warmstart as warmstart
from services.trainer.service import TrainerService
from services.trainer.settings import TrainerSettings
from services.trainer.warmstart import WarmstartRecipe, steps_trained, train_warmstart

STALL_S = 1.0
START_S = 3.0  # three times the stall bound


def settings(tmp_path: Path) -> TrainerSettings:
    # Nothing is reached during the start: the fake warm start fails before Redis or the registry.
    return TrainerSettings(model="tiny-demo", warmstart_cache=str(tmp_path / "cache"),
                           data_dir=str(tmp_path / "data"), stall_s=STALL_S, device="cpu",
                           redis_url="redis://127.0.0.1:1", registry_url="http://127.0.0.1:1")


async def liveness_during_start(tmp_path: Path) -> list[dict]:
    """/healthz's answer every 0.2 s while the (fake) warm start runs, until it ends."""
    service = TrainerService(settings(tmp_path))
    reports = []
    async with service.running():
        deadline = time.monotonic() + START_S + 10
        while service.state["error"] is None:
            assert time.monotonic() < deadline, "the fake warm start never ended"
            reports.append(service.liveness())
            await asyncio.sleep(0.2)
    return reports


def test_a_computing_warm_start_stays_alive(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def busy_warm_start(recipe: WarmstartRecipe, out_dir: Path, **kwargs: object) -> dict:
        end = time.monotonic() + START_S
        while time.monotonic() < end:
            sum(i * i for i in range(10_000))  # CPU work, as an SFT step or a model load is
        raise RuntimeError("end of the fake warm start")

    monkeypatch.setattr(warmstart, "train_warmstart", busy_warm_start)
    reports = asyncio.run(liveness_during_start(tmp_path))
    assert len(reports) >= START_S / 0.2 - 2
    assert all(r["ok"] for r in reports), [r["problems"] for r in reports if not r["ok"]]


def test_warm_start_steps_count_as_progress(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps reported by the warm start (here without CPU work between them) keep it alive."""
    steps = [0]

    def stepping_warm_start(recipe: WarmstartRecipe, out_dir: Path, **kwargs: object) -> dict:
        for _ in range(int(START_S / 0.25)):
            time.sleep(0.25)
            steps[0] += 1
        raise RuntimeError("end of the fake warm start")

    monkeypatch.setattr(warmstart, "train_warmstart", stepping_warm_start)
    monkeypatch.setattr(service_module, "steps_trained", lambda: steps[0])
    reports = asyncio.run(liveness_during_start(tmp_path))
    assert reports and all(r["ok"] for r in reports), [r["problems"] for r in reports if not r["ok"]]


def test_a_start_blocked_on_nothing_is_stuck(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def blocked_warm_start(recipe: WarmstartRecipe, out_dir: Path, **kwargs: object) -> dict:
        time.sleep(START_S)  # a hung read: no CPU, no step
        raise RuntimeError("end of the fake warm start")

    monkeypatch.setattr(warmstart, "train_warmstart", blocked_warm_start)
    reports = asyncio.run(liveness_during_start(tmp_path))
    assert reports[0]["ok"]
    assert any("stuck" in p for r in reports for p in r["problems"]), reports[-1]


def test_train_warmstart_reports_each_step(tmp_path: Path) -> None:
    before = steps_trained()
    recipe = WarmstartRecipe(steps=3, batch_size=2, eval_prompts=0, sampled_target=None,
                             model_overrides={"hidden_size": 32, "intermediate_size": 64,
                                              "num_hidden_layers": 1, "num_attention_heads": 2,
                                              "num_key_value_heads": 1, "head_dim": 16})
    train_warmstart(recipe, tmp_path / "model", log_every=0)
    assert steps_trained() == before + 3
