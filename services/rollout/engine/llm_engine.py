"""LLMEngine: batched generation with a budgeted, compacting KV cache (docs/engine.md).

One generate() call is one batch: a padded prefill of all prompts, then lockstep decode steps of
one token per live sequence. Finished sequences leave the batch once a quarter of the rows are
finished (moving the cache costs a copy, so it is amortised rather than done per finish).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import PretrainedConfig

from services.rollout.engine.config import GenerationOutput, KVConfig, SamplingParams
from services.rollout.engine.kv_cache import KVCache, cache_capacity
from services.rollout.engine.sampler import sample
from services.rollout.engine.sequence import Sequence
from services.rollout.models.decoder import DecoderLM, load_pretrained


class LLMEngine:
    name = "native"

    def __init__(self, model_or_config: DecoderLM | PretrainedConfig, *, device: str | torch.device = "cpu",
                 dtype: torch.dtype | None = None) -> None:
        """Wrap a DecoderLM, or build one with random weights from a transformers config (tests, benchmarks)."""
        model = model_or_config if isinstance(model_or_config, DecoderLM) else DecoderLM(model_or_config)
        if dtype is not None:
            model = model.to(dtype)
        self.model = model.to(device).eval().requires_grad_(False)
        self.device = torch.device(device)
        self.config = self.model.config
        # Allocated KV bytes of the last batch (the cache itself, not per sequence): for benchmarks.
        self.last_batch_kv_bytes = 0

    @classmethod
    def from_pretrained(cls, path: str | Path, *, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.bfloat16) -> LLMEngine:
        return cls(load_pretrained(path, device=device, dtype=dtype), device=device)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.model.embed_tokens.weight.dtype

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Live HF-named weights (keys as in the HF model's save_pretrained); patches apply in place."""
        return self.model.hf_state_dict()

    def weights_updated(self, names: set[str]) -> None:
        """Nothing to do: generation reads the state_dict tensors directly."""

    def kv_bytes_per_token(self) -> int:
        m = self.model
        return 2 * m.num_layers * m.num_kv_heads * m.head_dim * torch.finfo(self.dtype).bits // 8

    def _check(self, prompts: list[list[int]], params: SamplingParams) -> None:
        if not prompts:
            raise ValueError("no prompts")
        vocab = self.config.vocab_size
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise ValueError(f"prompt {i} is empty")
            if min(prompt) < 0 or max(prompt) >= vocab:
                raise ValueError(f"prompt {i} has token ids outside [0, {vocab})")
        if any(t < 0 or t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids outside [0, {vocab})")

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 kv: KVConfig | None = None) -> list[GenerationOutput]:
        kv = kv or KVConfig()
        self._check(prompts, params)
        dev, model = self.device, self.model
        lengths = [len(p) for p in prompts]
        batch, width, max_new = len(prompts), max(lengths), params.max_new_tokens
        seqs = [Sequence(i, n) for i, n in enumerate(lengths)]
        cache = KVCache(num_layers=model.num_layers, num_heads=model.num_heads, num_kv_heads=model.num_kv_heads,
                        head_dim=model.head_dim, prompt_lengths=lengths,
                        capacity=cache_capacity(lengths, max_new, kv), kv=kv, dtype=self.dtype, device=dev)
        self.last_batch_kv_bytes = cache.nbytes

        ids = torch.zeros((batch, width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p)
        ids = ids.to(dev)
        cache.begin_prefill(width)
        hidden = model(ids, torch.arange(width, device=dev).expand(batch, width), cache.prefill)
        lengths_t = torch.tensor(lengths, device=dev)
        logits = model.logits(hidden[torch.arange(batch, device=dev), lengths_t - 1])
        for s in seqs:
            s.observe(s.prompt_len)
        if cache.needs_compression():  # only without keep_prompt: a long prompt is cut at once
            self._compress(cache, seqs)

        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        gen = torch.Generator(device=dev).manual_seed(seed)
        stop_ids = torch.tensor(params.stop_token_ids, dtype=torch.long, device=dev)
        out_tokens = torch.zeros((batch, max_new), dtype=torch.long, device=dev)
        out_logprobs = torch.zeros((batch, max_new), dtype=torch.float32, device=dev)
        rows = list(seqs)  # rows[r] = sequence in cache row r
        rows_t = torch.arange(batch, device=dev)
        positions = lengths_t.clone()
        for step in range(max_new):
            uniforms = torch.rand(batch, generator=gen, device=dev)  # one per sequence, live or not
            tokens, logprobs = sample(logits, params, uniforms[rows_t])
            out_tokens[rows_t, step] = tokens
            out_logprobs[rows_t, step] = logprobs
            hit_stop = torch.isin(tokens, stop_ids).tolist() if len(stop_ids) else [False] * len(rows)
            for s, stopped in zip(rows, hit_stop, strict=True):
                if not s.finished:
                    s.num_generated = step + 1
                    if stopped:
                        s.finish_reason = "stop"
                    elif step + 1 == max_new:
                        s.finish_reason = "length"
            live = [r for r, s in enumerate(rows) if not s.finished]
            if not live:
                break
            if len(rows) - len(live) >= max(1, len(rows) // 4):
                cache.select_rows(live)
                index = torch.tensor(live, device=dev)
                rows, rows_t = [rows[r] for r in live], rows_t.index_select(0, index)
                tokens, positions = tokens.index_select(0, index), positions.index_select(0, index)
            cache.begin_decode(positions)
            hidden = model(tokens[:, None], positions[:, None], cache.decode)
            cache.end_decode()
            positions = positions + 1
            for s, n in zip(rows, cache.lengths, strict=True):
                if not s.finished:
                    s.observe(n)
            if cache.needs_compression():
                self._compress(cache, rows)
            logits = model.logits(hidden[:, 0])

        token_lists, logprob_lists = out_tokens.tolist(), out_logprobs.tolist()
        per_token = cache.bytes_per_token
        return [s.to_output(token_lists[s.index], logprob_lists[s.index], per_token) for s in seqs]

    @staticmethod
    def _compress(cache: KVCache, rows: list[Sequence]) -> None:
        for s, evicted in zip(rows, cache.compress(), strict=True):
            if not s.finished:
                s.observe(0, evicted)
