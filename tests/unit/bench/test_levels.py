"""bench.levels: one row per operand length, each scored four ways on the same prompts."""

import json
import sys

from bench import levels


def test_each_level_is_scored_on_its_own_prompts(tiny_model_dir, tmp_path, monkeypatch):
    out = tmp_path / "levels.json"
    options = '{"min_digits": 2, "max_digits": 4}'
    monkeypatch.setattr(sys, "argv", ["levels", tiny_model_dir, "--prompts", "3", "--threads", "1",
                                      "--task-options", options, "--out", str(out)])
    levels.main()
    report = json.loads(out.read_text())
    rows = report["levels"]
    assert [row["level"] for row in rows] == [0, 1, 2] and report["prompts_per_level"] == 3
    assert [len(row["example"].removeprefix("add ").split("+")[0]) for row in rows] == [2, 3, 4]
    scores = ("dense_greedy", "dense_sampled", "engine_sampled", "engine_sampled_under_cache")
    assert all(0.0 <= row[key] <= 1.0 for row in rows for key in scores)
