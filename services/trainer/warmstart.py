"""Warm start: build the tiny demo model and teach it the built-in tasks by SFT, to partial accuracy.

RL on a randomly initialised model learns nothing in minutes: rewards are all zero, so every
GRPO group has zero variance. A short supervised pass on reference completions gets the model to
*partial* accuracy (short additions right, long ones often wrong), which leaves RL visible room.
Half of each batch is trained under the demo's KV cache (`evict_share`), so the model samples
about as well under that cache as with a dense one, on any CPU. A build that stops before it can
add some operand length at all is built again from the next seed (`LevelCheck`).

    python -m services.trainer.warmstart --out DIR [--steps N] [--seed S]
    python -m services.trainer.warmstart --ensure CACHE_DIR   # the cached default model (the demo's)

Deterministic: fixed seeds, fixed thread count, deterministic algorithms, fp32 training; the saved
bf16 weights are byte-identical across runs on the same machine and torch build. The result is
cached by `ensure_warmstart_model(cache_dir)`, keyed by a hash of the whole recipe.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from pydantic import ValidationError
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from services.trainer.evaluation import evaluate
from services.trainer.warmstart_recipe import (
    STAMP_FILE,
    WarmstartRecipe,
    arg_parser,
    cached_model_dir,
    is_current,
    recipe_from_args,
)
from shared.dtypes import compute_dtype
from shared.modeling import qwen3_config
from shared.tasks import Task, get_task
from shared.tokenizer import build_tokenizer

if TYPE_CHECKING:  # imported where used: dense SFT (the default) needs neither the engine nor the masks
    from services.rollout.engine import KVConfig
    from services.trainer.eviction_masks import EvictionMasks

REPORT_FILE = "warmstart.json"


def build_model_config(recipe: WarmstartRecipe, tokenizer: PreTrainedTokenizerFast) -> Qwen3Config:
    fields = qwen3_config(recipe.shape).to_dict()
    fields.pop("layer_types", None)  # derived from num_hidden_layers, which the overrides may change
    fields.update(recipe.model_overrides)
    fields.update(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        max_position_embeddings=512,
    )
    return Qwen3Config(**fields)


def _seed_everything(recipe: WarmstartRecipe) -> None:
    random.seed(recipe.seed)
    torch.manual_seed(recipe.seed)
    torch.set_num_threads(recipe.threads)
    # CUDA kernels (cuBLAS, index_add) are only deterministic with extra settings; the GPU recipes
    # are not promised to be byte-reproducible.
    torch.use_deterministic_algorithms(True, warn_only=recipe.device != "cpu")


def _sft_batch(examples: list[tuple[str, str]], tokenizer: PreTrainedTokenizerFast,
               local: list[bool] | None = None, window: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded BOS+prompt+completion+EOS; labels only on completion and EOS.

    Rows marked in `local` get a 4-D attention mask under which a completion token sees the prompt
    and only the last `window` completion tokens (itself included).
    """
    rows, labels, prompt_lengths = [], [], []
    for prompt, completion in examples:
        p = tokenizer(prompt)["input_ids"]  # starts with BOS
        c = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append(p + c)
        labels.append([-100] * len(p) + c)
        prompt_lengths.append(len(p))
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    label_ids = torch.tensor([lab + [-100] * (width - len(lab)) for lab in labels])
    attention: torch.Tensor = (input_ids != pad).long()
    if local is not None and any(local):
        qpos = torch.arange(width)[:, None]
        kpos = torch.arange(width)[None, :]
        prompt_end = torch.tensor(prompt_lengths)[:, None, None]
        span = torch.tensor([window if flag else width for flag in local])[:, None, None]
        allowed = ((kpos <= qpos) & (attention.bool()[:, None, :] | (kpos == qpos))
                   & ((kpos < prompt_end) | (kpos > qpos - span)))
        attention = allowed[:, None]  # [B, 1, T, T]
    return {"input_ids": input_ids, "attention_mask": attention, "labels": label_ids}


def _evicted_rows(evict: EvictionMasks, kv: KVConfig, model: Qwen3ForCausalLM, batch: dict[str, torch.Tensor],
                  examples: list[tuple[str, str]], chosen: list[int],
                  tokenizer: PreTrainedTokenizerFast) -> torch.Tensor:
    """Layer masks of the batch: the `chosen` rows under the engine's replayed eviction, the rest causal."""
    from services.trainer.eviction_masks import batch_masks

    prompts = [tokenizer(examples[i][0])["input_ids"] for i in chosen]
    completions = [tokenizer(examples[i][1], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                   for i in chosen]
    seen = evict(model.state_dict(), prompts, completions, kv).to(batch["input_ids"].device)
    config = model.config
    return batch_masks(batch["attention_mask"], config.num_hidden_layers, config.num_key_value_heads or 1,
                       dict(zip(chosen, seen, strict=True)))


def room_for_rl(levels: list[tuple[float, float]], floor: float) -> float:
    """Mean over levels of (dense − under the cache) sampled accuracy, counting a level only where
    the cache leaves it at least `floor`."""
    return sum(max(0.0, dense - cached) for dense, cached in levels if cached >= floor) / max(1, len(levels))


def _sample_examples(
    tasks: dict[str, Task], mix: dict[str, float], n: int, rng: random.Random,
    level_weights: dict[str, list[float]] | None = None,
) -> list[tuple[str, str, str, int]]:
    """`n` (prompt, reference completion, task name, level index); a task's level is drawn by
    `level_weights[task]` where given, else the task draws it (addition: a uniform length)."""
    names = sorted(mix)
    chosen = rng.choices(names, weights=[mix[k] for k in names], k=n)
    out = []
    for name in chosen:
        task, level = tasks[name], -1
        if level_weights is not None and name in level_weights:
            levels = task.levels()
            level = rng.choices(range(len(levels)), weights=level_weights[name])[0]
            task = levels[level]
        prompt, answer = task.make_prompts(1, rng.getrandbits(63))[0]
        out.append((prompt, task.demonstration(prompt, answer), name, level))
    return out


class LevelLoss:
    """Running per-token SFT loss of each level of each task, and the draw weights it gives."""

    def __init__(self, tasks: dict[str, Task], uniform_share: float, decay: float = 0.9) -> None:
        self.levels = {name: len(task.levels()) for name, task in tasks.items()}
        self.uniform_share, self.decay = uniform_share, decay
        self.loss: dict[str, list[float | None]] = {name: [None] * k for name, k in self.levels.items()}

    def update(self, names: list[str], levels: list[int], row_losses: list[float]) -> None:
        batch: dict[tuple[str, int], list[float]] = {}
        for name, level, loss in zip(names, levels, row_losses, strict=True):
            batch.setdefault((name, level), []).append(loss)
        for (name, level), values in batch.items():
            mean, old = sum(values) / len(values), self.loss[name][level]
            self.loss[name][level] = mean if old is None else self.decay * old + (1 - self.decay) * mean

    def weights(self) -> dict[str, list[float]]:
        out = {}
        for name, k in self.levels.items():
            seen = [v for v in self.loss[name] if v is not None]
            total = sum(seen)
            if len(seen) < k or total <= 0:
                out[name] = [1.0 / k] * k  # every level once before any is favoured
                continue
            out[name] = [self.uniform_share / k + (1 - self.uniform_share) * v / total for v in seen]
        return out


# SFT steps the warm starts of this process have taken. The trainer's liveness counts them as
# progress, so a warm start longer than SPARSECAST_STALL_S is not taken for a stuck loop.
_steps_trained = 0


def steps_trained() -> int:
    return _steps_trained


def train_warmstart(recipe: WarmstartRecipe, out_dir: str | Path, *, log_every: int = 50) -> dict:
    """Train from scratch and write a HF model dir (bf16) to `out_dir`; returns the report."""
    started = time.perf_counter()
    _seed_everything(recipe)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    config = build_model_config(recipe, tokenizer)
    device = torch.device(recipe.device)
    model = Qwen3ForCausalLM(config).float().to(device)
    tasks = {name: get_task(name, **recipe.task_options.get(name, {})) for name in recipe.task_mix}
    first_task = tasks[sorted(recipe.task_mix)[0]]
    rng = random.Random(recipe.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, betas=(0.9, 0.98),
                                  weight_decay=recipe.weight_decay)

    def lr_at(step: int) -> float:
        if step < recipe.warmup_steps:
            return recipe.lr * (step + 1) / recipe.warmup_steps
        progress = (step - recipe.warmup_steps) / max(1, recipe.steps - recipe.warmup_steps)
        return recipe.lr * (
            recipe.min_lr_ratio + (1 - recipe.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        )

    evict = None
    if recipe.evict_share:
        from services.rollout.engine import KVConfig
        from services.rollout.engine.evaluation import evaluate as evaluate_on_engine
        from services.trainer.eviction_masks import LAYER_MASKED, EvictionMasks

        evict, evict_kv = EvictionMasks(config, device), KVConfig.model_validate(recipe.evict_kv)
        check_kv = KVConfig.model_validate(recipe.evicted_check_kv or recipe.evict_kv)
        model.set_attn_implementation(LAYER_MASKED)
    # With `evict_from_sampled`: the step whose check started the eviction-aware SFT.
    evict_from: int | None = None
    best_room: tuple[float, int, dict[str, torch.Tensor]] | None = None
    level_loss = LevelLoss(tasks, recipe.level_uniform_share) if recipe.level_sampling == "loss" else None
    model.train()
    losses: list[float] = []
    checks: list[dict[str, Any]] = []
    steps_done = 0
    for step in range(recipe.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        drawn = _sample_examples(tasks, recipe.task_mix, recipe.batch_size, rng,
                                 level_loss.weights() if level_loss is not None else None)
        examples = [(prompt, completion) for prompt, completion, _, _ in drawn]
        local = [rng.random() < recipe.local_attention for _ in examples] if recipe.local_attention else None
        batch = _sft_batch(examples, tokenizer, local, recipe.local_window)
        batch = {k: v.to(device) for k, v in batch.items()}
        labels = batch.pop("labels")
        evicting = recipe.evict_from_sampled is None or evict_from is not None
        if evict is not None and evicting and step % recipe.evict_every == 0:
            share = min(1.0, recipe.evict_share * recipe.evict_every)
            chosen = [i for i in range(len(examples)) if rng.random() < share]
            if chosen:
                batch["layer_masks"] = _evicted_rows(evict, evict_kv, model, batch, examples, chosen,
                                                     tokenizer)
        logits = model(**batch).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            labels[:, 1:].reshape(-1),
            ignore_index=-100,
            label_smoothing=recipe.label_smoothing,
        )
        loss.backward()
        if level_loss is not None:
            with torch.no_grad():
                token_loss = torch.nn.functional.cross_entropy(
                    logits.transpose(1, 2), labels[:, 1:], ignore_index=-100, reduction="none")
                counted = (labels[:, 1:] != -100).sum(dim=1).clamp(min=1)
                row_losses = (token_loss.sum(dim=1) / counted).tolist()
            level_loss.update([name for _, _, name, _ in drawn], [level for *_, level in drawn], row_losses)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        steps_done = step + 1
        global _steps_trained
        _steps_trained += 1
        if log_every and (step + 1) % log_every == 0:
            print(f"warmstart step {step + 1}/{recipe.steps} loss {sum(losses[-log_every:]) / log_every:.4f} "
                  f"{time.perf_counter() - started:.0f}s cpu {time.process_time():.0f}s", flush=True)
        if (recipe.sampled_target is not None and step + 1 >= recipe.check_from
                and (step + 1) % recipe.check_every == 0):
            # A fixed seed per check (not the data stream's), so checking never changes the training data.
            # Fixed prompts and sampling seeds per check, apart from the data stream's.
            sampled = evaluate(
                model,
                tokenizer,
                first_task,
                first_task.make_prompts(recipe.eval_prompts, 7_000_001 + step),
                sample=True,
                seed=step,
            )
            checks.append({"step": step + 1, "sampled_accuracy": sampled["accuracy"]}
                          | ({"level_weights": level_loss.weights()} if level_loss is not None else {}))
            print(f"warmstart step {step + 1} sampled accuracy {sampled['accuracy']:.3f}", flush=True)
            if (evict is not None and recipe.evict_from_sampled is not None and evict_from is None
                    and sampled["accuracy"] >= recipe.evict_from_sampled):
                evict_from = step + 1
                checks[-1]["eviction_aware_from"] = evict_from
            if sampled["accuracy"] < recipe.sampled_target:
                continue
            if evict is None or (recipe.evicted_target is None and recipe.room_target is None):
                break
            if recipe.room_target is not None:
                engine = evict.load(model.state_dict())
                per_level = []
                for i, level in enumerate(first_task.levels()):
                    pairs = level.make_prompts(recipe.room_prompts, 7_700_001 + 16 * step + i)
                    per_level.append((
                        evaluate(model, tokenizer, level, pairs, sample=True, seed=step)["accuracy"],
                        evaluate_on_engine(engine, tokenizer, level, pairs, evict_kv, temperature=1.0,
                                           batch=len(pairs), seed=step)["accuracy"]))
                room = room_for_rl(per_level, recipe.room_floor)
                checks[-1] |= {"levels_sampled": [d for d, _ in per_level],
                               "levels_evicted_sampled": [c for _, c in per_level], "room": room}
                print(f"warmstart step {step + 1} per level dense / under the cache "
                      f"{' '.join(f'{d:.2f}/{c:.2f}' for d, c in per_level)}: room {room:.3f}", flush=True)
                if best_room is None or room > best_room[0]:
                    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
                    best_room = (room, step + 1, weights)
                if room >= recipe.room_target:
                    best_room = None  # stopped on the target: these weights
                    break
                continue
            assert recipe.evicted_target is not None
            evicted = evaluate_on_engine(
                evict.load(model.state_dict()), tokenizer, first_task,
                first_task.make_prompts(recipe.evicted_check_prompts, 7_500_001 + step), check_kv,
                temperature=1.0, batch=recipe.evicted_check_prompts, seed=step)["accuracy"]
            checks[-1]["evicted_sampled_accuracy"] = evicted
            print(f"warmstart step {step + 1} sampled accuracy under the cache {evicted:.3f}", flush=True)
            if evicted >= recipe.evicted_target:
                break
            if recipe.sampled_ceiling is not None and sampled["accuracy"] >= recipe.sampled_ceiling:
                checks[-1]["stopped_at_ceiling"] = True
                print(f"warmstart step {step + 1}: stopped at the dense ceiling {recipe.sampled_ceiling}",
                      flush=True)
                break
    restored_step = None
    if best_room is not None and recipe.room_target is not None:  # the bound came first
        restored_step = best_room[1]
        model.load_state_dict(best_room[2])
        print(f"warmstart: room target not reached; kept step {restored_step} (room {best_room[0]:.3f})",
              flush=True)
    train_s = time.perf_counter() - started

    if evict is not None:
        model.set_attn_implementation("sdpa")  # what the saved config names
    # The saved weights are bf16; scored in fp32 where this CPU only emulates bf16 (exact both ways).
    model = model.to(torch.bfloat16).to(compute_dtype(device, torch.bfloat16))
    metrics = {}
    if recipe.eval_prompts:
        held_out = {
            name: tasks[name].make_prompts(recipe.eval_prompts, recipe.seed + 1_000_003) for name in tasks
        }
        metrics = {name: evaluate(model, tokenizer, tasks[name], held_out[name], sample=False)
                   | {"sampled": evaluate(model, tokenizer, tasks[name], held_out[name], sample=True)}
                   for name in sorted(tasks)}
        if evict is not None:  # the first task under the check's cache (`evicted_check_kv`)
            name = sorted(tasks)[0]
            metrics[name]["evicted_sampled"] = evaluate_on_engine(
                evict.load(model.state_dict()), tokenizer, tasks[name], held_out[name], check_kv,
                temperature=1.0, batch=recipe.eval_prompts, seed=0)
    model = model.to(torch.bfloat16).cpu()
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
    )
    model.config.dtype = torch.bfloat16
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    report = {
        "recipe": recipe.model_dump(), "recipe_hash": recipe.fingerprint(),
        "final_loss": sum(losses[-20:]) / max(1, len(losses[-20:])),
        "train_seconds": round(train_s, 1), "total_seconds": round(time.perf_counter() - started, 1),
        "threads": recipe.threads, "steps_done": steps_done, "sampled_checks": checks, "eval": metrics,
        "kept_step": restored_step or steps_done, "eviction_aware_from": evict_from,
    }
    (out_dir / REPORT_FILE).write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    (out_dir / STAMP_FILE).write_text(recipe.fingerprint() + "\n")
    return report


# Prompts of the level check, apart from the stop's checks (7_000_001 + step and up) and the
# held-out sets.
LEVEL_CHECK_SEED = 7_900_001


def _level_tasks(recipe: WarmstartRecipe) -> list[Task]:
    name = sorted(recipe.task_mix)[0]
    return get_task(name, **recipe.task_options.get(name, {})).levels()


def _level_example(recipe: WarmstartRecipe, level: int) -> str:
    """The first prompt the level check asks of `level` (what a user reads for "level 3")."""
    return _level_tasks(recipe)[level].make_prompts(1, LEVEL_CHECK_SEED + level)[0][0].strip()


def level_sampled_accuracy(model_dir: Path, recipe: WarmstartRecipe) -> list[float]:
    """Dense sampled (T = 1) accuracy of the saved model on each level of the recipe's first task,
    `level_check.prompts` fresh prompts a level (the same prompts for every seed)."""
    assert recipe.level_check is not None
    device = torch.device(recipe.device)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    # The saved bf16 weights, cast to fp32 where this CPU only emulates bf16, as the held-out evaluation
    # does (this load is the one the measured builds used; loaded as fp32 directly, the same weights
    # sampled a few prompts differently).
    model = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    model = model.to(compute_dtype(device, torch.bfloat16)).to(device)  # type: ignore[arg-type]  # stubs
    prompts = recipe.level_check.prompts
    return [evaluate(model, tokenizer, level, level.make_prompts(prompts, LEVEL_CHECK_SEED + i),
                     sample=True)["accuracy"] for i, level in enumerate(_level_tasks(recipe))]


def build_warmstart(recipe: WarmstartRecipe, out_dir: str | Path, *, log_every: int = 50) -> dict:
    """`train_warmstart`, then the recipe's level check: a build with a level sampled right less
    often than `level_check.min_sampled` is built again from the next seed, up to `rebuilds` times;
    the first that passes is kept, else the one whose weakest level is highest. The dir is stamped
    with `recipe`'s hash whichever seed trained it, and its report lists every build."""
    out_dir = Path(out_dir)
    check = recipe.level_check
    if check is None:
        return train_warmstart(recipe, out_dir, log_every=log_every)
    out_dir.mkdir(parents=True, exist_ok=True)
    builds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix=".warmstart-builds-", dir=out_dir.parent) as scratch:
        best: tuple[float, int, Path, dict] | None = None  # weakest level, seed, dir, report
        last = recipe.seed + check.rebuilds
        for seed in range(recipe.seed, last + 1):
            seeded = recipe.model_copy(update={"seed": seed})
            where = Path(scratch) / f"seed-{seed}"
            report = train_warmstart(seeded, where, log_every=log_every)
            levels = level_sampled_accuracy(where, seeded)
            lowest = min(levels)
            builds.append({"seed": seed, "levels_sampled": levels, "kept_step": report["kept_step"],
                           "train_seconds": report["train_seconds"]})
            print(f"warmstart: seed {seed} samples its levels right "
                  f"{' / '.join(f'{a:.0%}' for a in levels)} of the time", flush=True)
            if best is None or lowest > best[0]:
                best = (lowest, seed, where, report)
            if lowest >= check.min_sampled:
                break
            # The demo's launcher shows the lines that start with NOTE.
            weak = levels.index(lowest)
            print(f"NOTE seed {seed}'s build samples prompts like {_level_example(recipe, weak)!r} right "
                  f"{lowest:.0%} of the time, under {check.min_sampled:.0%}: "
                  + (f"building again from seed {seed + 1}" if seed < last else "no more builds"), flush=True)
        assert best is not None
        weakest, kept_seed, kept, report = best
        if weakest < check.min_sampled:
            print(f"NOTE no build of seeds {recipe.seed}-{last} passed: keeping seed {kept_seed}'s, whose "
                  f"weakest level is sampled right {weakest:.0%} of the time", flush=True)
        for item in kept.iterdir():
            target = out_dir / item.name
            if target.is_dir():
                shutil.rmtree(target)
            shutil.move(str(item), target)
    report |= {"recipe": recipe.model_dump(), "recipe_hash": recipe.fingerprint(), "builds": builds,
               "seed_built": kept_seed, "level_check_passed": weakest >= check.min_sampled}
    (out_dir / REPORT_FILE).write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    (out_dir / STAMP_FILE).write_text(recipe.fingerprint() + "\n")
    return report


def ensure_warmstart_model(cache_dir: str | Path, recipe: WarmstartRecipe | None = None) -> Path:
    """The warm-started model dir under `cache_dir`, trained only if no current one is cached.

    Concurrent callers may both train; each writes a private temp dir and renames it into place, so
    readers only ever see a complete directory.
    """
    recipe = recipe or WarmstartRecipe()
    cache_dir = Path(cache_dir)
    target = cached_model_dir(cache_dir, recipe)
    if is_current(target, recipe):
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".warmstart-", dir=cache_dir))
    try:
        build_warmstart(recipe, tmp)
        if target.exists() and not is_current(target, recipe):
            shutil.rmtree(target)  # a partial or stale dir under the current name
        try:
            os.rename(tmp, target)
        except OSError:
            if not is_current(target, recipe):  # lost a race to a writer that left garbage
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def main(argv: list[str] | None = None) -> None:
    parser = arg_parser(description=__doc__.split("\n")[0])
    args = parser.parse_args(argv)
    try:
        recipe = recipe_from_args(args)
    except ValidationError as exc:  # e.g. --check-every 0: a usage error, not a traceback
        parser.error(f"the recipe refuses this command line: {exc}")
    if args.ensure:
        cache = Path(args.ensure)
        if not is_current(cached_model_dir(cache, recipe), recipe):
            print("TRAINING", recipe.steps, flush=True)
        print("MODEL", ensure_warmstart_model(cache, recipe), flush=True)
        return
    report = build_warmstart(recipe, args.out, log_every=args.log_every)
    print(json.dumps({k: report[k] for k in ("final_loss", "train_seconds", "total_seconds", "eval", "builds")
                      if k in report}, indent=2))


if __name__ == "__main__":
    main()
