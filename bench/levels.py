"""A model's accuracy per level of a task: `python -m bench.levels MODEL_DIR [--prompts 128]`.

Per level (`Task.levels()`: addition's operand lengths) on the same fresh prompts: dense greedy and
dense sampled (T = 1) accuracy (transformers), and sampled under the demo's KV cache and without one
on the rollout engine, bf16 weights as a worker holds them. What a warm start gives RL to work with:
GRPO lifts a level the sampler sometimes gets right, not one it never does (docs/training.md, "A
floor per operand length"). The last line is the room for RL (`warmstart.room_for_rl`: the mean
over levels of dense sampled minus sampled under the cache, where the cache leaves a level at least
10 %), which tracked the demo's batch rise (docs/training.md, "Room for RL"). JSON to `--out` (with
the machine's ISA cap, if any, from the env).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.rollout.engine import KVConfig, LLMEngine
from services.rollout.engine.evaluation import evaluate as evaluate_on_engine
from services.trainer.evaluation import evaluate
from services.trainer.warmstart import room_for_rl
from services.trainer.warmstart_recipe import DEMO_CACHE, WarmstartRecipe
from shared.dtypes import compute_dtype
from shared.tasks import Task, get_task

# Prompt seeds apart from the warm start's checks (7_000_001 + step and up) and held-out sets.
PROMPT_SEED = 4242


def levels_report(model_dir: str | Path, task_name: str, task_options: dict, prompts: int,
                  seed: int = 1) -> list[dict]:
    """One row per level: its prompts' first one, and the four accuracies."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    model = model.to(compute_dtype(torch.device("cpu"), torch.bfloat16))
    engine = LLMEngine.from_pretrained(model_dir)  # as a worker loads it
    cache = KVConfig.model_validate(DEMO_CACHE)

    def on_engine(level: Task, pairs: list[tuple[str, str]], kv: KVConfig) -> float:
        return evaluate_on_engine(engine, tokenizer, level, pairs, kv, temperature=1.0, batch=prompts,
                                  seed=seed)["accuracy"]

    rows = []
    for i, level in enumerate(get_task(task_name, **task_options).levels()):
        pairs = level.make_prompts(prompts, PROMPT_SEED + i)
        rows.append({
            "level": i, "example": pairs[0][0].strip(),
            "dense_greedy": evaluate(model, tokenizer, level, pairs, sample=False)["accuracy"],
            "dense_sampled": evaluate(model, tokenizer, level, pairs, sample=True, seed=seed)["accuracy"],
            "engine_sampled": on_engine(level, pairs, KVConfig()),
            "engine_sampled_under_cache": on_engine(level, pairs, cache),
        })
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--task", default="addition")
    parser.add_argument("--task-options", default='{"min_digits": 3, "max_digits": 6}', help="JSON")
    parser.add_argument("--prompts", type=int, default=128, help="per level")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = levels_report(args.model_dir, args.task, json.loads(args.task_options), args.prompts)
    floor = WarmstartRecipe().room_floor
    room = room_for_rl([(r["dense_sampled"], r["engine_sampled_under_cache"]) for r in rows], floor)
    print(json.dumps({"room_for_rl": room, "room_floor": floor}), flush=True)
    if args.out:
        report = {"command": "python -m bench.levels MODEL_DIR", "cache": DEMO_CACHE,
                  "room_for_rl": room, "room_floor": floor,
                  "prompts_per_level": args.prompts, "machine": platform.processor() or platform.machine(),
                  "isa_cap": os.environ.get("ONEDNN_MAX_CPU_ISA"), "levels": rows}
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
