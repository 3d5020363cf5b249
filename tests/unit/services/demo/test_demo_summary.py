"""The demo's closing table says why the batches stayed flat: most of them vetoed, or a cache that
caps the sampler."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from services.demo.live import signal_text, summary
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


def test_the_summary_says_what_held_the_controllers_budget() -> None:
    console = Console(record=True, width=300)
    figures = _figures(0.02, 0.45, 0.70) | {"kv_held_by_steps": {"moved": 6, "floor": 41, "target": 13}}
    console.print(summary(DemoOptions(), figures, "http://127.0.0.1:1", Path("logs")))
    text = console.export_text()
    assert ("held by the floor (40.0% of the KV saved) 41, held inside the target band 13, moved 6 "
            "of 60 steps") in text
    assert "step by step" not in _text(0.02)  # no controller figures, no row


def test_the_live_view_names_the_controllers_signal() -> None:
    """The live panel shows the metric the controller holds (the divergent share by default, not the
    veto rate), its target, and what held the budget."""
    last = {"kv_signal": 0.377, "kv_metric": "divergent_rate", "kv_target": 0.3, "kv_held_by": "floor"}
    assert signal_text(last) == "divergent share 37.7%, target 30.0%; held by the floor on the KV saved"
    assert signal_text(last | {"kv_held_by": None}) == "divergent share 37.7%, target 30.0%"
    kl = {"kv_signal": 0.0123, "kv_metric": "kl_old_sampler", "kv_target": 0.02}
    assert signal_text(kl) == "KL(dense ‖ sampler) 0.012, target 0.020"
