"""Compact Llama / Qwen2 / Qwen3 decoder with Hugging Face parameter names.

Parameter names equal those of transformers' `*ForCausalLM` (and of their `save_pretrained`
files), so trainer state dicts and sparse weight patches apply to this model unchanged. The
numerics follow transformers' eager path: RMSNorm in fp32, RoPE cos/sin computed in fp32 and cast
to the activation dtype, attention softmax in fp32.

Attention is delegated to an `AttendFn` so the same layers serve a stateless full forward
(`causal_attention`, used for tests and recomputation) and the engine's compressed KV cache.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn
from transformers import AutoConfig, PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")

# (layer index, q [B, Hq, T, D], k [B, Hkv, T, D], v [B, Hkv, T, D]) -> attention output [B, Hq, T, D]
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def causal_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain causal attention over the given tokens (no cache)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One op instead of eight (the decode step is launch-bound). rms_norm upcasts a bf16/fp16
        # input to fp32 and casts the result back itself, so this is transformers' eager
        # `weight * (x.float() * rsqrt(mean(x²) + eps)).to(dtype)`, bit for bit on the CPU.
        return self.weight * F.rms_norm(x, (x.shape[-1],), eps=self.eps)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for logical positions; inv_freq from transformers' RoPE init functions."""

    inv_freq: torch.Tensor  # a buffer (register_buffer): fp32 whatever the model's dtype

    def __init__(self, config: PretrainedConfig, head_dim: int) -> None:
        super().__init__()
        params = getattr(config, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
            inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            scaling = 1.0
        elif rope_type in ("linear", "llama3", "yarn"):
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config)
        else:  # dynamic / longrope change with sequence length: not reproduced here
            raise ValueError(f"unsupported rope_type {rope_type!r}")
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.scaling = float(scaling)

    def _apply(self, fn, recurse: bool = True):
        # Module.to(bf16) would round inv_freq and shift every rotation angle; transformers'
        # from_pretrained keeps it fp32, so only move it, never cast it.
        inv_freq: torch.Tensor = self.inv_freq
        super()._apply(fn, recurse)
        if not inv_freq.is_meta:
            self.inv_freq = inv_freq.to(self.inv_freq.device)
        return self

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [B, 1, T, D] for apply_rope (computed once per forward, shared by layers)."""
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)
        cos = (torch.cat((freqs, freqs), dim=-1).cos() * self.scaling).to(dtype)
        # rotate_half(x) * sin == swap_halves(x) * cat(-sin₁, sin₂): negating sin instead of x is
        # exact, and saves the per-layer neg + cat.
        sin = (torch.cat((-freqs, freqs), dim=-1).sin() * self.scaling).to(dtype)
        return cos.unsqueeze(1), sin.unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D]; cos/signed_sin [B, 1, T, D] from RotaryEmbedding (transformers' x·cos + rotate_half(x)·sin)."""
    *lead, d = x.shape
    swapped = x.unflatten(-1, (2, d // 2)).flip(-2).flatten(-2)
    return x * cos + swapped * signed_sin


class Attention(nn.Module):
    def __init__(self, config: PretrainedConfig, head_dim: int) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim
        # Qwen2 hard-codes q/k/v biases; Llama and Qwen3 read `attention_bias`.
        bias = config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * head_dim, bias=bias)
        o_bias = bool(getattr(config, "attention_bias", False)) and config.model_type == "llama"
        self.o_proj = nn.Linear(self.num_heads * head_dim, hidden, bias=o_bias)
        self.qk_norm = config.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int,
                attend: AttendFn) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)
        k = apply_rope(k.transpose(1, 2), cos, sin)
        out = attend(layer, q, k, v.transpose(1, 2))
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, head_dim: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, head_dim)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int,
                attend: AttendFn) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, layer, attend)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """Holds the `model.*` parameters (embed_tokens, layers, norm), as in transformers."""

    def __init__(self, config: PretrainedConfig, head_dim: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, head_dim) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config, head_dim)


def check_config(config: PretrainedConfig) -> None:
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {config.model_type!r} not supported; use one of {SUPPORTED_MODEL_TYPES}")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {config.hidden_act!r} not supported (only silu)")
    layer_types = getattr(config, "layer_types", None) or []
    if any(kind != "full_attention" for kind in layer_types):
        raise ValueError("sliding-window layers are not supported")


class DecoderLM(nn.Module):
    """Causal LM: `model.*` backbone plus `lm_head` (tied to `model.embed_tokens` when configured)."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        check_config(config)
        self.config = config
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = config.num_key_value_heads
        self.num_heads = config.num_attention_heads
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.model = Backbone(config, self.head_dim)
        if not self.tied:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.tied else self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attend: AttendFn = causal_attention) -> torch.Tensor:
        """input_ids/positions [B, T] -> final-normed hidden states [B, T, hidden]."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb(positions, x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, i, attend)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head_weight)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Live parameters under the names of the HF model's `save_pretrained` files.

        A tied `lm_head.weight` is not listed (transformers saves it only as
        `model.embed_tokens.weight`); non-persistent buffers (rotary tables) are excluded.
        """
        return {name: p.data for name, p in self.named_parameters()}


def load_pretrained(path: str | Path, *, device: str | torch.device = "cpu",
                    dtype: torch.dtype = torch.bfloat16) -> DecoderLM:
    """Build a DecoderLM from a HF model directory (config.json + *.safetensors, sharded or not)."""
    path = Path(path)
    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = DecoderLM(config)
    model = model.to_empty(device=device).to(dtype)
    model.model.rotary_emb = RotaryEmbedding(config, model.head_dim).to(device)  # meta had no values
    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else []
    files = [path / f for f in files] or sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    params = dict(model.named_parameters())
    seen: set[str] = set()
    for file in files:
        for name, tensor in load_file(file, device=str(device)).items():
            if model.tied and name == "lm_head.weight":
                continue  # some tied checkpoints store both names; the embedding is authoritative
            if name not in params:
                raise KeyError(f"{file.name}: unexpected tensor {name!r}")
            if tuple(tensor.shape) != tuple(params[name].shape):
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} != {tuple(params[name].shape)}")
            params[name].data.copy_(tensor)
            seen.add(name)
    missing = sorted(set(params) - seen)
    if missing:
        raise KeyError(f"missing tensors in {path}: {missing[:5]}{'...' if len(missing) > 5 else ''}")
    return model.eval().requires_grad_(False)
