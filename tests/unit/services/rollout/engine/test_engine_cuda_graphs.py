"""CUDA-graph decoding (static cache, Triton attention) gives the eager engine's results."""

from __future__ import annotations

import pytest
import torch

from services.rollout.engine import KVConfig, LLMEngine, SamplingParams, kernels
from services.rollout.engine.cuda_graphs import buckets
from services.rollout.engine.fused_decode import fuse_projections
from shared.patch import apply_patch, extract_patch
from tests.unit.services.rollout.engine.engine_helpers import tiny_pair

UNEQUAL = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16], [42], [3, 1, 4, 1, 5, 9], [2, 7]]
POLICIES = ["dense", "streaming", "snapkv", "rkv"]


def test_buckets_cover_every_batch_size() -> None:
    assert buckets(1) == [1]
    assert buckets(6) == [1, 2, 4, 6]
    assert buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    for batch in (1, 5, 16, 17, 64):
        assert all(any(b >= n for b in buckets(batch)) for n in range(1, batch + 1))
        assert max(buckets(batch)) == batch


def _pair(policy: str, family: str = "qwen3") -> tuple[LLMEngine, LLMEngine, KVConfig]:
    _, model = tiny_pair(family, tied=family != "llama")
    model = model.to("cuda")
    graphs, eager = LLMEngine(model, device="cuda", cuda_graphs=True), LLMEngine(model, device="cuda",
                                                                                 cuda_graphs=False)
    kv = KVConfig(policy=policy) if policy == "dense" else KVConfig(policy=policy, budget=8, buffer=5)
    return graphs, eager, kv


@pytest.mark.gpu
@pytest.mark.skipif(not kernels.available(), reason="needs CUDA and Triton")
@pytest.mark.parametrize(("policy", "family"), [(p, "qwen3") for p in POLICIES] + [("rkv", "llama"),
                                                                                    ("dense", "qwen2")])
def test_graph_decoding_equals_eager_decoding(policy: str, family: str) -> None:
    graphs, eager, kv = _pair(policy, family)
    probe = eager.generate(UNEQUAL, SamplingParams(temperature=0.0, max_new_tokens=40), kv)
    # Stop tokens: rows finish at different steps, leave the batch (in-place compaction) and the
    # live rows move to smaller graph buckets.
    stops = tuple(sorted({probe[1].token_ids[5], probe[3].token_ids[12]}))
    params = SamplingParams(temperature=0.0, max_new_tokens=40, stop_token_ids=stops)
    want, got = eager.generate(UNEQUAL, params, kv), graphs.generate(UNEQUAL, params, kv)
    assert any(o.finish_reason == "stop" for o in want)
    for w, g in zip(want, got, strict=True):
        assert (g.token_ids, g.finish_reason, g.kv) == (w.token_ids, w.finish_reason, w.kv)
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
def test_fused_projections_share_the_live_weights(family: str) -> None:
    _, model = tiny_pair(family)
    before = {k: v.clone() for k, v in model.hf_state_dict().items()}
    fused = fuse_projections(model)
    assert fuse_projections(model) is fused  # idempotent
    state = model.hf_state_dict()
    assert list(state) == list(before)
    assert all(torch.equal(state[k], before[k]) and state[k].is_contiguous() for k in before)
    qkv_w, qkv_b, gate_up, _ = fused[1]
    state["model.layers.1.self_attn.k_proj.weight"].add_(1.0)  # what a weight patch does, in place
    state["model.layers.1.mlp.up_proj.weight"][3, 5] = 7.0
    q_rows = model.model.layers[1].self_attn.q_proj.weight.shape[0]
    k_rows = model.model.layers[1].self_attn.k_proj.weight.shape[0]
    assert torch.equal(qkv_w[q_rows:q_rows + k_rows], before["model.layers.1.self_attn.k_proj.weight"] + 1.0)
    assert gate_up[gate_up.shape[0] // 2 + 3, 5] == 7.0
    assert (qkv_b is not None) == (family == "qwen2")
    with torch.no_grad():
        tokens = torch.tensor([[1, 2, 3]])
        model(tokens, torch.arange(3)[None])  # the eager forward still runs on the views
    # A parameter replaced, not written in place: the next fusion takes the new tensor.
    k_proj = model.model.layers[1].self_attn.k_proj
    k_proj.weight.data = torch.full_like(k_proj.weight, 0.5)
    refused = fuse_projections(model)
    assert refused is not fused
    assert torch.equal(refused[1][0][q_rows:q_rows + k_rows], torch.full_like(k_proj.weight, 0.5))
    assert k_proj.weight.data_ptr() == refused[1][0][q_rows:].data_ptr()


def _patched(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy of the weights with a few entries of every tensor changed (what a training step makes)."""
    gen = torch.Generator().manual_seed(3)
    new = {}
    for name, t in state.items():
        t = t.clone()
        flat = t.view(-1)
        index = torch.randint(0, flat.numel(), (max(1, flat.numel() // 50),), generator=gen).to(t.device)
        flat[index] += 0.05
        new[name] = t
    return new


def test_patches_write_into_the_live_weights_in_place() -> None:
    """What lets the kept CUDA graphs survive a weight update: apply_patch keeps every address."""
    _, model = tiny_pair("qwen3")
    engine = LLMEngine(model)
    fused = fuse_projections(engine.model)  # as a CUDA engine does at start
    addresses = engine._weight_addresses()
    state = engine.state_dict()
    new = _patched(state)
    apply_patch(state, extract_patch(state, new, run="t", base_version=0, target_version=1))
    assert engine._weight_addresses() == addresses
    assert all(torch.equal(engine.state_dict()[k], new[k]) for k in new)
    q_rows = model.model.layers[0].self_attn.q_proj.weight.shape[0]
    assert torch.equal(fused[0][0][:q_rows], new["model.layers.0.self_attn.q_proj.weight"])


@pytest.mark.gpu
@pytest.mark.skipif(not kernels.available(), reason="needs CUDA and Triton")
@pytest.mark.parametrize("layer_budgets", ["uniform", "pyramid"])
def test_graphs_are_captured_once_and_reused_across_calls(layer_budgets: str) -> None:
    graphs, eager, kv = _pair("rkv")
    kv = KVConfig(**(kv.model_dump() | {"layer_budgets": layer_budgets, "budget": 10}))
    params = SamplingParams(temperature=0.0, max_new_tokens=40)
    first = graphs.generate(UNEQUAL, params, kv)
    captured = graphs.graph_captures
    assert captured >= 1
    second = graphs.generate(UNEQUAL, params, kv)
    assert graphs.graph_captures == captured  # same storage, same graphs
    want = eager.generate(UNEQUAL, params, kv)
    for w, a, b in zip(want, first, second, strict=True):
        assert a.token_ids == b.token_ids == w.token_ids and a.kv == b.kv == w.kv
    # Prompts a few tokens shorter (smaller capacities) fit the kept storage too.
    shorter = [p[:3] for p in UNEQUAL]
    got, want = graphs.generate(shorter, params, kv), eager.generate(shorter, params, kv)
    assert graphs.graph_captures == captured
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    # A weight patch is written in place: the graphs read the new weights without a new capture.
    state = graphs.state_dict()
    apply_patch(state, extract_patch(state, _patched(state), run="t", base_version=0, target_version=1))
    got, want = graphs.generate(UNEQUAL, params, kv), eager.generate(UNEQUAL, params, kv)
    assert graphs.graph_captures == captured
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.token_ids for o in got] != [o.token_ids for o in first]
    # What the graphs bake in changes: a larger batch, another policy (no query ring), a moved parameter.
    graphs.generate(UNEQUAL + UNEQUAL, params, kv)
    assert graphs.graph_captures > captured
    captured = graphs.graph_captures
    graphs.generate(UNEQUAL, SamplingParams(temperature=0.0, max_new_tokens=8), KVConfig())
    assert graphs.graph_captures > captured
    captured = graphs.graph_captures
    norm, q_proj = graphs.model.model.norm.weight, graphs.model.model.layers[0].self_attn.q_proj.weight
    norm.data = norm.data.clone()
    q_proj.data = q_proj.data * 1.5  # a fused projection's parameter: fused again before the capture
    got, want = (graphs.generate(UNEQUAL, SamplingParams(temperature=0.0, max_new_tokens=8), KVConfig()),
                 eager.generate(UNEQUAL, SamplingParams(temperature=0.0, max_new_tokens=8), KVConfig()))
    assert graphs.graph_captures > captured
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


@pytest.mark.gpu
@pytest.mark.skipif(not kernels.available(), reason="needs CUDA and Triton")
@pytest.mark.parametrize("policy", POLICIES[1:])
def test_pyramid_graph_decoding_equals_eager_decoding(policy: str) -> None:
    graphs, eager, _ = _pair(policy)
    kv = KVConfig(policy=policy, budget=12, buffer=5, window=4, sink_tokens=2, layer_budgets="pyramid",
                  pyramid_beta=3)
    params = SamplingParams(temperature=0.0, max_new_tokens=40)
    want, got = eager.generate(UNEQUAL, params, kv), graphs.generate(UNEQUAL, params, kv)
    assert any(o.kv.evicted for o in want)
    for w, g in zip(want, got, strict=True):
        assert (g.token_ids, g.kv) == (w.token_ids, w.kv)
