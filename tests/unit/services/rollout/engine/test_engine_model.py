"""The compact decoder against transformers: names, logits, loading, live weights."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from services.rollout.engine import KVConfig, LLMEngine, SamplingParams
from services.rollout.models.decoder import DecoderLM, load_pretrained
from tests.unit.services.rollout.engine.engine_helpers import VOCAB, one_thread, tiny_config, tiny_pair

_one_thread = pytest.fixture(autouse=True)(one_thread)


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen2"])
@pytest.mark.parametrize("tied", [True, False])
def test_logits_match_transformers(family: str, tied: bool) -> None:
    hf, ours = tiny_pair(family, tied=tied)
    ids = torch.randint(0, VOCAB, (3, 17))
    with torch.no_grad():
        expected = hf(ids).logits
        got = ours.logits(ours(ids, torch.arange(17).expand(3, 17)))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_bf16_logits_close_to_transformers() -> None:
    hf, ours = tiny_pair("qwen3")
    inv_freq = hf.model.rotary_emb.inv_freq.clone()
    hf, ours = hf.to(torch.bfloat16), ours.to(torch.bfloat16)
    # transformers' from_pretrained(dtype=bf16) keeps inv_freq fp32; .to() would round it.
    hf.model.rotary_emb.inv_freq = inv_freq
    assert ours.model.rotary_emb.inv_freq.dtype == torch.float32
    ids = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        expected = hf(ids).logits.float()
        got = ours.logits(ours(ids, torch.arange(12).expand(2, 12))).float()
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("tied", [True, False])
def test_loads_save_pretrained_dir_with_saved_names(tmp_path, tied: bool) -> None:
    hf, _ = tiny_pair("qwen3", tied=tied, seed=1)
    hf.to(torch.bfloat16).save_pretrained(tmp_path)
    engine = LLMEngine.from_pretrained(tmp_path, dtype=torch.bfloat16)
    saved = load_file(tmp_path / "model.safetensors")
    state = engine.state_dict()
    assert set(state) == set(saved)
    assert ("lm_head.weight" in state) == (not tied)
    for name, tensor in saved.items():
        assert torch.equal(state[name], tensor), name
    ids = torch.randint(0, VOCAB, (1, 9))
    with torch.no_grad():
        expected = hf(ids).logits.float()
        got = engine.model.logits(engine.model(ids, torch.arange(9)[None])).float()
    torch.testing.assert_close(got, expected, atol=1e-2, rtol=1e-2)


def test_load_rejects_missing_and_foreign_tensors(tmp_path) -> None:
    hf, _ = tiny_pair("qwen3", tied=True)
    hf.save_pretrained(tmp_path)
    from safetensors.torch import save_file

    tensors = load_file(tmp_path / "model.safetensors")
    tensors.pop("model.norm.weight")
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(KeyError, match="model.norm.weight"):
        load_pretrained(tmp_path)
    tensors["model.norm.weight"] = torch.ones(64)
    tensors["model.extra.weight"] = torch.ones(3)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(KeyError, match="model.extra.weight"):
        load_pretrained(tmp_path)


def test_unsupported_architecture_is_refused() -> None:
    from transformers import GPT2Config

    with pytest.raises(ValueError, match="not supported"):
        DecoderLM(GPT2Config())


def test_patch_in_place_changes_generation_at_once() -> None:
    engine = LLMEngine(tiny_config("qwen3"))
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    before = engine.generate([[1, 2, 3]], greedy, KVConfig())[0]
    state = engine.state_dict()
    # Zeroing the final norm makes every logit 0: greedy then picks token 0 with log-prob -log(V).
    state["model.norm.weight"].zero_()
    engine.weights_updated({"model.norm.weight"})
    after = engine.generate([[1, 2, 3]], greedy, KVConfig())[0]
    assert before.token_ids != [0] * 8
    assert after.token_ids == [0] * 8
    assert after.logprobs == pytest.approx([-math.log(VOCAB)] * 8, abs=1e-5)


def test_emulated_dtype_generates_on_an_fp32_copy_that_follows_the_weights() -> None:
    """bf16 weights computed in fp32 (what a CPU without native bf16 gets): the state stays bf16
    (patches and fingerprints), generation equals an fp32 engine over the same values, and a patch
    reaches generation through weights_updated."""
    engine = LLMEngine(tiny_config("qwen3"), dtype=torch.bfloat16, compute_dtype=torch.float32)
    assert {t.dtype for t in engine.state_dict().values()} == {torch.bfloat16}
    assert engine.dtype == torch.float32
    reference = LLMEngine(DecoderLM(tiny_config("qwen3")), compute_dtype=torch.float32)
    with torch.no_grad():
        for name, tensor in reference.state_dict().items():
            tensor.copy_(engine.state_dict()[name])
    for params in (SamplingParams(temperature=0.0, max_new_tokens=8),
                   SamplingParams(temperature=1.0, max_new_tokens=8, seed=3)):
        kv = KVConfig(policy="rkv", budget=4, buffer=2, window=2)
        got, want = (e.generate([[1, 2, 3], [4, 5]], params, kv) for e in (engine, reference))
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert [o.logprobs for o in got] == [o.logprobs for o in want]
    engine.state_dict()["model.norm.weight"].zero_()
    engine.weights_updated({"model.norm.weight"})
    after = engine.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_new_tokens=8), KVConfig())[0]
    assert after.token_ids == [0] * 8
