"""Proof that the RL signal exists: a few GRPO steps on the warm-started model raise task reward.

    python -m services.trainer.rl_check [--model DIR] [--steps 10] [--prompts 8] [--group 8] ...

Self-contained (no Redis, no rollout service): samples groups with `transformers.generate`, scores
them with the task's reward, and updates with `services.trainer.loss.grpo_loss` on log-probs from
`services.trainer.rollout_math.token_logprobs`, exactly the pieces the trainer service composes.
Sampling is dense here, so ξ ≡ 1 and the Sparse-RL corrections are identities; the metric that
matters is held-out mean reward before vs after (same prompts, same sampling seed).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase, Qwen3ForCausalLM

from services.trainer.loss import LossConfig, grpo_advantages, grpo_loss
from services.trainer.rollout_math import token_logprobs
from services.trainer.warmstart import ensure_warmstart_model
from shared.tasks import Task, get_task


@torch.no_grad()
def sample_groups(model: Qwen3ForCausalLM, tokenizer: PreTrainedTokenizerBase, prompts: list[str], group: int,
                  max_new_tokens: int, temperature: float, seed: int) -> dict[str, torch.Tensor | list[str]]:
    """`group` samples per prompt: token ids, attention and completion masks (EOS included), texts."""
    tokenizer.padding_side = "left"
    enc = tokenizer([p for p in prompts for _ in range(group)], return_tensors="pt", padding=True)
    torch.manual_seed(seed)
    out = model.generate(**enc, do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                         max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    prompt_len = enc["input_ids"].shape[1]
    completion = out[:, prompt_len:]
    # Completion tokens up to and including the first EOS; generate pads after it.
    eos_before = torch.cumsum(completion == tokenizer.eos_token_id, dim=1) - (completion == tokenizer.eos_token_id).long()
    completion_mask = torch.cat([torch.zeros_like(enc["input_ids"]), (eos_before == 0).long()], dim=1)
    return {
        "input_ids": out,
        "attention_mask": torch.cat([enc["attention_mask"], completion_mask[:, prompt_len:]], dim=1),
        "completion_mask": completion_mask,
        "texts": tokenizer.batch_decode(completion, skip_special_tokens=True),
    }


def mean_sampled_reward(model: Qwen3ForCausalLM, tokenizer: PreTrainedTokenizerBase, task: Task,
                        prompts: list[tuple[str, str]], samples: int, temperature: float, seed: int) -> dict[str, float]:
    model.eval()
    batch = sample_groups(model, tokenizer, [p for p, _ in prompts], samples, task.max_new_tokens, temperature, seed)
    answers = [a for _, a in prompts for _ in range(samples)]
    scored = [task.reward(t, a) for t, a in zip(batch["texts"], answers, strict=True)]
    return {"mean_reward": sum(r for r, _ in scored) / len(scored), "accuracy": sum(ok for _, ok in scored) / len(scored)}


def run(model_dir: Path, *, task_name: str = "addition", steps: int = 10, prompts_per_step: int = 8,
        group: int = 8, lr: float = 3e-5, temperature: float = 1.0, seed: int = 0, eval_prompts: int = 64,
        eval_samples: int = 2, threads: int = 1) -> dict:
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32)  # fp32 master weights
    task = get_task(task_name)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    cfg = LossConfig()
    held_out = task.make_prompts(eval_prompts, seed=seed + 777)
    before = mean_sampled_reward(model, tokenizer, task, held_out, eval_samples, temperature, seed)
    history = []
    started = time.perf_counter()
    for step in range(steps):
        prompts = task.make_prompts(prompts_per_step, seed=seed * 100_003 + step)
        model.eval()
        batch = sample_groups(model, tokenizer, [p for p, _ in prompts], group, task.max_new_tokens, temperature,
                              seed=seed * 100_003 + step)
        answers = [a for _, a in prompts for _ in range(group)]
        rewards = torch.tensor([task.reward(t, a)[0] for t, a in zip(batch["texts"], answers, strict=True)])
        adv = grpo_advantages(rewards, torch.arange(len(prompts)).repeat_interleave(group))
        args = (model, batch["input_ids"], batch["attention_mask"], batch["completion_mask"], temperature)
        with torch.no_grad():
            logp_old = token_logprobs(*args)
        model.train()
        loss, metrics = grpo_loss(token_logprobs(*args), logp_old, logp_old, adv, batch["completion_mask"], cfg)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        history.append({"step": step, "train_reward": float(rewards.mean()), "loss": metrics["loss"]})
        print(json.dumps(history[-1]), flush=True)
    after = mean_sampled_reward(model, tokenizer, task, held_out, eval_samples, temperature, seed)
    return {"settings": {"task": task_name, "steps": steps, "prompts_per_step": prompts_per_step, "group": group,
                         "lr": lr, "temperature": temperature, "seed": seed, "eval_prompts": eval_prompts,
                         "eval_samples": eval_samples},
            "before": before, "after": after, "history": history,
            "seconds": round(time.perf_counter() - started, 1)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, help="warm-started model dir (default: build/cache one)")
    parser.add_argument("--cache-dir", type=Path, default=Path("data/warmstart"))
    parser.add_argument("--task", default="addition")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-5)  # 3e-4 collapses the warm start (docs/training.md)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-prompts", type=int, default=64)
    parser.add_argument("--out", type=Path, help="write the result JSON here")
    args = parser.parse_args(argv)
    model_dir = args.model or ensure_warmstart_model(args.cache_dir)
    result = run(model_dir, task_name=args.task, steps=args.steps, prompts_per_step=args.prompts, group=args.group,
                 lr=args.lr, seed=args.seed, eval_prompts=args.eval_prompts)
    text = json.dumps({k: result[k] for k in ("settings", "before", "after", "seconds")}, indent=2)
    print(text)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
