"""Worker-side half of the vLLM engine: methods vLLM mixes into its worker class.

`VLLMEngine` passes `worker_extension_cls="services.rollout.vllm.ext.SparsecastWorkerExtension"`;
vLLM imports this module inside every worker process (or in-process without multiprocessing) and
makes the methods below callable through `llm.collective_rpc(name, args=...)`. `self` is then the
vLLM worker, so `self.model_runner` is its model runner. Method names carry a `sparsecast_` prefix
because vLLM refuses extension methods that shadow worker methods.

Arguments cross a process boundary when vLLM runs with multiprocessing, and torch tensors in rpc
arguments fail to pickle there (docs/vllm.md): weights travel as safetensors bytes.
"""

from __future__ import annotations

from typing import Any

import torch
from safetensors.torch import load as load_safetensors


def redispatch_cpu_gemms(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Rebuild the CPU GEMM handle of layers that keep a reloaded weight (the vocab embedding,
    and the LM head tied to it).

    On CPU, vLLM gives such a layer a oneDNN matmul handle built from its weight at load time.
    The layerwise reload re-processes only the modules it loaded into; the tied LM head is a
    module of its own that shares the embedding's weight and is never named, so it kept its
    old handle, and where oneDNN packs the weight into the handle (seen on an AVX512-BF16 CPU
    without AMX) it kept computing with the old embedding: after a patch of the tied
    embedding, greedy tokens were off by up to 5.8 logits. Layers whose weight vLLM drops after
    packing (linear layers) are rebuilt by the reload itself and are untouched here.
    """
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    reloaded: set[int] = set()  # storage of the reloaded weights that layers keep
    for name in weights:
        try:
            tensor = model.get_parameter(name)
        except AttributeError:
            continue  # fused in vLLM under another name (q_proj → qkv_proj): a linear layer
        if tensor.numel():
            reloaded.add(tensor.untyped_storage().data_ptr())
    # Every layer computing with one of them: the tied LM head is a module of its own that
    # shares the embedding's weight and was not named in the reload.
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (hasattr(module, "cpu_linear") and isinstance(weight, torch.Tensor) and weight.ndim == 2
                and weight.numel() and weight.untyped_storage().data_ptr() in reloaded):
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)


def packed_modules(model: torch.nn.Module) -> dict[str, list[str]]:
    """The model's fused-layer map, e.g. {"qkv_proj": ["q_proj", "k_proj", "v_proj"], ...}."""
    return {packed: list(parts) for packed, parts in getattr(model, "packed_modules_mapping", {}).items()}


class SparsecastWorkerExtension:
    model_runner: Any  # provided by the vLLM worker this class is mixed into

    def sparsecast_reload_weights(self, data: bytes) -> int:
        """Load HF-named checkpoint tensors (safetensors bytes) into the running model in place.

        Goes through the model runner's layerwise reload, which re-runs each layer's checkpoint
        loader and post-load processing (fused q/k/v and gate/up packing, CPU weight prepacking),
        then copies the result into the existing kernel tensors, so CUDA graphs and compiled code
        stay valid. A fused layer must receive all of its parts in one call: the reload rebuilds
        the whole layer from what it was given. Returns the number of tensors loaded.
        """
        weights = load_safetensors(data)
        self.model_runner.reload_weights(weights_iterator=list(weights.items()), is_checkpoint_format=True)
        redispatch_cpu_gemms(self.model_runner.get_model(), weights)
        return len(weights)

    def sparsecast_packed_modules(self) -> dict[str, list[str]]:
        """The model's fused-layer map, e.g. {"qkv_proj": ["q_proj", "k_proj", "v_proj"], ...}."""
        return packed_modules(self.model_runner.get_model())

    def sparsecast_install_logprob_hook(self) -> bool:
        """Make vLLM report the sampler log-prob of docs/internals.md, also under top-k/top-p.

        With `logprobs_mode="processed_logprobs"` vLLM reports log_softmax of the logits after
        temperature *and after* top-k/top-p masking, i.e. of the truncated, renormalised
        distribution. The contract wants log_softmax(logits / T) over the full vocabulary, before
        filtering (what the trainer's dense recomputation gives). Both of vLLM's samplers apply
        top-k/top-p in one method that receives the temperature-scaled fp32 logits; wrapping that
        method to take the log-softmax first yields exactly the contract's quantity. Greedy-only
        batches never reach it: vLLM then reports log_softmax(logits), which is the T = 0 rule.
        Returns False when the sampler has neither known shape (the engine then refuses top-k/top-p).
        """
        sampler = self.model_runner.sampler
        topk_topp = getattr(sampler, "topk_topp_sampler", None)
        if topk_topp is not None:  # V1 model runner (CPU, and GPU without model runner V2)
            inner = topk_topp.forward
            # The inner sampler computes no log-probs of its own once it thinks raw ones are wanted;
            # its kernel choice was fixed at construction (no FlashInfer under processed modes).
            topk_topp.logprobs_mode = "raw_logprobs"

            def forward_v1(
                logits: torch.Tensor, generators: Any, k: Any, p: Any
            ) -> tuple[torch.Tensor, torch.Tensor]:
                logprobs = logits.log_softmax(dim=-1, dtype=torch.float32)  # before in-place filtering
                sampled, _ = inner(logits, generators, k, p)
                return sampled, logprobs

            topk_topp.forward = forward_v1
            return True
        if hasattr(sampler, "_sample_random"):  # model runner V2 (GPU)
            inner_random = sampler._sample_random

            def sample_random_v2(
                processed_logits: torch.Tensor, *args: Any, **kwargs: Any
            ) -> tuple[torch.Tensor, torch.Tensor]:
                logprobs = processed_logits.log_softmax(dim=-1, dtype=torch.float32)
                sampled, _ = inner_random(processed_logits, *args, **kwargs)
                # vLLM log-softmaxes what it gets back again; log_softmax is idempotent.
                return sampled, logprobs

            sampler._sample_random = sample_random_v2
            return True
        return False
