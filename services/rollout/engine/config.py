"""Inputs and outputs of the generation engine.

`SamplingParams` and `KVConfig` are pydantic models so the HTTP layer can take them straight from
a request body (invalid values raise `pydantic.ValidationError`, a `ValueError`). Every eviction
constant is a `KVConfig` field: those a worker is configured with come from `shared.kv.KVSettings`
(its `kv` section, taken as is), the engine-only ones are declared here; the defaults are those of
Sparse-RL's R-KV setup (docs/engine.md; arXiv 2601.10079: λ = 0.1, observation window 8, pooling
kernel 7, re-compression every 128 decode steps).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from shared.kv import KVSettings, Policy
from shared.schemas import KVStats

FinishReason = Literal["stop", "length"]


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(default=1.0, ge=0.0, description="0 = greedy")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, description="0 = whole vocabulary")
    max_new_tokens: int = Field(default=256, ge=1)
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = Field(default=None, description="same seed + same prompts = same samples")


class KVConfig(KVSettings):
    """The KV configuration of one engine call: the section (policy, budget, buffer, keep_prompt,
    layer_budgets, pyramid_beta; `shared.kv.KVSettings`, whose defaults it keeps) plus the
    engine-only constants below (extra fields refused, frozen, as the section)."""

    # The one default that differs from the section's: an engine call that names no KV policy
    # keeps every token (a worker's section defaults to R-KV).
    policy: Policy = "dense"
    window: int = Field(
        default=8, ge=1, description="observation window: recent queries that score, recent keys always kept"
    )
    kernel: int = Field(default=7, ge=1, description="max/avg pooling kernel over importance (odd)")
    pooling: Literal["max", "avg"] = "max"
    mix_lambda: float = Field(
        default=0.1, ge=0.0, le=1.0, description="R-KV: λ·importance − (1−λ)·redundancy"
    )
    # Below 0, orthogonal keys (and every free slot's zero key) would count as near-duplicates.
    similarity_threshold: float = Field(
        default=0.5, ge=0.0, le=1.0, description="R-KV near-duplicate cosine"
    )
    sink_tokens: int = Field(default=4, ge=0, description="streaming: first tokens always kept")

    @classmethod
    def of(cls, section: KVSettings, **overrides: Any) -> KVConfig:
        """The engine's configuration for `section` (a worker's `kv` settings) with `overrides`
        (a request's or the trainer's directive's values) replacing single fields, validated."""
        return cls.model_validate(section.model_dump() | overrides)

    @property
    def sparse_budget(self) -> int | None:
        """The budget a sparse policy keeps; None for dense (which keeps everything)."""
        return None if self.policy == "dense" else self.budget

    @model_validator(mode="after")
    def _consistent(self) -> KVConfig:
        if self.kernel % 2 == 0:
            raise ValueError(f"kernel must be odd, got {self.kernel}")
        if self.policy == "dense" and self.layer_budgets != "uniform":
            raise ValueError("per-layer budgets need an evicting policy, not dense")
        if self.policy == "streaming":
            if self.budget < self.sink_tokens + 1:
                raise ValueError(f"budget {self.budget} must exceed sink_tokens {self.sink_tokens}")
        elif self.policy != "dense" and self.budget < self.window:
            raise ValueError(f"budget {self.budget} must be at least the window {self.window}")
        return self

    @property
    def min_layer_budget(self) -> int:
        """The fewest tokens a pyramid gives a layer (unless `budget` itself is smaller): every
        compression keeps the `window` most recent tokens, and streaming its sinks too."""
        return self.window + (self.sink_tokens if self.policy == "streaming" else 0)


def layer_budgets(kv: KVConfig, num_layers: int) -> list[int]:
    """Evictable tokens each layer keeps after a compression; they sum to num_layers × budget.

    pyramid (PyramidKV, Cai et al. 2024, its budget formula as in KVCache-Factory): an arithmetic
    sequence from the bottom layer's 2·budget − low down to the top layer's low = budget / beta
    (raised to `min_layer_budget`, at most `budget`: then every layer keeps `budget`), mean
    `budget`; rounded to integers by largest remainder so the total is exact and no layer drops
    below the low end.
    """
    if kv.layer_budgets == "uniform" or num_layers == 1:
        return [kv.budget] * num_layers
    low = min(float(kv.budget), max(kv.budget / kv.pyramid_beta, float(kv.min_layer_budget)))
    high = 2 * kv.budget - low
    ideal = [high - (high - low) * layer / (num_layers - 1) for layer in range(num_layers)]
    budgets = [int(b) for b in ideal]
    short = num_layers * kv.budget - sum(budgets)
    # Largest fractional parts first; ties go to the lower layer (the pyramid's wide end).
    for layer in sorted(range(num_layers), key=lambda i: (budgets[i] - ideal[i], i))[:short]:
        budgets[layer] += 1
    return budgets


@dataclass
class GenerationOutput:
    token_ids: list[int]
    # Sampler log-prob of each sampled token: fp32 log_softmax(logits / T) over the full
    # vocabulary, before top-k/top-p (T = 0: log_softmax(logits)); see docs/engine.md.
    logprobs: list[float]
    finish_reason: FinishReason
    kv: KVStats
    # Per layer, KV head and position of prompt + completion, the first query that no longer saw it
    # (-1: never evicted); only from an engine with record_evictions on (engine/eviction_log.py).
    evicted_at: list[int] | None = None


def check_token_ids(prompts: list[list[int]], params: SamplingParams, vocab_size: int) -> None:
    """Raise ValueError for a request no engine can run: no prompts, an empty prompt, or token ids
    (prompt or stop) outside the vocabulary. Shared by every engine so all refuse alike."""
    if not prompts:
        raise ValueError("no prompts")
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"prompt {i} is empty")
        if min(prompt) < 0 or max(prompt) >= vocab_size:
            raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {vocab_size})")
    if any(t < 0 or t >= vocab_size for t in params.stop_token_ids):
        raise ValueError(f"stop_token_ids outside the vocabulary [0, {vocab_size})")


__all__ = [
    "FinishReason",
    "GenerationOutput",
    "KVConfig",
    "KVStats",
    "Policy",
    "SamplingParams",
    "check_token_ids",
    "layer_budgets",
]
