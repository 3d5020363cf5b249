"""Which HF-named tensors the vLLM engine sends together (no vLLM needed)."""

from __future__ import annotations

from services.rollout.vllm.engine import fused_groups

QWEN_PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def layer_names(i: int, *, bias: bool) -> list[str]:
    attn = [
        f"model.layers.{i}.self_attn.{p}_proj.{kind}"
        for p in "qkvo"
        for kind in (("weight", "bias") if bias and p != "o" else ("weight",))
    ]
    norms = [f"model.layers.{i}.self_attn.q_norm.weight", f"model.layers.{i}.input_layernorm.weight"]
    mlp = [f"model.layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    return attn + norms + mlp


def test_fused_parts_and_their_biases_travel_together() -> None:
    names = [
        "model.embed_tokens.weight",
        *layer_names(0, bias=True),
        *layer_names(1, bias=True),
        "model.norm.weight",
    ]
    groups = fused_groups(names, QWEN_PACKED)
    qkv0 = {f"model.layers.0.self_attn.{p}_proj.{k}" for p in "qkv" for k in ("weight", "bias")}
    assert set(groups["model.layers.0.self_attn.k_proj.bias"]) == qkv0
    assert set(groups["model.layers.1.mlp.up_proj.weight"]) == {"model.layers.1.mlp.gate_proj.weight",
                                                               "model.layers.1.mlp.up_proj.weight"}
    # Unfused layers, and the same module of another layer, stay apart.
    assert groups["model.layers.0.self_attn.o_proj.weight"] == ["model.layers.0.self_attn.o_proj.weight"]
    assert groups["model.layers.0.mlp.down_proj.weight"] == ["model.layers.0.mlp.down_proj.weight"]
    assert groups["model.layers.0.self_attn.q_norm.weight"] == ["model.layers.0.self_attn.q_norm.weight"]
    assert groups["model.embed_tokens.weight"] == ["model.embed_tokens.weight"]
    assert groups["model.norm.weight"] == ["model.norm.weight"]
    assert set(groups) == set(names)


def test_without_packing_every_module_is_its_own_layer() -> None:
    names = layer_names(0, bias=False)
    groups = fused_groups(names, {})
    assert all(groups[name] == [name] for name in names)
