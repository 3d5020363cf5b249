"""bench.learning's adaptive arm: the trainer's KV budget controller moves the engine's budget
between steps in-process, and every step row records the budget its rollouts used."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from bench.learning import ARMS, LearningConfig, run_arm
from services.trainer.kv_budget import KVControlSettings
from services.trainer.warmstart import WarmstartRecipe


def test_the_adaptive_arm_moves_the_rollout_budget(tiny_model_dir: str, tmp_path: Path) -> None:
    assert "adaptive" in ARMS
    threads = torch.get_num_threads()
    # Any mismatch is over this target: the budget rises by a step after every step.
    control = KVControlSettings(metric="kl_old_sampler", target=1e-9, smoothing=1.0, min_sequences=1,
                                min_budget=8, max_budget=20, step=8)
    cfg = LearningConfig(recipe=WarmstartRecipe(), steps=3, groups=2, samples=2, lr=1e-3, kv_buffer=4,
                         eval_every=100, eval_prompts=2, eval_batch=2, threads=1, kv_control=control)
    out = tmp_path / "adaptive.jsonl"
    try:
        run_arm(cfg, "adaptive", seed=0, model_dir=Path(tiny_model_dir), budget=8, out=out)
    finally:
        torch.set_num_threads(threads)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    steps = [r for r in rows if r["type"] == "step"]
    assert [r["rollout_kv_budget"] for r in steps] == [8, 16, 20]  # clamped at max_budget
    assert [r["kv_budget"] for r in steps] == [16, 20, 20]
    assert all(r["kl_old_sampler"] > 1e-9 for r in steps)
