"""Replay a compressed-cache generation with the tokens given: what each query could see.

A rollout worker generating under a KV budget decodes each token against the cache as its policy
left it. `visible_positions` runs the engine's own prefill, decode and compression steps over
given completions (teacher forcing, no sampling) and records, for every layer, KV head and query
position, which positions were stored: the exact eviction of the engine, not an approximation of
it (a row compresses on its own schedule, so one sequence replays alike alone or in any batch).
Two users: the trainer's eviction replay (LossConfig.recompute = "replayed") recomputes the
policy's log-probs under these masks, and the eviction-aware warm start (`evict_share`,
services.trainer.warmstart) trains a model under them.
"""

from __future__ import annotations

import torch

from services.rollout.engine.attention import CacheAttention
from services.rollout.engine.config import KVConfig
from services.rollout.engine.kv_cache import KVCache, layer_capacities
from services.rollout.engine.llm_engine import LLMEngine


@torch.inference_mode()
def visible_positions(engine: LLMEngine, prompts: list[list[int]], completions: list[list[int]],
                      kv: KVConfig) -> torch.Tensor:
    """bool [B, layers, Hkv, T, T] (T = the longest prompt + completion): entry [b, l, h, q, k] says
    that the query at position q of row b attended to position k in layer l, head h.

    Prompt queries see the whole causal prompt (prefill is dense); completion token i's query sees
    what the cache stored when the engine decoded it. The query at the last position of a row
    (whose next token the engine would sample, not read) is included; positions past a row's end
    see only themselves.
    """
    model = engine.runner
    dev = engine.device
    prompt_lengths = [len(p) for p in prompts]
    steps = max(len(c) for c in completions)
    total = max(p + len(c) for p, c in zip(prompt_lengths, completions, strict=True))
    batch, width = len(prompts), max(prompt_lengths)
    cache = KVCache(num_layers=model.num_layers, num_heads=model.num_heads, num_kv_heads=model.num_kv_heads,
                    head_dim=model.head_dim, prompt_lengths=prompt_lengths,
                    capacity=layer_capacities(prompt_lengths, steps, kv, model.num_layers), kv=kv,
                    dtype=engine.dtype, device=dev)
    slots = torch.arange(total, device=dev)
    visible = torch.zeros((batch, model.num_layers, model.num_kv_heads, total, total), dtype=torch.bool,
                          device=dev)
    visible[:, :, :, slots, slots] = True
    lengths = torch.tensor(prompt_lengths, device=dev)
    causal = (slots[None, :] <= slots[:, None])[None] & (slots[None, None, :] < lengths[:, None, None])
    prompt_rows = slots[None, :] < lengths[:, None]  # [B, T]
    visible |= (causal & prompt_rows[:, :, None])[:, None, None]

    ids = torch.zeros((batch, width), dtype=torch.long, device=dev)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = torch.tensor(p, device=dev)
    attention = CacheAttention(cache)
    attention.begin_prefill(width)
    model(ids, torch.arange(width, device=dev).expand(batch, width), attention.prefill)
    if cache.needs_compression():
        cache.compress()
    forced = torch.zeros((batch, steps), dtype=torch.long, device=dev)
    for i, c in enumerate(completions):
        forced[i, :len(c)] = torch.tensor(c, device=dev)
    rows = torch.arange(batch, device=dev)
    for step in range(steps):
        positions = lengths + step
        attention.begin_decode(positions)
        model(forced[:, step:step + 1], positions[:, None], attention.decode)
        attention.end_decode()
        query = positions.clamp(max=total - 1)
        row_ok = (positions < total)[:, None, None]
        for layer in range(model.num_layers):
            visible[rows, layer, :, query] = torch.where(row_ok, cache.stored_mask(layer, total),
                                                         visible[rows, layer, :, query])
        if cache.needs_compression():
            cache.compress()
    return visible
