"""Tiny transformers models shared by the engine tests."""

from __future__ import annotations

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from services.rollout.models.decoder import DecoderLM

FAMILIES = {
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
}
VOCAB = 101


def tiny_config(family: str = "qwen3", *, tied: bool = True, layers: int = 2):
    config_cls, _ = FAMILIES[family]
    return config_cls(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=tied,
                      max_position_embeddings=4096)


def tiny_pair(family: str = "qwen3", *, tied: bool = True, seed: int = 0):
    """(transformers model, DecoderLM) with the same fp32 weights."""
    torch.manual_seed(seed)
    config = tiny_config(family, tied=tied)
    hf = FAMILIES[family][1](config).eval()
    ours = DecoderLM(config)
    missing, unexpected = ours.load_state_dict(hf.state_dict(), strict=False)
    assert not missing and unexpected == ([] if not tied else ["lm_head.weight"])
    return hf, ours


def one_thread():
    """Fixture body: the tiny models are far faster on one thread, above all on a shared, busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
