"""Token-level log-probs of given completions under a causal LM: the trainer's dense recomputation.

Same quantity as the sampler log-prob in docs/internals.md: log_softmax(logits / T)[token] over the
full vocabulary in fp32, before any top-k/top-p filtering; T = 0 means log_softmax(logits). Here the
logits come from one dense forward pass, so logp_old_dense − logp_sampler isolates what the
rollout engine's KV compression changed.
"""

from __future__ import annotations

import torch


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counting real tokens only, so left or right padding gives each sequence 0, 1, 2, ...

    (what an engine that runs every sequence unpadded sees, and what HF `generate` uses).
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: float = 1.0,
    layer_masks: torch.Tensor | None = None,
) -> torch.Tensor:
    """[B, L] fp32: log p(input_ids[:, t] | input_ids[:, :t]) where completion_mask is 1, else 0.

    Aligned with `input_ids` (the log-prob of token t sits at t, computed from the logits at t − 1),
    which is the layout `services.trainer.loss` expects. Gradients flow when the caller has them
    enabled (the policy pass) and not under `torch.no_grad()` (old-policy and reference passes).
    `layer_masks` [B, layers, Hkv, L, L]: what each query may attend to, per layer and KV head (the
    sampler's replayed eviction, services.trainer.eviction_masks; the model must use its attention).
    """
    extra = {} if layer_masks is None else {"layer_masks": layer_masks}
    if completion_mask[:, 0].any():
        raise ValueError("completion_mask marks position 0, which has no preceding logits")
    logits = model(input_ids=input_ids, attention_mask=attention_mask,
                   position_ids=position_ids_from_mask(attention_mask), use_cache=False, **extra).logits
    logits = logits[:, :-1].float()
    if temperature > 0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    logp = torch.cat([torch.zeros_like(logp[:, :1]), logp], dim=1)
    return logp * completion_mask.to(logp.dtype)
