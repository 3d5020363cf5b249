"""Held-out accuracy of a causal LM on a task's prompts, with transformers' `generate` (dense cache).

Shared by the warm start (its stopping check and report) and the trainer (a validation curve every
`eval_every` steps). Sampling runs under a forked, seeded RNG, so an evaluation is repeatable and
leaves the caller's random stream untouched.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from shared.tasks import Task


@torch.no_grad()
def evaluate(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, task: Task, prompts: list[tuple[str, str]],
             *, sample: bool, seed: int = 0, batch_size: int = 64) -> dict[str, float]:
    """Accuracy and mean reward over `prompts` (text, answer): greedy, or T = 1 over the whole
    vocabulary with `sample`."""
    was_training = model.training
    model.eval()
    rewards, correct = [], []
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    sampling = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0} if sample else {"do_sample": False}
    devices = [model.device] if model.device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            for start in range(0, len(prompts), batch_size):
                chunk = prompts[start: start + batch_size]
                enc = tokenizer([p for p, _ in chunk], return_tensors="pt", padding=True).to(model.device)
                out = model.generate(  # type: ignore[operator]  # transformers' generate is untyped
                    **enc, **sampling, max_new_tokens=task.max_new_tokens,
                                     eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
                texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
                for text, (_, answer) in zip(texts, chunk, strict=True):
                    reward, ok = task.reward(text, answer)
                    rewards.append(reward)
                    correct.append(ok)
    finally:
        tokenizer.padding_side = side
        model.train(was_training)
    n = max(1, len(prompts))
    return {"accuracy": sum(correct) / n, "mean_reward": sum(rewards) / n}
