"""The demo's closing table says why the batches stayed flat: most of them vetoed, or a cache that
caps the sampler."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from services.demo.live import summary
from services.demo.options import DemoOptions


def _figures(rejection_rate: float, first: float = 0.0, last: float = 0.0) -> dict:
    return {
        "steps": 60, "wall_seconds": 74.0, "versions": 61, "patches": 60, "dense_bytes": 1_207_424,
        "patch_bytes_mean": 139_093.0, "reward_first3": 0.075, "reward_last3": 0.085,
        "accuracy_first3": first, "accuracy_last3": last,
        "heldout_accuracy_start": 0.55, "heldout_accuracy_end": 0.38,
        "changed_fraction": 0.26, "kv_saved": 0.53, "kv_sparse_bytes_mean": 52_221.0,
        "kv_dense_bytes_mean": 111_830.0, "rejection_rate": rejection_rate, "token_mask_rate": 0.03,
        "workers": {"demo-worker-1": {"version": 60, "tokens_per_s": 7506.0}},
    }


def _text(rejection_rate: float, first: float = 0.0, last: float = 0.0) -> str:
    console = Console(record=True, width=300)
    figures = _figures(rejection_rate, first, last)
    console.print(summary(DemoOptions(), figures, "http://127.0.0.1:1", Path("logs")))
    return console.export_text()


def test_a_mostly_vetoed_run_points_at_the_budget() -> None:
    assert "most batches were vetoed" in _text(0.976) and "--kv-budget" in _text(0.976)
    assert "most batches were vetoed" not in _text(0.50)  # the documented runs veto 38-51 %


def test_a_flat_run_under_the_cache_points_at_the_calibration() -> None:
    flat = _text(0.41, 0.221, 0.237)  # the AVX2 machine's default run: +1.6 points, 41 % vetoed
    assert "barely rose" in flat and "--kv-calibrate 0.7" in flat and "most batches were vetoed" not in flat
    assert "barely rose" not in _text(0.18, 0.284, 0.372)  # +8.9: it learned
    assert "barely rose" not in _text(0.976)  # the veto note says it instead
