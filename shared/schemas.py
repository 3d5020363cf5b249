"""Pydantic models shared by the trainer, the rollout workers and the coordination layer.

These travel as JSON through Redis and HTTP, so field names are part of the contract
(docs/internals.md). Fields may be added; existing ones are not renamed.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

# The run name every service, the CLI, compose, the chart and the demo use unless told otherwise.
DEFAULT_RUN = "demo"


def _encodable(text: str) -> str:
    # JSON may carry a lone surrogate (e.g. "\ud800"): a str that no UTF-8 consumer (tokenizer,
    # Redis payload, JSON answer) can take. Refused where it enters, as invalid input.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"text is not valid Unicode ({exc.reason} at position {exc.start})") from None
    return text


# A str that can be encoded as UTF-8 (JSON strings with lone surrogates are refused).
Text = Annotated[str, AfterValidator(_encodable)]


MAX_GROUP_ID_CHARS = 256


class PromptGroup(BaseModel):
    """One prompt to be sampled `samples` times (a GRPO group)."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1, max_length=MAX_GROUP_ID_CHARS)
    task: str = Field(min_length=1)
    prompt: str
    answer: str | None = None
    samples: int = Field(default=8, ge=1, le=1024)
    # Generation budget of this prompt; None: the worker's setting, else the task's default. Set
    # when the prompts come from a task built with options (longer additions need more tokens).
    max_new_tokens: int | None = Field(default=None, ge=1)
    metadata: dict[str, Any] = Field(default_factory=dict)


class KVStats(BaseModel):
    """KV-cache footprint of one generated sequence (sparse policies evict tokens)."""

    peak_tokens: int = Field(default=0, ge=0)
    peak_bytes: int = Field(default=0, ge=0)
    evicted: int = Field(default=0, ge=0)


class Sample(BaseModel):
    """One completion of a prompt, with what the trainer needs for the Sparse-RL correction."""

    completion: str
    prompt_ids: list[int]
    completion_ids: list[int]
    # Sampler log-probs, one per completion token (see docs/internals.md for the exact definition).
    logprobs: list[float]
    reward: float
    correct: bool
    finish_reason: str
    kv: KVStats = Field(default_factory=KVStats)
    # What the sampler's compressed cache hid from each query: per layer, KV head and position of
    # prompt + completion, the first query that no longer saw it (-1: never). Sent by a worker that
    # records it (SPARSECAST_RECORD_EVICTIONS) for a trainer that replays eviction, which then needs
    # no replay of its own (services/rollout/engine/eviction_log.py); None otherwise.
    evicted_at: list[int] | None = None

    @model_validator(mode="after")
    def _logprobs_match_tokens(self) -> Sample:
        if len(self.logprobs) != len(self.completion_ids):
            raise ValueError(
                f"logprobs has {len(self.logprobs)} entries for {len(self.completion_ids)} completion tokens"
            )
        return self


class SamplingInfo(BaseModel):
    """How a worker sampled: the trainer recomputes log-probs at the same temperature over the
    full vocabulary, so it checks these against its own before training on the samples."""

    temperature: float = Field(ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    engine: str = "native"
    kv_policy: str = "dense"
    kv_budget: int | None = None
    # The whole KV cache config of a sparse batch (the engine's KVConfig fields): what the trainer's
    # eviction replay (LossConfig.recompute = "replayed") runs the engine with.
    kv_config: dict[str, Any] | None = None


class Trajectory(BaseModel):
    """All samples of one prompt group, produced under one lease attempt."""

    group_id: str = Field(min_length=1)
    attempt: int = Field(ge=1)
    policy_version: int = Field(ge=0)
    worker_id: str = Field(min_length=1)
    task: str
    prompt: str
    samples: list[Sample]
    sampling: SamplingInfo | None = None  # None: an older worker that did not say (the trainer refuses it)
    created_at: float = Field(default_factory=time.time)
    # HMAC-SHA256 (hex) by the worker credential over everything else (shared.signing); None: an
    # unsigned trajectory, refused by a trainer that has a worker token.
    signature: str | None = Field(default=None, max_length=128)


class WorkerInfo(BaseModel):
    """What a rollout worker reports about itself on every heartbeat."""

    worker_id: str = Field(min_length=1, max_length=200)
    engine: str = "native"
    kv_policy: str = "dense"
    kv_budget: int | None = None
    weight_version: int = Field(default=0, ge=0)
    tokens_per_s: float = Field(default=0.0, ge=0.0)  # measured generation throughput; 0 = unknown
    download_mbps: float = Field(default=0.0, ge=0.0)  # measured patch download bandwidth
    # Share of recent wall time generation waited on weight sync (applying under the engine lock,
    # or idle while too far behind): the scheduler discounts tokens_per_s by it.
    sync_stall: float = Field(default=0.0, ge=0.0, le=1.0)
    leases: int = Field(default=0, ge=0)
    url: str | None = None
    # How it samples (the trainer flags a worker whose sampling it would refuse, shared.agreement).
    sampling: SamplingInfo | None = None
    # It signs its trajectories with a worker token (shared.signing); False also for older workers.
    signs: bool = False
    updated_at: float = Field(default_factory=time.time)


def one_line_error(error: Exception, subject: str = "value") -> str:
    """A validation error (pydantic's, or FastAPI's RequestValidationError: anything with an
    `errors()` list) or any other error as one readable line: `loc: msg; loc: msg`.
    `subject` names a failure with no location (the whole body, entry, ...)."""
    errors_of = getattr(error, "errors", None)
    errors = errors_of() if callable(errors_of) else None
    if errors:
        return "; ".join(
            f"{'.'.join(map(str, e.get('loc', ()))) or subject}: {e.get('msg', '')}" for e in errors
        )
    return str(error).replace("\n", " ")
