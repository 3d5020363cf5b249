"""One bench.learning arm run in-process on a tiny model: its step rows (shared by the arm tests)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from bench.learning import LearningConfig, run_arm
from services.trainer.warmstart import WarmstartRecipe


def arm_step_rows(arm: str, model_dir: str, tmp_path: Path, **fields: Any) -> list[dict]:
    """`arm` for a few tiny steps (2 prompts x 2 samples, budget 8, no evaluation after step 0);
    `fields` override the LearningConfig (e.g. steps, kv_control, kl_coef). The step rows."""
    threads = torch.get_num_threads()
    cfg = LearningConfig.model_validate({
        "recipe": WarmstartRecipe(), "steps": 2, "groups": 2, "samples": 2, "lr": 1e-3, "kv_buffer": 4,
        "eval_every": 100, "eval_prompts": 2, "eval_batch": 2, "threads": 1, **fields})
    out = tmp_path / f"{arm}.jsonl"
    try:
        run_arm(cfg, arm, seed=0, model_dir=Path(model_dir), budget=8, out=out)
    finally:
        torch.set_num_threads(threads)
    return [r for r in map(json.loads, out.read_text().splitlines()) if r["type"] == "step"]
