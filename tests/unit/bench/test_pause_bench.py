"""bench.pause on a CPU with the tiny shape: patches reach a generating worker, pauses recorded."""

from __future__ import annotations

import argparse

from bench.pause import percentile, run


def test_the_pause_bench_applies_every_version_while_generating() -> None:
    args = argparse.Namespace(device="cpu", shape="tiny", versions=2, lr=1e-6, seed=0, train_batch=2,
                              train_seq=16, batch=2, prompt=4, gen=4, gap_batches=1, threads=1,
                              baseline=True)
    result = run(args)
    rows, summary = result["per_version"], result["summary"]
    assert [r["version"] for r in rows] == [1, 2]
    for r in rows:
        assert r["changed"] > 0 and r["patch_bytes"] > 0
        assert 0 < r["write_s"] <= r["pause_s"]  # the write happens inside the pause
        assert r["stage_s"] > 0  # staged before the lock was asked for
    assert summary["final_weights_match_last_target_fingerprint"] is True
    assert summary["batches_generated"] >= 3  # warm-up 2, then one between the versions
    assert summary["max_pause_s"] == max(r["pause_s"] for r in rows)
    assert set(result["targets"]) == {"median_pause_le_5ms", "p99_pause_le_20ms"}
    assert result["device_name"]
    assert [r["version"] for r in result["baseline_per_version"]] == [1, 2]
    assert summary["baseline_whole_apply_under_lock"]["max_pause_s"] > 0


def test_percentile_is_the_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.99) == 99.0
    assert percentile(values, 0.5) == 50.0
    assert percentile([3.0], 0.99) == 3.0
