"""bench.checkpoint's CPU path: the trainer's save path timed on the tiny shape, the state loaded
back with an equal checksum after a perturbation, the JSON written with the limits."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.checkpoint import run, shape_name


def test_the_checkpoint_bench_saves_loads_and_checks_the_tiny_learner(tmp_path: Path) -> None:
    assert shape_name("qwen3-1.7b") == "1.7b"
    args = argparse.Namespace(device="cpu", shape="tiny", reps=1, dir=str(tmp_path / "ckpt"),
                              disk_test_gb=0.004, batch=1, seq=16, no_async=False,
                              out_dir=str(tmp_path / "out"))
    result = run(args)
    saved = json.loads((tmp_path / "out" / "checkpoint-cpu.json").read_text())
    assert saved["complete"] and saved["all_checksums_equal"]
    (row,) = saved["reps"]
    assert row["perturbed_differs"] and row["checksums_equal"] and row["load_warm_checksums_equal"]
    # The checkpoint holds every byte of the state (fp32 weights, both moments), nothing left behind.
    # DCP's data file and .metadata, learner.pt, trainer.pt
    assert row["bytes"] >= saved["state_bytes"] and row["files"] == 4
    assert not (tmp_path / "ckpt" / "v00000001").exists()
    assert saved["async"]["background_bytes"] >= saved["async"]["d2h_bytes"] > 0
    assert {"disk_write_bound_seconds", "d2h_pinned_bound_seconds"} <= set(saved["limits"])
    assert result["state_bytes"] == saved["state_bytes"]
