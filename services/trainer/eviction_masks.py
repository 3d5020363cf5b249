"""A model's attention as its compressed-cache sampler gives it: replayed masks, and an attention
that applies them (the learner's eviction replay and the eviction-aware warm start).

`EvictionMasks` replays examples on the rollout engine (services.rollout.engine.replay) under
given weights and returns, per layer and KV head, what each query could see. The
attention registered here as `LAYER_MASKED` applies such a mask per layer inside a transformers
model (`model(..., layer_masks=masks)`); without `layer_masks` it is plain SDPA, so generation and
evaluation of the same model object are unchanged.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, cast

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PretrainedConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from services.rollout.engine import KVConfig, LLMEngine
from services.rollout.engine.replay import visible_positions

LAYER_MASKED = "sparsecast_layer_masked"


def _layer_masked_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
                            scaling: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    masks: torch.Tensor | None = kwargs.pop("layer_masks", None)
    if masks is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    # [B, layers, Hkv, T, T] → this layer's [B, Hq, T, T] (query head i reads KV head i // group).
    mask = masks[:, cast(int, module.layer_idx)].repeat_interleave(query.shape[1] // key.shape[1], dim=1)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(LAYER_MASKED, _layer_masked_attention)
AttentionMaskInterface.register(LAYER_MASKED, sdpa_mask)  # the 2-D mask → SDPA's, for the fallback


class EvictionMasks:
    """The rollout engine with bf16 weights, as a worker holds them, fed a model's weights before
    each replay."""

    def __init__(self, config: PretrainedConfig, device: torch.device,
                 compute_dtype: torch.dtype | None = None) -> None:
        """compute_dtype: what the replay computes in (default: what a worker on this device computes
        bf16 weights in, shared.dtypes.compute_dtype)."""
        self.engine = LLMEngine(copy.deepcopy(config), device=device, dtype=torch.bfloat16,
                                compute_dtype=compute_dtype)

    def load(self, weights: Mapping[str, torch.Tensor]) -> LLMEngine:
        """The engine holding `weights` (a model's state_dict, HF names), rounded to bf16."""
        live = self.engine.state_dict()
        with torch.no_grad():
            for name, tensor in weights.items():
                if name in live:
                    live[name].copy_(tensor)
        self.engine.weights_updated(set(live))
        return self.engine

    def __call__(self, weights: Mapping[str, torch.Tensor], prompts: list[list[int]],
                 completions: list[list[int]], kv: KVConfig) -> torch.Tensor:
        """visible_positions of these examples under `weights` and the cache `kv`."""
        return visible_positions(self.load(weights), prompts, completions, kv)


def batch_masks(attention: torch.Tensor, layers: int, kv_heads: int,
                rows: dict[int, torch.Tensor]) -> torch.Tensor:
    """Layer masks [B, layers, Hkv, T, T] for a right-padded batch: causal over real tokens (each
    query also sees itself, so padding rows stay finite) and, for the rows in `rows`, their replayed
    visibility (cut or padded to the batch's width)."""
    batch, width = attention.shape
    slots = torch.arange(width, device=attention.device)
    causal = (slots[None, :] <= slots[:, None])[None] & attention.bool()[:, None, :]
    causal |= torch.eye(width, dtype=torch.bool, device=attention.device)[None]
    masks = causal[:, None, None].expand(batch, layers, kv_heads, width, width).clone()
    for row, seen in rows.items():
        n = min(width, seen.shape[-1])
        masks[row, :, :, :n, :n] = seen[:, :, :n, :n]
    return masks
