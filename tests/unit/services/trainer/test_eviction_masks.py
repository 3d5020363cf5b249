"""Eviction-aware SFT: the engine's replayed visibility, applied per layer and KV head inside the
transformers model, gives the log-probs the engine sampled with under its compressed cache."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from services.rollout.engine import KVConfig, LLMEngine, SamplingParams
from services.rollout.engine.replay import visible_positions
from services.trainer.eviction_masks import LAYER_MASKED, batch_masks
from services.trainer.rollout_math import token_logprobs


def _engine_and_model(model_dir: str) -> tuple[LLMEngine, torch.nn.Module]:
    engine = LLMEngine.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).to(engine.dtype).eval()
    model.set_attn_implementation(LAYER_MASKED)
    return engine, model


def test_replayed_masks_reproduce_the_sampler_log_probs(tiny_model_dir: str) -> None:
    engine, model = _engine_and_model(tiny_model_dir)
    prompts = [[1, 10, 11, 12, 13, 14, 15], [1, 20, 21, 22], [1, 30, 31, 32, 33, 34, 35, 36, 37]]
    kv = KVConfig(policy="rkv", budget=6, buffer=2, window=2, keep_prompt=False)
    outs = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=20, seed=3), kv)
    assert all(o.kv.evicted > 0 for o in outs)  # the cache bit
    completions = [list(o.token_ids) for o in outs]
    seen = visible_positions(engine, prompts, completions, kv)

    width = max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True))
    ids = torch.zeros((3, width), dtype=torch.long)
    attention = torch.zeros((3, width), dtype=torch.long)
    completion_mask = torch.zeros((3, width), dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        ids[i, :len(p) + len(c)] = torch.tensor(p + c)
        attention[i, :len(p) + len(c)] = 1
        completion_mask[i, len(p):len(p) + len(c)] = 1
    layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    masks = batch_masks(attention, layers, heads, dict(enumerate(seen)))
    causal = batch_masks(attention, layers, heads, {})

    def logprobs(layer_masks: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=attention, layer_masks=layer_masks).logits.float()
        out = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
        return out[completion_mask[:, 1:].bool()]

    sampler = torch.tensor([lp for o in outs for lp in o.logprobs])
    evicted_gap = (logprobs(masks) - sampler).abs()
    dense_gap = (logprobs(causal) - sampler).abs()
    # Without layer_masks the attention is plain SDPA: the same as the causal masks.
    plain = token_logprobs(model, ids, attention, completion_mask, 1.0)[completion_mask.bool()]
    assert torch.allclose(plain, logprobs(causal), atol=1e-2)
    assert evicted_gap.max() < 0.05, evicted_gap.max()
    assert dense_gap.max() > 10 * evicted_gap.max()  # the eviction matters, and the masks carry it


def test_batch_masks_keep_padding_rows_finite() -> None:
    attention = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    masks = batch_masks(attention, 2, 1, {})
    assert masks.shape == (2, 2, 1, 4, 4)
    assert masks[0, 0, 0, 3].tolist() == [True, True, True, True]  # padding query: causal + itself
    assert masks[0, 0, 0, 1].tolist() == [True, True, False, False]
    assert masks.any(dim=-1).all()
