"""The demo's closing table says why the batches stayed flat when most of them were vetoed."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from services.demo.live import summary
from services.demo.options import DemoOptions


def _figures(rejection_rate: float) -> dict:
    return {
        "steps": 60, "wall_seconds": 74.0, "versions": 61, "patches": 60, "dense_bytes": 1_207_424,
        "patch_bytes_mean": 139_093.0, "reward_first3": 0.075, "reward_last3": 0.085, "accuracy_first3": 0.0,
        "accuracy_last3": 0.0, "heldout_accuracy_start": 0.55, "heldout_accuracy_end": 0.38,
        "changed_fraction": 0.26, "kv_saved": 0.53, "kv_sparse_bytes_mean": 52_221.0,
        "kv_dense_bytes_mean": 111_830.0, "rejection_rate": rejection_rate, "token_mask_rate": 0.03,
        "workers": {"demo-worker-1": {"version": 60, "tokens_per_s": 7506.0}},
    }


def _text(rejection_rate: float) -> str:
    console = Console(record=True, width=300)
    console.print(summary(DemoOptions(), _figures(rejection_rate), "http://127.0.0.1:1", Path("logs")))
    return console.export_text()


def test_a_mostly_vetoed_run_points_at_the_budget() -> None:
    assert "most batches were vetoed" in _text(0.976) and "--kv-budget" in _text(0.976)
    assert "most batches were vetoed" not in _text(0.50)  # the documented runs veto 38-51 %
