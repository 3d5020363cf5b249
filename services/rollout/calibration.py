"""Accuracy of a model under a KV cache policy, and the tightest budget that keeps enough of it.

Sparse-RL learns from a sparse sampler only while that sampler still solves a fair share of what
the dense policy solves: below about half, most sequences hold a token the dense policy finds
10^4 times less likely, the sequence veto drops them, and the reward stays flat
(docs/training.md, "Choosing the cache"). How much a budget costs depends on the model, and for
the demo's warm start even on the machine that trained it, so the budget is measured, not assumed:

    python -m services.rollout.calibration --model DIR --task addition --policy rkv --buffer 2 \\
        --evict-prompt --budgets 32,36,40,48,64 --min-ratio 0.5

prints one JSON object (every budget tried, the one chosen). `bench.learning` picks its budget
the same way.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from pydantic import BaseModel
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from services.rollout.engine import KVConfig, LLMEngine
from services.rollout.engine.evaluation import evaluate
from shared.tasks import Task, get_task

# The calibration prompts and their samples: apart from the seeds the trainer draws its prompts with.
CALIBRATION_SEED = 990_002


class Calibration(BaseModel):
    """Every budget tried (ascending) with its accuracy and its ratio to dense, and the choice."""

    budget: int
    met: bool  # False: no candidate kept `min_ratio`; `budget` is then the largest
    min_ratio: float
    dense: dict[str, float]
    rows: list[dict[str, float]]


def calibrate(engine: LLMEngine, tokenizer: PreTrainedTokenizerBase, task: Task, kv: KVConfig,
              budgets: Sequence[int], min_ratio: float, prompts: int = 512, temperature: float = 1.0,
              batch: int = 256, stop_at_first: bool = True, seed: int = CALIBRATION_SEED) -> Calibration:
    """The tightest of `budgets` whose accuracy under `kv` (its budget replaced) is at least
    `min_ratio` × the dense accuracy on the same prompts; with `stop_at_first` larger budgets are
    not tried once one passes."""
    pairs = task.make_prompts(prompts, seed=seed)
    dense = evaluate(engine, tokenizer, task, pairs, KVConfig(policy="dense"), temperature, batch, seed)
    rows: list[dict[str, float]] = []
    for budget in sorted(budgets):
        at_budget = KVConfig.model_validate(kv.model_dump() | {"budget": budget})
        sparse = evaluate(engine, tokenizer, task, pairs, at_budget, temperature, batch, seed)
        ratio = sparse["accuracy"] / dense["accuracy"] if dense["accuracy"] else 0.0
        rows.append({"budget": budget, **sparse, "ratio": ratio})
        if stop_at_first and ratio >= min_ratio:
            break
    passing = [r for r in rows if r["ratio"] >= min_ratio]
    chosen = passing[0] if passing else rows[-1]
    return Calibration(budget=int(chosen["budget"]), met=bool(passing), min_ratio=min_ratio, dense=dense,
                       rows=rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="HF model folder")
    parser.add_argument("--task", default="addition")
    parser.add_argument("--task-options", default="{}", help='JSON, e.g. {"min_digits": 3, "max_digits": 6}')
    parser.add_argument("--policy", default="rkv")
    parser.add_argument("--buffer", type=int, default=KVConfig().buffer)
    parser.add_argument("--evict-prompt", action="store_true", help="the budget counts the prompt too")
    parser.add_argument("--budgets", required=True, help="comma-separated candidates")
    parser.add_argument("--min-ratio", type=float, default=0.5)
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    task = get_task(args.task, **json.loads(args.task_options))
    engine = LLMEngine.from_pretrained(Path(args.model), device=args.device)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    kv = KVConfig(policy=args.policy, buffer=args.buffer, keep_prompt=not args.evict_prompt)
    budgets = [int(b) for b in args.budgets.split(",")]
    result = calibrate(engine, tokenizer, task, kv, budgets, args.min_ratio, args.prompts)
    sys.stdout.write(result.model_dump_json() + "\n")


if __name__ == "__main__":
    main()
