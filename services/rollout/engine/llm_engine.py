"""LLMEngine: batched generation with a budgeted, compacting KV cache (docs/engine.md).

One generate() call is one batch: a padded prefill of all prompts, then lockstep decode steps of
one token per live sequence. The decode loop never waits for the device except to learn which
sequences hit a stop token, which it reads back every `FINISH_CHECK_STEPS` steps (a row that
stopped meanwhile decodes a few discarded tokens; its outputs and KV stats end at its stop token).
Finished sequences leave the batch once a quarter of the rows are finished (moving the cache
costs a copy, so it is amortised rather than done per finish).

On CUDA with Triton, decode steps replay CUDA graphs (cuda_graphs.py) over a static cache, except
for H2O, whose attention weights the fused kernels do not return; `cuda_graphs=False` keeps the
eager step everywhere. The static cache's storage and its graphs outlive a call (as vLLM and
nano-vllm capture once): the next call reuses them when its batch fits the storage (as many rows
or fewer, per-layer capacities at most `REUSE_SLACK` slots smaller, the same query window) and
no parameter moved; otherwise they are dropped first, then allocated and captured again. Weight
patches write into the parameters in place (shared.patch.apply_patch, sync_weights), so the
graphs read the new weights without a new capture. `release_decode_state()` frees them.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import PretrainedConfig

import services.rollout.engine.kernels as kernels
from services.rollout.engine.attention import CacheAttention
from services.rollout.engine.config import GenerationOutput, KVConfig, SamplingParams, check_token_ids
from services.rollout.engine.cuda_graphs import DecodeGraphs
from services.rollout.engine.eviction_log import EvictionLog
from services.rollout.engine.fused_decode import fuse_projections
from services.rollout.engine.kv_cache import KVCache, StaticStorage, layer_capacities
from services.rollout.engine.policies import POLICIES
from services.rollout.engine.sampler import sample
from services.rollout.engine.sequence import Sequence
from services.rollout.models.decoder import DecoderLM, load_pretrained
from shared import dtypes as shared_dtypes

# Steps between reads of stop-token hits (each read waits for the device's queue to drain).
FINISH_CHECK_STEPS = 8
# SDPA kernels for generation: cuDNN attention builds an execution plan per new shape, and a
# growing cache is a new shape at every decode step; flash / memory-efficient kernels are not.
_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class LLMEngine:
    name = "native"

    def __init__(self, model_or_config: DecoderLM | PretrainedConfig, *, device: str | torch.device = "cpu",
                 dtype: torch.dtype | None = None, cuda_graphs: bool | None = None,
                 compute_dtype: torch.dtype | None = None) -> None:
        """Wrap a DecoderLM, or build one with random weights from a transformers config (tests, benchmarks).

        cuda_graphs: decode through CUDA graphs (default: on a CUDA device where Triton is installed).
        compute_dtype: what generation computes and caches K/V in (default: the weights' dtype, or
        fp32 on a CPU that only emulates bf16/fp16 products, shared.dtypes.compute_dtype)."""
        model = model_or_config if isinstance(model_or_config, DecoderLM) else DecoderLM(model_or_config)
        if dtype is not None:
            model = model.to(dtype)
        self.model = model.to(device).eval().requires_grad_(False)
        self.device = torch.device(device)
        self.config = self.model.config
        weights = self.model.model.embed_tokens.weight.dtype
        compute = compute_dtype or shared_dtypes.compute_dtype(self.device, weights)
        # The weights (state_dict(), patched in place, fingerprinted) keep their dtype; generation
        # runs on a copy in the compute dtype where that differs, kept equal by weights_updated()
        # (bf16 weights and an fp32 copy: 3x the bf16 weights' memory).
        self.runner = self.model if compute == weights else copy.deepcopy(self.model).to(compute)
        graphs_possible = self.device.type == "cuda" and kernels.available()
        if cuda_graphs and not graphs_possible:
            raise ValueError("cuda_graphs needs a CUDA device and Triton")
        self.cuda_graphs = graphs_possible if cuda_graphs is None else cuda_graphs
        if self.cuda_graphs:
            # Now, not at the first generate: state_dict() hands out the fused buffers' views from
            # the start, so no caller can hold a tensor that stops being the live weight.
            fuse_projections(self.runner)
        # Allocated KV bytes of the last batch (the cache itself, not per sequence): for benchmarks.
        self.last_batch_kv_bytes = 0
        # The static cache storage and graphs kept between calls, with the parameters' addresses
        # they were captured over; graph_captures counts captures over the engine's life.
        self._decode: tuple[StaticStorage, DecodeGraphs] | None = None
        self._decode_weights: tuple[int, ...] = ()
        self.graph_captures = 0
        # Record what the compressed cache hid from each query (GenerationOutput.evicted_at), for a
        # trainer that replays the eviction (engine/eviction_log.py); off: no cost.
        self.record_evictions = False

    @classmethod
    def from_pretrained(cls, path: str | Path, *, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.bfloat16) -> LLMEngine:
        return cls(load_pretrained(path, device=device, dtype=dtype), device=device)

    @property
    def dtype(self) -> torch.dtype:
        """What generation computes and caches K/V in."""
        return self.runner.model.embed_tokens.weight.dtype

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Live HF-named weights (keys as in the HF model's save_pretrained); patches apply in place."""
        return self.model.hf_state_dict()

    def weights_updated(self, names: set[str]) -> None:
        """Copy the changed weights into the compute copy, if there is one (without, generation reads
        the state_dict tensors directly)."""
        if self.runner is self.model:
            return
        weights, compute = self.model.hf_state_dict(), self.runner.hf_state_dict()
        with torch.no_grad():
            for name in names:
                compute[name].copy_(weights[name])

    def release_decode_state(self) -> None:
        """Free the kept static cache and its graphs (the next CUDA-graph call allocates and captures)."""
        self._decode = None

    def _weight_addresses(self) -> tuple[int, ...]:
        """Where every parameter and buffer lives: a graph reads them at these addresses."""
        return tuple(t.data_ptr() for t in (*self.runner.parameters(), *self.runner.buffers()))

    def _static_decode(self, batch: int, capacities: list[int],
                       kv: KVConfig) -> tuple[StaticStorage, DecodeGraphs]:
        """The kept storage and graphs if this batch fits them (zeroed), else new ones."""
        m = self.runner
        window = kv.window if POLICIES[kv.policy].uses_query_window else None
        layout = (m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim, self.dtype)
        weights = self._weight_addresses()
        if (self._decode is not None and weights == self._decode_weights
                and self._decode[0].fits(batch, capacities, window, layout)):
            self._decode[0].reset()
            return self._decode
        self._decode = None  # free the old allocation and graph pool before the new one
        storage = StaticStorage(num_layers=m.num_layers, batch=batch, num_heads=m.num_heads,
                                num_kv_heads=m.num_kv_heads, head_dim=m.head_dim, capacities=capacities,
                                window=window, dtype=self.dtype, device=self.device)
        # DecodeGraphs fuses the projections again if one was replaced: addresses after that.
        self._decode = storage, DecodeGraphs(m, storage)
        self._decode_weights = self._weight_addresses()
        return self._decode

    def kv_bytes_per_token(self) -> int:
        m = self.runner
        return 2 * m.num_layers * m.num_kv_heads * m.head_dim * torch.finfo(self.dtype).bits // 8

    def _check(self, prompts: list[list[int]], params: SamplingParams) -> None:
        check_token_ids(prompts, params, self.config.vocab_size)

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 kv: KVConfig | None = None) -> list[GenerationOutput]:
        kv = kv or KVConfig()
        self._check(prompts, params)
        with sdpa_kernel(_SDPA_BACKENDS):
            return self._generate(prompts, params, kv)

    def _generate(
        self, prompts: list[list[int]], params: SamplingParams, kv: KVConfig
    ) -> list[GenerationOutput]:
        dev, model = self.device, self.runner
        lengths = [len(p) for p in prompts]
        batch, width, max_new = len(prompts), max(lengths), params.max_new_tokens
        seqs = [Sequence(i, n) for i, n in enumerate(lengths)]
        # A policy that accumulates attention weights (H2O) needs them from every decode step,
        # which the captured graphs' fused attention does not produce.
        use_graphs = self.cuda_graphs and not POLICIES[kv.policy].uses_accumulated_attention
        capacities = layer_capacities(lengths, max_new, kv, model.num_layers)
        storage, graphs = self._static_decode(batch, capacities, kv) if use_graphs else (None, None)
        captures = graphs.captures if graphs is not None else 0
        cache = KVCache(
            num_layers=model.num_layers,
            num_heads=model.num_heads,
            num_kv_heads=model.num_kv_heads,
            head_dim=model.head_dim,
            prompt_lengths=lengths,
            capacity=capacities,
            kv=kv,
            dtype=self.dtype,
            device=dev,
            storage=storage,
        )
        self.last_batch_kv_bytes = cache.nbytes

        ids = torch.zeros((batch, width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p)
        ids = ids.to(dev)
        attention = CacheAttention(cache)
        attention.begin_prefill(width)
        hidden = model(ids, torch.arange(width, device=dev).expand(batch, width), attention.prefill)
        lengths_t = torch.tensor(lengths, device=dev)
        logits = model.logits(hidden[torch.arange(batch, device=dev), lengths_t - 1])
        for s in seqs:
            s.observe(s.prompt_len)
        evictions = (EvictionLog(batch, model.num_layers, model.num_kv_heads, width + max_new, dev)
                     if self.record_evictions and kv.policy != "dense" else None)
        if cache.needs_compression():  # only without keep_prompt: a long prompt is cut at once
            self._compress(cache, seqs)
            if evictions is not None:
                evictions.mark(cache, torch.arange(batch, device=dev), lengths_t)

        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        gen = torch.Generator(device=dev).manual_seed(seed)
        stop_ids = torch.tensor(params.stop_token_ids, dtype=torch.long, device=dev)
        out_tokens = torch.zeros((batch, max_new), dtype=torch.long, device=dev)
        out_logprobs = torch.zeros((batch, max_new), dtype=torch.float32, device=dev)
        rows = list(seqs)  # rows[r] = sequence in cache row r
        rows_t = torch.arange(batch, device=dev)
        positions = lengths_t.clone()
        if graphs is not None:
            graphs.start(positions)
        check_every = FINISH_CHECK_STEPS if len(stop_ids) else max_new  # no stop tokens: nothing to read
        checked = 0  # steps [0, checked) have been searched for stop tokens
        for step in range(max_new):
            uniforms = torch.rand(batch, generator=gen, device=dev)  # one per sequence, live or not
            tokens, logprobs = sample(logits, params, uniforms[rows_t])
            out_tokens[rows_t, step] = tokens
            out_logprobs[rows_t, step] = logprobs
            if step + 1 == max_new or (step + 1) % check_every == 0:
                self._settle_finishes(seqs, out_tokens, stop_ids, checked, step + 1, max_new)
                checked = step + 1
                live = [r for r, s in enumerate(rows) if not s.finished]
                if not live:
                    break
                if len(rows) - len(live) >= max(1, len(rows) // 4):
                    cache.select_rows(live)
                    if graphs is not None:
                        graphs.select_rows(live)
                    index = torch.tensor(live, device=dev)
                    rows, rows_t = [rows[r] for r in live], rows_t.index_select(0, index)
                    tokens, positions = tokens.index_select(0, index), positions.index_select(0, index)
            if graphs is not None:
                logits = graphs.step(tokens)
                cache.advance()
            else:
                attention.begin_decode(positions)
                hidden = model(tokens[:, None], positions[:, None], attention.decode)
                attention.end_decode()
                positions = positions + 1
            for s, n in zip(rows, cache.stored(), strict=True):
                if not s.finished:
                    s.record(step, n)
            if cache.needs_compression():
                for s, evicted in zip(rows, cache.compress(), strict=True):
                    if not s.finished:
                        s.record(step, 0, evicted)
                if evictions is not None:  # the token of `step` was the last one written
                    evictions.mark(cache, rows_t, lengths_t.index_select(0, rows_t) + step + 1)
            if graphs is None:
                logits = model.logits(hidden[:, 0])

        if graphs is not None:
            self.graph_captures += graphs.captures - captures
        token_lists, logprob_lists = out_tokens.tolist(), out_logprobs.tolist()
        per_token = cache.bytes_per_token
        outputs = [s.to_output(token_lists[s.index], logprob_lists[s.index], per_token) for s in seqs]
        if evictions is not None:
            for s, out in zip(seqs, outputs, strict=True):
                out.evicted_at = evictions.of(s.index, s.prompt_len + len(out.token_ids))
        return outputs

    @staticmethod
    def _settle_finishes(seqs: list[Sequence], out_tokens: torch.Tensor, stop_ids: torch.Tensor,
                         start: int, end: int, max_new: int) -> None:
        """Finish the open sequences whose first stop token lies in steps [start, end), and all at max_new."""
        open_seqs = [s for s in seqs if not s.finished]
        first_stop = [-1] * len(open_seqs)
        if len(stop_ids) and open_seqs:
            index = torch.tensor([s.index for s in open_seqs], device=out_tokens.device)
            hit = torch.isin(out_tokens[index, start:end], stop_ids)
            # argmax returns the first maximum: the first stop token of each row.
            first_stop = torch.where(hit.any(dim=1), hit.int().argmax(dim=1) + start, -1).tolist()
        for s, stop in zip(open_seqs, first_stop, strict=True):
            if stop >= 0:
                s.finish(stop, "stop")
            elif end == max_new:
                s.finish(max_new - 1, "length")
            else:
                s.settle(end)

    @staticmethod
    def _compress(cache: KVCache, rows: list[Sequence]) -> None:
        for s, evicted in zip(rows, cache.compress(), strict=True):
            if not s.finished:
                s.observe(0, evicted)
