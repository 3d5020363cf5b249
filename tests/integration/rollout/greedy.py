"""Greedy parity between two bf16 implementations of one tiny model (the vLLM tests' yardstick):
transformers' teacher-forced logits decide whether two decodes that part did so at a near-tie."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen3ForCausalLM

# Two bf16 ulps of logits around 8: how far apart two kernels' logits of one token may land.
TIE_LOGITS = 0.125


def hf_model(model_dir: Path, state: dict[str, torch.Tensor] | None = None) -> Qwen3ForCausalLM:
    model = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    if state is not None:
        # The canonical state omits the tied lm_head; it follows embed_tokens.
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}
    return model


@torch.inference_mode()
def hf_greedy(model: Qwen3ForCausalLM, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             eos_token_id=None, pad_token_id=0)
        outputs.append(out[0, len(prompt):].tolist())
    return outputs


@torch.inference_mode()
def hf_logits(model: Qwen3ForCausalLM, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """fp32 next-token logits of transformers at every completion position (teacher forcing)."""
    return model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1].float()


def assert_greedy_parity(model: Qwen3ForCausalLM, prompts: list[list[int]], ours: list[list[int]],
                         theirs: list[list[int]]) -> None:
    """Two greedy decodes of the same bf16 weights agree token for token, except that they may part
    at a near-tie: where transformers' logits of the two tokens differ by at most TIE_LOGITS. bf16
    logits of a random tiny model tie exactly now and then, and different kernels round differently.
    Every token of `ours` must be greedy under transformers (within TIE_LOGITS) all the way."""
    for prompt, a, b in zip(prompts, ours, theirs, strict=True):
        assert len(a) == len(b)
        logits = hf_logits(model, prompt, a)
        shortfall = logits.max(dim=-1).values - logits.gather(-1, torch.tensor(a)[:, None])[:, 0]
        assert (shortfall <= TIE_LOGITS).all(), (
            f"prompt {prompt}: non-greedy tokens, shortfall {shortfall.tolist()}"
        )
        split = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        if split is not None:
            gap = (logits[split, a[split]] - logits[split, b[split]]).abs().item()
            assert gap <= TIE_LOGITS, (
                f"prompt {prompt}: {a} vs {b} part at step {split} without a tie ({gap})"
            )
