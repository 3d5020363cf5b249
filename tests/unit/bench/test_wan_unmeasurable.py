"""bench.wan's ratios: a run in which no sync ended inside its window says nothing about its
transfer (it generated on v0 throughout), so it gets no ratio, and neither does a run measured
against it."""

from __future__ import annotations

from typing import Any

from bench.wan import finish

GBIT = 1e9


def _row(mode: str, links: str, tokens: int, syncs: int) -> dict[str, Any]:
    rates = {"unthrottled": [None] * 3, "1gbit": [GBIT] * 3}[links]
    return {"name": f"{mode}-overlap-{links}", "mode": mode, "sync": "overlap", "links": links,
            "link_bps": rates, "tokens": tokens, "window_s": 34.49, "step_s": 8.622,
            "sync_s": {"n": syncs}}


def _result() -> dict[str, Any]:
    return {"profiles": {}, "chain": {"dense_bytes": 3_441_149_952,
                                      "versions": [{"patch_bytes": 75_696_355}, {"patch_bytes": 58_225_743}]}}


def test_a_run_without_a_finished_sync_gets_no_ratio() -> None:
    rows = [_row("chain", "unthrottled", 1000, 9), _row("chain", "1gbit", 990, 9),
            _row("full", "unthrottled", 1000, 0), _row("full", "1gbit", 770, 0)]
    result = _result()
    finish(result, rows)
    chain_base, chain, full_base, full = rows
    assert chain["vs_unthrottled"] == 0.99 and chain["unmeasurable"] is None
    assert chain_base["vs_unthrottled"] == 1.0
    for row in (full_base, full):  # neither its own ratio nor the one against the patch cluster
        assert row["vs_unthrottled"] is None and row["vs_unthrottled_patch_overlap"] is None
        assert "no sync ended inside the 34.49 s window" in row["unmeasurable"]
    assert "27.5 s at the slowest link" in full["unmeasurable"]  # 3.44 GB at 1 Gbit/s
    assert "unthrottled" in full_base["unmeasurable"]


def test_a_run_measured_against_an_unmeasurable_baseline_gets_no_ratio() -> None:
    rows = [_row("full", "unthrottled", 1000, 0), _row("full", "1gbit", 500, 3)]
    finish(_result(), rows)
    assert rows[1]["unmeasurable"] is None and rows[1]["vs_unthrottled"] is None
