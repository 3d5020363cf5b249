"""Sparse-RL's learning claims on a model trained from scratch: `python -m bench.learning`.

Arms (Sparse-RL, arXiv 2601.10079):
  dense      rollouts with a dense KV cache: the reference run
  naive      R-KV rollouts at the calibrated budget, every correction off: the sparse sampler's
             tokens are trained on as if the dense policy had sampled them
  sparse_rl  R-KV rollouts with the sequence veto, the token mask and ξ reweighting: the authors'
             rule (`divergence_rule="token"`), whatever the trainer's default
  veto, veto_negative, truncate_negative  (optional) sparse_rl with that divergence rule
  tis        (optional) R-KV rollouts with truncated, normalised ξ weights only
  adaptive   (optional) sparse_rl with the trainer's KV budget controller (services.trainer.
             kv_budget, settings `kv_control`) moving the rollout budget between steps from the
             calibrated one; each step row records `rollout_kv_budget` and the controller's report
  adaptive_replayed  (optional) `replayed` with the same controller; its signal is measured against
             a dense recompute (`dense_<metric>`, LearnerConfig.dense_mismatch), since the replayed
             recompute matches the sampler
  adaptive_veto_negative  (optional) veto_negative with the same controller
  adaptive_replayed_veto_negative  (optional) adaptive_replayed with veto_negative, its divergent
             tokens judged against the dense recompute (LossConfig.divergence_against)
  ARM@kl=COEF  any arm above with its own KL anchor weight (`kl_coef` for that arm only): e.g.
             `--arms dense,dense@kl=0.04,adaptive_replayed_veto_negative@kl=0.04` runs the anchored
             and unanchored arms from one warm start, judged in one file against the plain `dense`

Every arm runs synchronously (staleness 0) in a process of its own, with the services' code: our
engine (`LLMEngine`) samples a batch, `services.rollout.worker.score_samples` scores it, the
trainer's `Learner` (same `token_logprobs`, corrections and loss) takes `ppo_updates` AdamW steps,
and the new bf16 weights are copied into the engine. Same prompts and seeds across arms, so arms
are compared pairwise per seed.

Stages:
1. Warm start (cached under --cache): a Qwen3-shaped model with the character vocabulary trained
   from scratch by SFT (services.trainer.warmstart) until its sampled (T = 1) accuracy reaches the
   preset's target, so RL has room. `--build-only` stops here: a build that outlasts one device call
   runs in a call of its own (or beside other work), and the arms' calls find it cached.
2. Calibration: sampled accuracy under R-KV at each candidate budget vs dense on fresh prompts;
   the budget whose sparse/dense ratio is nearest the middle of [0.4, 0.7] is used by every arm.
3. Arms × seeds in parallel processes; a held-out evaluation every `eval_every` steps on fixed
   prompts, greedy and T = 1, under dense inference, R-KV at the training budget and at half of it.
4. Criteria, fixed before any run (CRITERIA below), judged on held-out T = 1 accuracy averaged
   over seeds at the last evaluation every run reached (`judged_at_step`; when `--deadline` stopped
   runs before it, the end-of-training claims are left unjudged), then JSON to bench/results/
   (`plot` draws the PNG from it; `judge` recomputes a stored file's summary and criteria).

    python -m bench.learning --preset gpu --device cuda          # ~10 min of one H100 (docs/training.md)
    python -m bench.learning --preset smoke                      # a CPU check of the whole pipeline
    python -m bench.learning --preset gpu --device cuda --set recipe.seed=5 --build-only
    python -m bench.learning plot bench/results/learning-gpu.json
    python -m bench.learning judge bench/results/learning-gpu.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, get_args

import torch
from pydantic import BaseModel, Field
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from services.rollout.calibration import calibrate
from services.rollout.engine import KVConfig, LLMEngine
from services.rollout.engine.evaluation import evaluate, generate
from services.rollout.worker import sampling_info, score_samples
from services.trainer.kv_budget import (
    KVBudgetController,
    KVControlSettings,
    evidence_from_step,
    signal_key,
)
from services.trainer.learner import Learner, LearnerConfig
from services.trainer.loss import CorrectionConfig, LossConfig
from services.trainer.optim import OptimSettings
from services.trainer.settings import TrainerSettings
from services.trainer.warmstart import REPORT_FILE, WarmstartRecipe, ensure_warmstart_model
from shared.sampling import SamplingSettings
from shared.schemas import Trajectory
from shared.tasks import Task, get_task

RESULTS = Path(__file__).resolve().parent / "results"
EVAL_SEED = 990_001  # held-out prompts: one fixed set for every arm, seed and evaluation
TRAIN_SEED_STRIDE = 1_000_003  # prompts of step t for seed s: seed s * stride + t

# The authors' rule (Sparse-RL's mis.py: a divergent token is masked, its sequence kept), which the
# arms below were measured with before the trainer's default became veto_negative.
AUTHORS = CorrectionConfig(divergence_rule="token")
OFF = AUTHORS.model_copy(update={"sequence_veto": False, "token_mask": False, "token_weight": False})
ARMS: dict[str, tuple[str, LossConfig]] = {  # name -> (rollout KV policy, loss without kl_coef)
    "dense": ("dense", LossConfig()),
    "naive": ("rkv", LossConfig(corrections=OFF, scale_lr_by_survivors=False)),
    "sparse_rl": ("rkv", LossConfig(corrections=AUTHORS)),
    "tis": ("rkv", LossConfig(corrections=AUTHORS.model_copy(update={"sequence_veto": False,
                                                                      "token_mask": False}))),
    # The divergence rules (docs/training.md, "Rejection rules") and the authors' rule with the
    # step size left to Adam (no lr scaling by the surviving share): what chose the defaults.
    "veto": ("rkv", LossConfig(corrections=CorrectionConfig(divergence_rule="veto"))),
    "veto_negative": ("rkv", LossConfig(corrections=CorrectionConfig(divergence_rule="veto_negative"))),
    "truncate_negative": ("rkv",
                          LossConfig(corrections=CorrectionConfig(divergence_rule="truncate_negative"))),
    "sparse_rl_unscaled": ("rkv", LossConfig(corrections=AUTHORS, scale_lr_by_survivors=False)),
    # The default rule with a full step while half the sequences or more survive (issue 26, item 1's
    # options): the lr scaled by the share only below that.
    "veto_negative_full50": ("rkv", LossConfig(corrections=CorrectionConfig(divergence_rule="veto_negative"),
                                               full_step_share=0.5)),
    # The trainer recomputes log-probs under the sampler's replayed eviction (LossConfig.recompute).
    "replayed": ("rkv", LossConfig(corrections=AUTHORS, recompute="replayed")),
}
# Sparse-RL's corrections with the rollout budget moved by the trainer's controller (issue 26).
ADAPTIVE = "adaptive"
ARMS[ADAPTIVE] = ARMS["sparse_rl"]
# The controller with eviction replay (issue 26). Under replay the trainer's old log-probs are computed
# under the sampler's own eviction, so its veto rate and KL(old||sampler) are ~0 at any budget and say
# nothing about the budget: this arm feeds the controller the mismatch against a dense recompute of the
# same batch (what the adaptive arm's signal is): the learner's `dense_<metric>` figures.
ADAPTIVE_REPLAYED = "adaptive_replayed"
ARMS[ADAPTIVE_REPLAYED] = ARMS["replayed"]
# The controller with the trainer's default rule (veto_negative), whose veto rate counts only the
# divergent losers: the controller holds the divergent share with it (the default metric).
ADAPTIVE_VETO_NEGATIVE = "adaptive_veto_negative"
ARMS[ADAPTIVE_VETO_NEGATIVE] = ARMS["veto_negative"]
# The controller under replay with the default rule, its divergence judged against the dense
# recompute the controller already reads: a loser the cache broke is vetoed, the rest trained as
# the sampler ran (issue 26).
ADAPTIVE_REPLAYED_VETO_NEGATIVE = "adaptive_replayed_veto_negative"
ARMS[ADAPTIVE_REPLAYED_VETO_NEGATIVE] = ("rkv", LossConfig(
    corrections=CorrectionConfig(divergence_rule="veto_negative"), recompute="replayed",
    divergence_against="dense"))
CONTROLLED = (ADAPTIVE, ADAPTIVE_REPLAYED, ADAPTIVE_VETO_NEGATIVE, ADAPTIVE_REPLAYED_VETO_NEGATIVE)


def parse_arm(name: str) -> tuple[str, float | None]:
    """`ARM` or `ARM@kl=COEF`: the arm's entry in ARMS and its own KL anchor weight (None: the
    config's `kl_coef`). So one run can hold an arm with and without the anchor, from one warm start
    and judged against one `dense`. A name that is neither raises ValueError, saying why."""
    base, sep, option = name.partition("@")
    if base not in ARMS:
        raise ValueError(f"unknown arm {base!r} (known: {', '.join(sorted(ARMS))})")
    if not sep:
        return base, None
    key, eq, value = option.partition("=")
    try:
        coef = float(value) if key == "kl" and eq else None
    except ValueError:
        coef = None
    if coef is None or not (math.isfinite(coef) and coef >= 0.0):
        raise ValueError(f"arm {name!r}: the only option is @kl=COEF, a finite weight >= 0")
    return base, coef


# Fixed before the runs (issue 12). Accuracy = held-out T = 1 accuracy under dense inference,
# mean over seeds; "sparse" = under R-KV at the training budget.
CRITERIA = {
    "a": "RL helps: dense gains >= 15 points over its warm start",
    "b": "naive sparse ends >= 10 points below dense, or degrades while its mismatch (KL old||sampler) grows",
    "c": "Sparse-RL ends within 3 points of dense",
    "d": "under sparse inference, Sparse-RL's sparse/dense accuracy ratio beats the dense-trained model's "
    "by >= 5 points",
    # Issue 26: a correction must never make the model worse than its warm start.
    "e": "at no evaluation does the corrected arm fall > 2 points below its warm start (mean of seeds)",
}


class LearningConfig(BaseModel):
    recipe: WarmstartRecipe
    device: str = "cpu"
    steps: int = Field(ge=1)
    groups: int = Field(ge=1, description="prompts per step")
    samples: int = Field(ge=2, description="samples per prompt (a GRPO group)")
    lr: float = Field(gt=0)
    ppo_updates: int = Field(default=4, ge=1)
    kl_coef: float = 0.0
    weight_decay: float = 0.0
    temperature: float = 1.0
    micro_batch: int = 512
    kv_budget: int | None = None  # None: calibrate from kv_budgets
    kv_budgets: list[int] = Field(default_factory=lambda: [16, 24, 32, 48, 64])
    kv_buffer: int = 16
    keep_prompt: bool = True
    calibration_prompts: int = 512
    min_kv_ratio: float = 0.5  # the budget keeps at least this share of the dense accuracy
    # The adaptive arm's controller; its mode is adaptive whatever is set here, and an unset
    # start_budget starts it at the training budget (kv_budget, or the calibrated one).
    kv_control: KVControlSettings = Field(default_factory=KVControlSettings)
    eval_every: int = 25
    eval_prompts: int = 1000
    eval_batch: int = 1000
    threads: int = 2

    def task(self) -> Task:
        return get_task("addition", **self.recipe.task_options.get("addition", {}))


# Warm-start recipe of the GPU experiment: ~4.8M parameters (hidden 256, 6 layers, 8 heads / 4 KV
# heads of 32), additions of 6-12 digits with the column scratchpad of every documented GPU run
# (completions of 65-125 tokens, so eviction bites; the task's default is now "sum").
GPU_RECIPE = WarmstartRecipe(
    steps=8000, batch_size=128, lr=1e-3, warmup_steps=100, device="cuda", threads=2,
    task_options={"addition": {"min_digits": 6, "max_digits": 12, "scratchpad": "column"}},
    model_overrides={"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 6,
                     "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32},
    eval_prompts=256, sampled_target=0.35, check_every=250, check_from=0,
    evict_share=0.0,  # dense SFT, as in every documented run (the demo's default is eviction-aware)
    evict_from_sampled=None, evicted_check_kv=None, level_check=None,  # the hash of every documented run
)
PRESETS: dict[str, LearningConfig] = {
    # The controller as measured on the evictable R-KV 48 cell (docs/training.md, "The 0.45 target
    # from two more warm starts"): 0.45 divergent, moves every 2 steps of 512 sequences, at most 96
    # tokens. With the anchor (`--set kl_coef=0.04`) it met parity from 4 of 5 warm starts there and
    # from 3 of 3 in the protected R-KV 32 cell (≥ 40 % KV saved from 2 of them). Without the anchor, on
    # the sum scratchpad with the prompt protected at R-KV 56, it held 40-60 % of the sequences divergent
    # and fell below its warm start in 7 of 9 runs ("The sum scratchpad with the prompt protected, on a GPU").
    "gpu": LearningConfig(recipe=GPU_RECIPE, device="cuda", steps=150, groups=64, samples=8, lr=1e-4,
                          kv_control=KVControlSettings(target=0.45, min_sequences=1024, max_budget=96)),
    # The whole pipeline on a CPU in a minute or two: a 60-step warm start of the demo's shape, tiny batches.
    "smoke": LearningConfig(
        recipe=WarmstartRecipe(steps=60, sampled_target=None, eval_prompts=16, evict_share=0.0,
                               evict_from_sampled=None, evicted_check_kv=None, level_check=None),
        steps=3,
        groups=4,
        samples=4,
        lr=3e-5,
        kv_budgets=[16, 32],
        kv_buffer=8,
        calibration_prompts=32,
        eval_every=2,
        eval_prompts=32,
        eval_batch=32,
        threads=1,
    ),
}


# -- sampling and evaluation with the engine --


def sync_weights(learner: Learner, engine: LLMEngine) -> None:
    """Copy the learner's bf16-cast weights into the engine (what a published patch would do)."""
    live = engine.state_dict()
    for name, tensor in learner.published_state().items():
        live[name].copy_(tensor)


def eval_modes(budget: int, cfg: LearningConfig) -> dict[str, KVConfig]:
    sparse = {"policy": "rkv", "buffer": cfg.kv_buffer, "keep_prompt": cfg.keep_prompt}
    half = max(8, budget // 2)
    return {"dense": KVConfig(policy="dense"), "sparse": KVConfig(budget=budget, **sparse),
            "sparse_half": KVConfig(budget=half, **sparse)}


def rollout(engine: LLMEngine, tokenizer: PreTrainedTokenizerBase, task: Task, pairs: list[tuple[str, str]],
            cfg: LearningConfig, kv: KVConfig, seed: int, step: int) -> list[Trajectory]:
    sampling = sampling_info(kv, cfg.temperature)
    results = generate(engine, tokenizer, task, [p for p, _ in pairs], cfg.samples, kv, cfg.temperature, seed,
                       batch=len(pairs) * cfg.samples)
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    return [
        Trajectory(
            group_id=f"s{step}-{i}",
            attempt=1,
            policy_version=step,
            worker_id="bench",
            task=task.name,
            prompt=prompt,
            samples=score_samples(task, answer, prompt_ids, outputs, decode),
            sampling=sampling,
        )
        for i, ((prompt_ids, outputs), (prompt, answer)) in enumerate(zip(results, pairs, strict=True))
    ]


# -- one arm, in its own process --


def run_arm(cfg: LearningConfig, arm: str, seed: int, model_dir: Path, budget: int, out: Path) -> None:
    torch.set_num_threads(cfg.threads)
    base, arm_kl = parse_arm(arm)
    policy, loss = ARMS[base]
    kv_control = KVControlSettings()  # fixed: the arm's budget stays as given
    if base in CONTROLLED:
        kv_control = KVControlSettings.model_validate(cfg.kv_control.model_dump() | {
            "mode": "adaptive", "start_budget": cfg.kv_control.start_budget or budget})
    settings = TrainerSettings(
        model=str(model_dir), device=cfg.device, seed=seed,
        optim=OptimSettings(lr=cfg.lr, weight_decay=cfg.weight_decay),
        ppo_updates=cfg.ppo_updates, micro_batch=cfg.micro_batch,
        sampling=SamplingSettings(temperature=cfg.temperature),
        loss=loss.model_copy(update={"kl_coef": cfg.kl_coef if arm_kl is None else arm_kl}),
        kv_control=kv_control,
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    learner = Learner(LearnerConfig.of(settings), model_dir, tokenizer.pad_token_id)
    engine = LLMEngine.from_pretrained(model_dir, device=cfg.device, dtype=torch.bfloat16)
    sync_weights(learner, engine)
    task = cfg.task()
    modes = eval_modes(budget, cfg)
    train_kv = KVConfig(policy="dense") if policy == "dense" else modes["sparse"]
    held_out = task.make_prompts(cfg.eval_prompts, seed=EVAL_SEED)
    controller = KVBudgetController(kv_control) if base in CONTROLLED else None
    signal = signal_key(kv_control.metric, learner.config.dense_mismatch)
    started = time.perf_counter()
    with out.open("w") as f:
        def emit(row: dict[str, Any]) -> None:
            f.write(json.dumps(row) + "\n")
            f.flush()

        emit({"type": "start", "arm": arm, "seed": seed, "budget": budget, "kv": train_kv.model_dump()})
        for step in range(cfg.steps + 1):
            if step % cfg.eval_every == 0 or step == cfg.steps:
                t0 = time.perf_counter()
                emit(
                    {
                        "type": "eval",
                        "step": step,
                        "modes": {
                            f"{name}_{label}": evaluate(
                                engine, tokenizer, task, held_out, kv, temperature, cfg.eval_batch, EVAL_SEED
                            )
                            for name, kv in modes.items()
                            for label, temperature in (("greedy", 0.0), ("t1", 1.0))
                        },
                        "seconds": time.perf_counter() - t0,
                    }
                )
            if step == cfg.steps:
                break
            t0 = time.perf_counter()
            pairs = task.make_prompts(cfg.groups, seed=seed * TRAIN_SEED_STRIDE + step)
            # Under eviction replay the sampler records what its cache hid (Sample.evicted_at), as the
            # demo's workers do, and the learner builds its masks from that record instead of replaying
            # each sample (the same masks, tested; replaying, six arm processes on an H100 reached
            # step 45 in the time a dense arm took to reach 100).
            engine.record_evictions = loss.recompute == "replayed"
            try:
                trajectories = rollout(
                    engine, tokenizer, task, pairs, cfg, train_kv, seed * TRAIN_SEED_STRIDE + step, step
                )
            finally:
                engine.record_evictions = False
            t_gen = time.perf_counter() - t0
            metrics = learner.train_step(trajectories, version=step)
            sync_weights(learner, engine)
            control: dict[str, Any] = {
                "rollout_kv_budget": train_kv.sparse_budget}
            if controller is not None:  # the next step's budget, as a published version carries it
                cells = evidence_from_step(trajectories, metrics, step, signal)
                control |= controller.update(cells, next_version=step + 1)
                train_kv = train_kv.model_copy(update={"budget": control["kv_budget"]})
            emit({"type": "step", **metrics, **control, "generate_seconds": t_gen,
                  "seconds": time.perf_counter() - t0, "elapsed": time.perf_counter() - started})


# -- calibration, orchestration, criteria --


def calibrate_budget(cfg: LearningConfig, model_dir: Path) -> tuple[int, list[dict[str, float]]]:
    """The tightest of `kv_budgets` that keeps `min_kv_ratio` of the dense T = 1 accuracy (all tried)."""
    engine = LLMEngine.from_pretrained(model_dir, device=cfg.device, dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    kv = eval_modes(cfg.kv_budgets[0], cfg)["sparse"]
    result = calibrate(engine, tokenizer, cfg.task(), kv, cfg.kv_budgets, cfg.min_kv_ratio,
                       cfg.calibration_prompts, batch=cfg.eval_batch, stop_at_first=False)
    rows = [{"budget": 0, "policy": "dense", **result.dense}] + [{"policy": "rkv", **r} for r in result.rows]
    return result.budget, rows


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def common_last_eval(arms: dict[str, list[list[dict[str, Any]]]]) -> int:
    """The last evaluation step that every run of every arm reached: where arms can be compared when
    a deadline stopped some of them at different steps."""
    return min(max(r["step"] for r in rows if r["type"] == "eval") for runs in arms.values() for rows in runs)


def summarise(arms: dict[str, list[list[dict[str, Any]]]], at_step: int | None = None) -> dict[str, Any]:
    """Per arm: held-out curves (mean over seeds), final figures and per-step means, from each run's
    evaluations and steps up to `at_step` (default: all of them; `final` is the last evaluation, the
    thirds of the per-step means are each run's own)."""
    summary: dict[str, Any] = {}
    for arm, runs in arms.items():
        if at_step is not None:  # a run that went on past the common step is read to it
            runs = [[r for r in rows if r.get("step", 0) <= at_step] for rows in runs]
        evals = [[r for r in rows if r["type"] == "eval"] for rows in runs]
        steps = [[r for r in rows if r["type"] == "step"] for rows in runs]
        at = sorted({e["step"] for run in evals for e in run})
        curve = {
            mode: [
                _mean(
                    [
                        next(e["modes"][mode]["accuracy"] for e in run if e["step"] == s)
                        for run in evals
                        if any(e["step"] == s for e in run)
                    ]
                )
                for s in at
            ]
            for mode in evals[0][0]["modes"]
        }
        final = {mode: [run[-1]["modes"][mode]["accuracy"] for run in evals] for mode in evals[0][0]["modes"]}
        thirds = [max(1, len(run) // 3) for run in steps]
        per_step = {
            key: {
                "first_third": _mean([r[key] for run, n in zip(steps, thirds, strict=True) for r in run[:n]]),
                "last_third": _mean([r[key] for run, n in zip(steps, thirds, strict=True) for r in run[-n:]]),
            }
            for key in (
                "reward_mean",
                "accuracy",
                "completion_tokens_mean",
                "entropy",
                "rejection_rate",
                "token_mask_rate",
                "kl_old_sampler",
                "clip_fraction",
                "kv_saved",
                "xi_p01",
                "xi_p99",
            )
        }
        # The worst held-out dense T = 1 accuracy at any evaluation, against the run's own start.
        worst = [min(e["modes"]["dense_t1"]["accuracy"] for e in run)
                 - run[0]["modes"]["dense_t1"]["accuracy"] for run in evals]
        summary[arm] = {
            "worst_vs_start": _mean(worst),
            "worst_vs_start_per_seed": worst,
            "eval_steps": at,
            "curve": curve,
            "final": final,
            "final_mean": {m: _mean(v) for m, v in final.items()},
            "start_mean": {m: _mean([run[0]["modes"][m]["accuracy"] for run in evals]) for m in final},
            "per_step": per_step,
            "step_seconds": _mean([r["seconds"] for run in steps for r in run]),
        }
    return summary


def criteria(summary: dict[str, Any], cut_at: int | None = None) -> dict[str, Any]:
    """The claims judged on the summary. `cut_at`: the runs' last common evaluation when a deadline
    stopped them before their last step; claims about the end of training ((a)-(d)) are then not
    judged (`met` None), and (e), about every evaluation, only through that step."""
    if "dense" not in summary:
        return {}
    out = criteria_at_end(summary)
    if cut_at is not None:
        for key, claim in out.items():
            if key[0] == "e":
                claim["through_step"] = cut_at
            else:
                claim["met"] = None
                claim["not_judged"] = f"runs stopped before their last step; figures at step {cut_at}"
    return out


def criteria_at_end(summary: dict[str, Any]) -> dict[str, Any]:
    """(a)-(e) judged on the summary's final figures, as if the runs had ended there."""
    out: dict[str, Any] = {}
    d = summary["dense"]
    dense_final, dense_start = d["final_mean"]["dense_t1"], d["start_mean"]["dense_t1"]
    out["a"] = {
        "claim": CRITERIA["a"],
        "gain": dense_final - dense_start,
        "met": dense_final - dense_start >= 0.15,
    }
    if "naive" in summary:
        n = summary["naive"]
        gap = dense_final - n["final_mean"]["dense_t1"]
        degrades = n["final_mean"]["dense_t1"] < n["start_mean"]["dense_t1"]
        mismatch = n["per_step"]["kl_old_sampler"]
        grows = mismatch["last_third"] > mismatch["first_third"]
        out["b"] = {
            "claim": CRITERIA["b"],
            "gap_to_dense": gap,
            "degrades": degrades,
            "mismatch_grows": grows,
            "met": gap >= 0.10 or (degrades and grows),
        }
    def ratio(arm: dict[str, Any]) -> float:
        dense_acc = arm["final_mean"]["dense_t1"]
        return arm["final_mean"]["sparse_t1"] / dense_acc if dense_acc else 0.0

    # (c), (d) and the floor (e) for every corrected arm; the keys without a suffix are sparse_rl's.
    for name, s in summary.items():
        if name in ("dense", "naive"):
            continue
        suffix = "" if name == "sparse_rl" else f"_{name}"
        gap = dense_final - s["final_mean"]["dense_t1"]
        out["c" + suffix] = {"claim": CRITERIA["c"], "gap_to_dense": gap, "met": gap <= 0.03}
        out["d" + suffix] = {"claim": CRITERIA["d"], "sparse_rl_ratio": ratio(s),
                             "dense_trained_ratio": ratio(d), "met": ratio(s) - ratio(d) >= 0.05}
        out["e" + suffix] = {"claim": CRITERIA["e"], "worst_vs_start": s["worst_vs_start"],
                             "per_seed": s["worst_vs_start_per_seed"], "met": s["worst_vs_start"] >= -0.02}
    return out


def judge(runs: dict[str, list[dict[str, Any]]], arms: list[str], seeds: list[int],
          steps: int) -> dict[str, Any]:
    """Summary and criteria of the runs (`ARM-SEED` -> rows) that logged an evaluation, at the last
    evaluation all of them reached (the last step unless a deadline stopped some earlier)."""
    logged = {arm: [runs[f"{arm}-{s}"] for s in seeds
                    if any(r["type"] == "eval" for r in runs.get(f"{arm}-{s}", []))] for arm in arms}
    logged = {arm: rows for arm, rows in logged.items() if rows}
    judged_at = common_last_eval(logged) if logged else 0
    summary = summarise(logged, at_step=judged_at)
    return {"judged_at_step": judged_at,
            "criteria": criteria(summary, cut_at=judged_at if judged_at < steps else None),
            "summary": summary}


def rejudge(path: Path) -> dict[str, Any]:
    """A result file's summary and criteria recomputed from its logged runs, written back."""
    result = json.loads(path.read_text())
    judged = judge(result["runs"], result["arms"], result["seeds"], result["config"]["steps"])
    ordered: dict[str, Any] = {}
    for key, value in result.items():  # the file's key order, judged_at_step beside the criteria
        if key == "criteria":
            ordered["judged_at_step"] = judged["judged_at_step"]
        ordered[key] = judged.get(key, value)
    result = ordered | judged
    path.write_text(json.dumps(result, indent=1) + "\n")
    return result


def read_rows(path: Path) -> list[dict[str, Any]]:
    """An arm's JSON lines; a last line cut by a kill is dropped."""
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return rows


def warm_start(cache: Path, recipe: WarmstartRecipe) -> tuple[Path, dict[str, Any]]:
    """The recipe's warm start, built into `cache` unless it is there, and its build report."""
    model_dir = ensure_warmstart_model(cache, recipe)
    return model_dir, json.loads((model_dir / REPORT_FILE).read_text())


def run(cfg: LearningConfig, arms: list[str], seeds: list[int], cache: Path, out: Path, parallel: int,
        preset: str, deadline: float | None = None) -> dict[str, Any]:
    """`deadline`: seconds after the start at which arms still running are stopped and the result is
    written from what they logged so far (`complete` false, `stopped` names them and their last step)."""
    started = time.perf_counter()
    device = torch.device(cfg.device)
    model_dir, warm = warm_start(cache, cfg.recipe)
    print(f"warm start {model_dir.name}: {warm['steps_done']} SFT steps, eval {warm['eval']}", flush=True)
    if cfg.kv_budget is None:
        budget, calibration = calibrate_budget(cfg, model_dir)
    else:
        budget, calibration = cfg.kv_budget, []
    print(f"KV budget {budget} (calibration {calibration})", flush=True)
    work = out.with_suffix(".runs")
    work.mkdir(parents=True, exist_ok=True)
    jobs = [(arm, seed) for arm in arms for seed in seeds]
    pending, running, done = list(jobs), {}, {}
    config_json = cfg.model_dump_json()
    # Several GPUs: the arm processes take them in turn.
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    started_jobs = 0
    stopped: dict[str, int | None] = {}
    while pending or running:
        if deadline is not None and time.perf_counter() - started > deadline:
            for key, (proc, path, log) in running.items():
                proc.kill()
                proc.wait()
                log.close()
                done[key] = read_rows(path)
                steps = [r["step"] for r in done[key] if r["type"] == "step"]
                stopped[f"{key[0]}-{key[1]}"] = steps[-1] if steps else None
            stopped |= {f"{arm}-{seed}": None for arm, seed in pending}
            print(f"deadline {deadline:.0f}s: stopped {stopped}", flush=True)
            running, pending = {}, []
            break
        while pending and len(running) < parallel:
            arm, seed = pending.pop(0)
            path = work / f"{arm}-{seed}.jsonl"
            log = (work / f"{arm}-{seed}.log").open("w")
            cmd = [
                sys.executable,
                "-m",
                "bench.learning",
                "arm",
                "--config",
                config_json,
                "--arm",
                arm,
                "--seed",
                str(seed),
                "--model",
                str(model_dir),
                "--budget",
                str(budget),
                "--out",
                str(path),
            ]
            env = dict(os.environ)
            if gpus > 1:
                env["CUDA_VISIBLE_DEVICES"] = str(started_jobs % gpus)
            started_jobs += 1
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            running[(arm, seed)] = (proc, path, log)
        time.sleep(2)
        for key, (proc, path, log) in list(running.items()):
            if proc.poll() is None:
                continue
            log.close()
            if proc.returncode != 0:
                raise RuntimeError(f"arm {key} failed (exit {proc.returncode}); see {log.name}")
            done[key] = read_rows(path)
            del running[key]
            print(f"arm {key[0]} seed {key[1]} done at {time.perf_counter() - started:.0f}s", flush=True)
    runs = {f"{arm}-{seed}": done[(arm, seed)] for arm, seed in jobs if (arm, seed) in done}
    judged = judge(runs, arms, seeds, cfg.steps)
    result = {
        "bench": "learning",
        "preset": preset,
        "complete": not stopped,
        "stopped": stopped,
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "config": cfg.model_dump(),
        "arms": arms,
        "seeds": seeds,
        "warmstart": {
            "dir": model_dir.name,
            **{k: warm[k] for k in ("steps_done", "train_seconds", "eval", "sampled_checks", "final_loss")},
        },
        "kv_budget": budget,
        "calibration": calibration,
        **judged,
        "runs": runs,
        "wall_seconds": time.perf_counter() - started,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    return result


def plot(path: Path) -> Path:
    """Curves of one result file as a PNG beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = json.loads(path.read_text())
    summary = result["summary"]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    panels = [("dense_t1", "held-out accuracy, dense inference, T=1"),
              ("sparse_t1", f"held-out accuracy, R-KV {result['kv_budget']}, T=1"),
              ("dense_greedy", "held-out accuracy, dense inference, greedy")]
    for ax, (mode, title) in zip(axes[0], panels, strict=True):
        for arm, s in summary.items():
            ax.plot(s["eval_steps"], s["curve"][mode], marker="o", label=arm)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.legend()
    for ax, (key, title) in zip(axes[1], [("reward_mean", "training reward"), ("kl_old_sampler",
                                          "KL(π_old_dense ‖ π_sampler) per token"),
                                         ("rejection_rate", "sequence veto rate")], strict=True):
        for arm in summary:
            for i, seed in enumerate(result["seeds"]):
                rows = [r for r in result["runs"].get(f"{arm}-{seed}", []) if r["type"] == "step"]
                ax.plot(
                    [r["step"] for r in rows],
                    [r[key] for r in rows],
                    color=f"C{list(summary).index(arm)}",
                    alpha=0.6,
                    label=arm if i == 0 else None,
                )
        ax.set_title(title)
        ax.set_xlabel("step")
        if key == "kl_old_sampler":
            ax.set_yscale("symlog", linthresh=0.01)  # a few steps spike to > 1; most sit near 0.01-0.1
        ax.legend()
    fig.suptitle(f"bench.learning ({result['preset']}, {result['device']}): {', '.join(result['arms'])} × "
                 f"seeds {result['seeds']}")
    fig.tight_layout()
    png = path.with_suffix(".png")
    fig.savefig(png, dpi=90)
    return png


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model a field holds (`X` or `X | None`), or None for a free-form value."""
    for candidate in (annotation, *get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def configure(fields: dict[str, Any], overrides: list[str]) -> LearningConfig:
    """The preset's fields with each `KEY=VALUE` override applied; a dotted key sets a nested field
    (`recipe.evict_share=0.5`: the warm-start recipe's), and the result is validated once. VALUE is
    JSON, or else taken as a bare string (`kv_control.metric=kl_old_sampler`). A malformed override,
    a dotted key through a field that holds no fields, or a value that does not validate raises
    ValueError naming it."""
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE")
        *parents, leaf = key.split(".")
        target, model = fields, LearningConfig
        for depth, name in enumerate([*parents, leaf]):
            # pydantic ignores an unknown field, so a misspelt key would be dropped without a word
            if model is not None and name not in model.model_fields:
                where = ".".join(parents[:depth]) or "the config"
                raise ValueError(f"--set {key}: {where} has no field {name!r} "
                                 f"(fields: {', '.join(model.model_fields)})")
            if depth == len(parents):
                break
            model = _model_of(model.model_fields[name].annotation) if model is not None else None
            target = target.get(name)
            if not isinstance(target, dict):
                raise ValueError(f"--set {key}: {'.'.join(parents[:depth + 1])} holds no fields")
        try:
            target[leaf] = json.loads(value)
        except json.JSONDecodeError:
            target[leaf] = value  # a bare word; the model's validation decides whether it fits
    return LearningConfig.model_validate(fields)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["arm"]:
        p = argparse.ArgumentParser()
        p.add_argument("--config", required=True)
        p.add_argument("--arm", required=True, help="a name of ARMS, optionally ARM@kl=COEF")
        p.add_argument("--seed", type=int, required=True)
        p.add_argument("--model", type=Path, required=True)
        p.add_argument("--budget", type=int, required=True)
        p.add_argument("--out", type=Path, required=True)
        a = p.parse_args(argv[1:])
        try:
            parse_arm(a.arm)
        except ValueError as e:
            p.error(str(e))
        run_arm(LearningConfig.model_validate_json(a.config), a.arm, a.seed, a.model, a.budget, a.out)
        return
    if argv[:1] == ["plot"]:
        print(plot(Path(argv[1])))
        return
    if argv[:1] == ["judge"]:  # a stored result's summary and criteria recomputed by this code
        print(json.dumps(rejudge(Path(argv[1]))["criteria"], indent=1))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="gpu")
    p.add_argument("--device", help="override the preset's device")
    p.add_argument("--arms", default="dense,naive,sparse_rl",
                   help="comma-separated names of ARMS, each optionally ARM@kl=COEF (its own KL anchor)")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--parallel", type=int, default=0, help="arm processes at once (0 = all)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field (VALUE: JSON, or a bare string), e.g. --set lr=3e-4 "
                   "--set steps=100 --set recipe.evict_share=0.5 --set kv_control.metric=kl_old_sampler")
    p.add_argument("--cache", type=Path, default=Path(".cache/warmstart"))
    p.add_argument("--out", type=Path)
    p.add_argument("--deadline", type=float,
                   help="seconds: stop the arms still running and write the result from what they logged")
    p.add_argument("--build-only", action="store_true",
                   help="build (or find) the warm start in --cache, print where and how it ended, and stop")
    a = p.parse_args(argv)
    fields = PRESETS[a.preset].model_dump()
    if a.device:
        fields["device"] = a.device
    try:
        cfg = configure(fields, a.set)
    except ValueError as e:  # pydantic's ValidationError is one: a field's value that does not fit
        p.error(str(e))
    if a.build_only:
        model_dir, warm = warm_start(a.cache, cfg.recipe)
        print(json.dumps({"warmstart": str(model_dir), "steps_done": warm["steps_done"],
                          "train_seconds": warm.get("train_seconds"), "eval": warm["eval"]}, indent=1))
        return
    arms = a.arms.split(",")
    try:  # every name checked before the warm start is built, not in the arms' processes
        for arm in arms:
            parse_arm(arm)
    except ValueError as e:
        p.error(str(e))
    if len(set(arms)) < len(arms):
        p.error(f"an arm is named twice in --arms {a.arms}")
    try:
        seeds = [int(s) for s in a.seeds.split(",")]
    except ValueError:
        p.error(f"--seeds takes comma-separated integers, not {a.seeds!r}")
    if len(set(seeds)) < len(seeds):  # each (arm, seed) run has one log file
        p.error(f"a seed is named twice in --seeds {a.seeds}")
    out = a.out or RESULTS / f"learning-{a.preset}.json"
    result = run(cfg, arms, seeds, a.cache, out, a.parallel or len(arms) * len(seeds), a.preset, a.deadline)
    print(json.dumps({"criteria": result["criteria"], "kv_budget": result["kv_budget"],
                      "final": {arm: s["final_mean"] for arm, s in result["summary"].items()},
                      "start": {arm: s["start_mean"] for arm, s in result["summary"].items()},
                      "wall_seconds": result["wall_seconds"]}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
