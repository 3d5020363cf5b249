"""What a warm start is, without torch: its recipe, the recipe's hash, its command line and where the
cache keeps it (`services.trainer.warmstart` builds it).

Kept apart from the build so that `sparsecast demo` finds a cached warm start in its own process: a
child importing torch and transformers only to hash the recipe cost 9 s of every cached run on a
2-core Zen 3.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
from pathlib import Path
from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

from shared.kv import DEMO_KV
from shared.tasks.addition import Scratchpad
from shared.tokenizer import char_vocab

# The demo's workers' own cache (shared.kv.DEMO_KV, the prompt kept), for `evicted_check_kv`.
DEMO_WORKER_CACHE: dict[str, int | str | bool] = DEMO_KV.model_dump(
    include={"policy", "budget", "buffer", "keep_prompt"})
# The cache the default warm start trains under: theirs with the prompt evictable, a stricter cache.
# The recipe as measured with the demo's defaults (docs/training.md, "The sum scratchpad in the demo").
DEMO_CACHE: dict[str, int | str | bool] = {**DEMO_WORKER_CACHE, "keep_prompt": False}
# Fields added after recipes were cached: at their default (None) they stay out of the hash, so the
# recipes before them keep their hashes and their cached warm starts.
LATER_FIELDS = ("evict_from_sampled", "evicted_check_kv", "level_check")

# Bump when the training code changes in a way the recipe fields do not capture.
RECIPE_VERSION = 3  # 2: balanced digit counts, explicit cross-entropy; 3: seeded sampling checks
STAMP_FILE = "warmstart.stamp"


class LevelCheck(BaseModel):
    """What a kept warm start must show on every level of its task, else it is built again."""

    model_config = ConfigDict(frozen=True)

    # Dense sampled (T = 1) accuracy each level must reach. On a Zen 4 the warm starts behind most
    # of the demo's missed rises stopped with the 5- and 6-digit sums at 5-8 %, where every one
    # that met the criteria had each length at >= 27 % (docs/training.md, "A warm start that has
    # every length, or is built again"): RL lifts a level its sampler sometimes gets right.
    min_sampled: float = Field(default=0.15, gt=0.0, le=1.0)
    prompts: int = Field(default=64, ge=1)  # per level; at 64, 5 % and 27 % fall on either side of 15 %
    # Builds from the next seeds (seed + 1, + 2, ...) before the best one is kept anyway.
    rebuilds: int = Field(default=2, ge=0)


class WarmstartRecipe(BaseModel):
    model_config = ConfigDict(frozen=True)

    seed: int = 0
    # An upper bound: the default stops at `sampled_target` (addition 3-6 digits crosses it after
    # 450-1200 steps, depending on the machine's arithmetic: the jump is abrupt, docs/training.md).
    steps: int = 1500
    batch_size: int = 32
    lr: float = 3e-3
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    threads: int = 2
    # Share of SFT examples per task. Addition only: it is the RL demo task, and sorting/countdown at
    # 10 % each stayed at 0 % accuracy while costing a fifth of the SFT budget (docs/training.md).
    task_mix: dict[str, float] = Field(default_factory=lambda: {"addition": 1.0})
    # 3-6 digits with the sum scratchpad (the task's default, named so the recipe's hash says it):
    # 41-90 token completions, so a KV budget of 16-32 bites, and ~0.5 s per SFT step.
    task_options: dict[str, dict[str, int | str]] = Field(
        default_factory=lambda: {"addition": {"min_digits": 3, "max_digits": 6, "scratchpad": "sum"}}  # type: ignore[arg-type]
    )
    # Model: shared.modeling's "tiny" Qwen3 shape with the char vocab; `model_overrides` shrink it
    # further so SFT fits the two-minute CPU budget.
    shape: str = "tiny"
    model_overrides: dict[str, int] = Field(
        default_factory=lambda: {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 3,
                                 "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}
    )
    eval_prompts: int = 64
    device: str = "cpu"  # "cuda" for the larger GPU recipes (bench.learning); CPU runs are byte-deterministic
    # Stop early once the sampled (T = 1) accuracy on `eval_prompts` fresh prompts of the first task
    # reaches this, checked every `check_every` steps: RL wants a *partial* warm start.
    sampled_target: float | None = 0.4
    # 25, not 50: a capped CPU's dense check went from 28 to 88 % between two checks 50 steps apart,
    # so the stop came at a model with little room left for RL (rises +7 to +13); checked every 25 it
    # stopped at 475 (rises +32 to +48), and the demo met every criterion in 6 of 6 runs natively and
    # capped (docs/training.md, "On an Intel AMX CPU"; a third capped warm start still missed the rise).
    check_every: int = Field(default=25, ge=1)
    check_from: int = 300  # no recipe here crossed 0.4 before ~450 steps: skip the checks' cost until then
    # Sparsity-aware warm start: this share of the SFT examples lets every completion token attend
    # only to the prompt and the last `local_window` completion tokens, so the model learns not to
    # lean on context that a KV budget evicts (0: plain dense SFT).
    local_attention: float = Field(default=0.0, ge=0.0, le=1.0)
    local_window: int = Field(default=16, ge=1)
    # Label smoothing of the SFT targets: a less confident model whose sampled (T = 1) accuracy sits
    # well below its greedy accuracy, which is the room RL's sharpening has to gain in.
    label_smoothing: float = Field(default=0.0, ge=0.0, lt=1.0)
    # Eviction-aware SFT: this share of each batch is trained under the attention the rollout engine
    # would give it with the KV cache `evict_kv` (services.rollout.engine.replay: the engine replays
    # the example under the model's current weights, in bf16 as workers hold them, and each layer and
    # KV head sees only what the cache kept). The model then learns to add under the eviction it
    # will be sampled with, whatever the machine's arithmetic makes of its attention (0: dense SFT).
    # Default: half of each batch under the demo's cache. A dense-SFT warm start sampled 0-56 % of
    # its dense accuracy under that cache depending on the CPU, and the demo's RL then either could
    # not learn or bought sparse accuracy with dense (docs/training.md, "The demo"). About 3x the
    # SFT time (one replay per step).
    evict_share: float = Field(default=0.5, ge=0.0, le=1.0)
    evict_kv: dict[str, int | str | bool] = Field(default_factory=lambda: dict(DEMO_CACHE))  # KVConfig fields
    # A replay costs about the same for 4 rows as for 32 (its decode loop runs once per position, not
    # per row), so the evicted share is trained on one step in `evict_every`, at `evict_share *
    # evict_every` of that step's rows: the same share of examples for half the replays.
    evict_every: int = Field(default=2, ge=1)
    # Eviction-aware SFT only from the first check whose dense sampled accuracy reaches this: the
    # replays (over half of an eviction-aware step's time on a CPU) are spent once the model starts to
    # add, adapting it to the cache, instead of from the first step (None: from the first step). 0.2,
    # before the jump to 60-70 % that a capped CPU makes within 50 steps: with the stop checked under
    # the demo's cache (`evicted_check_kv`) the SFT took 133-145 s instead of 274-351 s on a Zen 4, and
    # the demo met every criterion in 6 of 6 runs natively and capped (docs/training.md, "An earlier
    # gate and the stop checked under the demo's own cache"); at 0.4 it missed the rise capped.
    evict_from_sampled: float | None = Field(default=0.2, ge=0.0, le=1.0)
    # With eviction-aware SFT the stop also waits until the sampled (T = 1) accuracy under a cache
    # (`evicted_check_kv`; the rollout engine, bf16 as a worker holds the weights,
    # `evicted_check_prompts` prompts)
    # reaches this: the demo's batches are sampled under that cache, and on some CPUs the dense target
    # arrived while the cached sampler was at under half of it (docs/training.md, "The demo").
    evicted_target: float | None = 0.4
    # The cache that check (and the report's `evicted_sampled`) samples under; None: `evict_kv`, the
    # one trained under. Default: the demo's workers' (the prompt kept), so the stop asks how the
    # demo's sampler adds while the SFT still trains under the stricter evictable cache; under that
    # one a capped CPU's check stayed at 20-30 % until the dense ceiling (same section).
    evicted_check_kv: dict[str, int | str | bool] | None = Field(
        default_factory=lambda: dict(DEMO_WORKER_CACHE))
    # ...but not past this dense sampled accuracy: where the cached sampler plateaus below
    # `evicted_target` (an Intel AMX CPU: 0.20-0.38 under the cache from step 550 to 1100 while dense
    # went 0.64 -> 0.98) the wait bought a dense model with no room left for RL on held-out prompts.
    # Above every stop measured on the AMD CPUs (dense 0.41-0.69 there).
    sampled_ceiling: float | None = 0.75
    evicted_check_prompts: int = 128
    # How the SFT examples of a task spread over its levels (`Task.levels()`: addition's operand
    # lengths). "uniform": every level alike. "loss": a level is drawn in proportion to its running
    # per-token SFT loss (mixed with `level_uniform_share` of uniform draws, so a learned level is
    # still rehearsed), so the SFT spends its steps where the model is still wrong and the levels are
    # learned together rather than one after another. Tried for the demo, not kept (docs/training.md,
    # "Room for RL"), as was `room_target`.
    level_sampling: Literal["uniform", "loss"] = "uniform"
    level_uniform_share: float = Field(default=0.25, ge=0.0, le=1.0)
    # Stop by room for RL (eviction-aware recipes; replaces `evicted_target` and `sampled_ceiling`
    # when set): once the dense check passes, each level of the first task is sampled densely and
    # under `evict_kv` on the same `room_prompts` prompts, and the SFT stops once the mean over levels
    # of (dense − under the cache) reaches `room_target`, a level counting only where the cache leaves
    # it at least `room_floor` (below that a GRPO group of 8 seldom holds a success: no signal). That
    # gap is what the demo's RL, sampled under the cache, can gain. If the bound comes first, the
    # weights of the check with the most room are kept.
    room_target: float | None = None
    room_floor: float = 0.1
    room_prompts: int = 64
    # Checked on the kept model: a build with a level sampled right less often than the check asks
    # is built again from the next seed (`build_warmstart`). None: the first build is kept.
    level_check: LevelCheck | None = Field(default_factory=LevelCheck)

    def fingerprint(self) -> str:
        """Hash of everything that determines the weights: recipe, vocab, code version."""
        recipe = self.model_dump()
        for name in LATER_FIELDS:
            if recipe[name] is None:
                del recipe[name]
        blob = json.dumps(
            {"recipe": recipe, "vocab": char_vocab(), "version": RECIPE_VERSION,
             "torch": torch_release()},
            sort_keys=True,
        )
        return hashlib.sha256(blob.encode()).hexdigest()


def torch_release() -> str:
    """The installed torch's release, read without importing it (the recipe's hash names it)."""
    return importlib.metadata.version("torch").split("+")[0]


def cached_model_dir(cache_dir: str | Path, recipe: WarmstartRecipe) -> Path:
    """Where `cache_dir` keeps the model `recipe` builds."""
    return Path(cache_dir) / f"warmstart-{recipe.fingerprint()[:16]}"


def is_current(model_dir: Path, recipe: WarmstartRecipe) -> bool:
    stamp = model_dir / STAMP_FILE
    return stamp.is_file() and stamp.read_text().strip() == recipe.fingerprint()


def recipe_from_args(args: argparse.Namespace) -> WarmstartRecipe:
    """The recipe `--out` builds: the default one with what the command line changed."""
    defaults = WarmstartRecipe()
    addition = {**defaults.task_options["addition"]}
    if args.scratchpad:
        addition["scratchpad"] = args.scratchpad
    return WarmstartRecipe(steps=args.steps, seed=args.seed, batch_size=args.batch_size, lr=args.lr,
                           threads=args.threads, eval_prompts=args.eval_prompts,
                           level_sampling=args.level_sampling, room_target=args.room_target,
                           task_options={**defaults.task_options, "addition": addition},
                           evict_kv={**defaults.evict_kv, "budget": args.evict_budget},
                           evict_from_sampled=args.evict_from_sampled, check_every=args.check_every,
                           evicted_check_kv=None if args.check_under == "train" else dict(DEMO_WORKER_CACHE),
                           level_check=None if args.no_level_check else defaults.level_check)


def _accuracy_or_none(text: str) -> float | None:
    return None if text == "none" else float(text)


def arg_parser(description: str | None = None) -> argparse.ArgumentParser:
    """The build's command line (`python -m services.trainer.warmstart`, which describes itself)."""
    parser = argparse.ArgumentParser(description=description)
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--out", help="model directory to write (HF format, bf16)")
    target.add_argument(
        "--ensure",
        metavar="CACHE_DIR",
        help="make sure CACHE_DIR holds the recipe's model: prints 'TRAINING <steps>' "
        "when it must be built, then 'MODEL <path>' (what `sparsecast demo` reads)",
    )
    defaults = WarmstartRecipe()
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--threads", type=int, default=defaults.threads)
    parser.add_argument("--eval-prompts", type=int, default=defaults.eval_prompts)
    parser.add_argument("--level-sampling", choices=["uniform", "loss"], default=defaults.level_sampling)
    parser.add_argument("--room-target", type=float, default=defaults.room_target,
                        help="stop by room for RL (eviction-aware recipes; see WarmstartRecipe.room_target)")
    parser.add_argument("--evict-budget", type=int, default=defaults.evict_kv["budget"],
                        help="the budget of the cache the eviction-aware SFT trains under (evict_kv; "
                        "the demo's by default; its stop checks under it too with --check-under train)")
    parser.add_argument("--evict-from-sampled", type=_accuracy_or_none, default=defaults.evict_from_sampled,
                        metavar="ACCURACY", help="dense SFT until a check's sampled accuracy reaches "
                        "this, eviction-aware after (WarmstartRecipe.evict_from_sampled; default "
                        f"{defaults.evict_from_sampled}; 'none': eviction-aware from the first step)")
    parser.add_argument("--check-under", choices=["train", "demo"], default="demo",
                        help="the cache the stop's check samples under: the one trained under "
                        "(evict_kv) or the demo's workers' (the prompt kept; "
                        "WarmstartRecipe.evicted_check_kv)")
    parser.add_argument("--check-every", type=int, default=defaults.check_every,
                        help="steps between the stop's sampled checks (WarmstartRecipe.check_every)")
    parser.add_argument("--no-level-check", action="store_true",
                        help="keep the first build whatever it samples per level (by default a build "
                        "with a level sampled right less often than WarmstartRecipe.level_check asks is "
                        "built again from the next seed)")
    parser.add_argument("--scratchpad", choices=get_args(Scratchpad),
                        help="addition's scratchpad (shared.tasks.addition; default: the recipe's)")
    parser.add_argument("--log-every", type=int, default=50)
    return parser
