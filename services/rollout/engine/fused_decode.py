"""The decode step of the CUDA-graph path: the DecoderLM's layers, one token per row, fused.

Inside a graph every kernel still costs its launch gap and tail on the GPU (~2 µs), and the eager
layer launches ~30 of them (profile: bench/results/profile-decode-graphs-*.json). Here a layer is
11 kernels: RMSNorm (one kernel each), one projection for q, k, v, one kernel for q/k norm + RoPE +
cache write (+ the R-KV / SnapKV query ring), attention (split + merge), o_proj with the residual
add in its epilogue (addmm), one projection for gate and up, silu·up, down_proj + residual.

The fused projections need q/k/v (and gate/up) weights in one buffer: `fuse_projections` makes
the model's parameters views of such buffers, so the live state_dict (which weight patches write
in place) and this path read the same memory, and nothing is copied per step. Numerics follow the
eager layers' roundings (kernels.py), except that addmm rounds the residual sum once instead of
twice.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

import services.rollout.engine.kernels as kernels
from services.rollout.engine.kv_cache import StaticStorage
from services.rollout.models.decoder import MLP, Attention, DecoderLayer, DecoderLM, RMSNorm

Fused = list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]]


def _fuse(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the weights (and biases) of linears sharing an input; rebind them as views."""
    weight = torch.cat([lin.weight.data for lin in linears])
    has_bias = linears[0].bias is not None
    bias = torch.cat([lin.bias.data for lin in linears]) if has_bias else None
    at = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight.data = weight[at:at + rows]
        if bias is not None:
            lin.bias.data = bias[at:at + rows]
        at += rows
    return weight, bias


def _parts(layer: nn.Module) -> tuple[DecoderLayer, Attention, MLP]:
    decoder_layer = cast(DecoderLayer, layer)
    return decoder_layer, cast(Attention, decoder_layer.self_attn), cast(MLP, decoder_layer.mlp)


def _linears(layer: nn.Module) -> list[nn.Linear]:
    _, attn, mlp = _parts(layer)
    return [cast(nn.Linear, m) for m in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj)]


def _aliased(linears: list[nn.Linear], weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the linears' parameters are still the views of (weight, bias) that _fuse made."""
    at = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        bias_moved = bias is not None and (
            lin.bias is None or lin.bias.data_ptr() != bias[at:at + rows].data_ptr())
        if lin.weight.data_ptr() != weight[at:at + rows].data_ptr() or bias_moved:
            return False
        at += rows
    return True


def fuse_projections(model: DecoderLM) -> Fused:
    """Per layer (qkv weight, qkv bias, gate_up weight, gate_up bias); idempotent while the
    parameters stay views of the fused buffers (weight patches write in place), fused again if
    one was replaced (e.g. `param.data = ...`), so a new capture never reads a stale copy."""
    fused: Fused | None = getattr(model, "_fused_projections", None)
    if fused is not None and not all(
        _aliased(_linears(layer)[:3], qkv_w, qkv_b) and _aliased(_linears(layer)[3:], gu_w, gu_b)
        for layer, (qkv_w, qkv_b, gu_w, gu_b) in zip(model.model.layers, fused, strict=True)
    ):
        fused = None
    if fused is None:
        fused = []
        for layer in model.model.layers:
            linears = _linears(layer)
            fused.append((*_fuse(linears[:3]), *_fuse(linears[3:])))
        setattr(model, "_fused_projections", fused)  # noqa: B010 - not a module attribute torch tracks
    return fused


def _residual(x: torch.Tensor, a: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """x + linear(a), the add in the matmul's epilogue."""
    if linear.bias is not None:
        x = x + linear.bias
    return torch.addmm(x, a, linear.weight.t())


class FusedDecoder:
    def __init__(self, model: DecoderLM) -> None:
        self.model = model
        self.fused = fuse_projections(model)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, storage: StaticStorage) -> torch.Tensor:
        """tokens/positions [b] (b <= the storage's rows) -> logits [b, vocab]."""
        model = self.model
        b = tokens.shape[0]
        x = model.model.embed_tokens(tokens)
        cos, sin = model.model.rotary_emb(positions[:, None], x.dtype)
        cos, sin = cos.reshape(b, -1).contiguous(), sin.reshape(b, -1).contiguous()
        for i, module in enumerate(model.model.layers):
            layer, attn, mlp = _parts(module)
            qkv_w, qkv_b, gu_w, gu_b = self.fused[i]
            qkv = F.linear(_norm(x, layer.input_layernorm), qkv_w, qkv_b)
            k_cache, v_cache, q_window, lengths = storage.layer(i, b)
            q_norm, k_norm = (
                (cast(RMSNorm, attn.q_norm), cast(RMSNorm, attn.k_norm)) if attn.qk_norm else (None, None)
            )
            q = kernels.qkv_rope_store(
                qkv, q_norm.weight if q_norm else None, k_norm.weight if k_norm else None,
                q_norm.eps if q_norm else 0.0, cos, sin, k_cache, v_cache, lengths, q_window,
                storage.q_next, attn.num_heads, attn.num_kv_heads)
            out = kernels.decode_attention(q, k_cache, v_cache, lengths, attn.head_dim ** -0.5,
                                           storage.attn_buffers)
            x = _residual(x, out.view(b, -1), cast(nn.Linear, attn.o_proj))
            gate_up = F.linear(_norm(x, layer.post_attention_layernorm), gu_w, gu_b)
            x = _residual(x, kernels.silu_mul(gate_up), cast(nn.Linear, mlp.down_proj))
        return model.logits(_norm(x, model.model.norm))


def _norm(x: torch.Tensor, module: nn.Module) -> torch.Tensor:
    norm = cast(RMSNorm, module)
    return kernels.rms_norm(x, norm.weight, norm.eps)
