"""Request and response bodies of the rollout HTTP API (validation lives here, not in handlers)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from shared.kv import Policy
from shared.schemas import KVStats, Text


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompts: list[Text] | None = Field(default=None, description="texts, tokenized by the model's tokenizer")
    prompt_ids: list[list[int]] | None = Field(default=None, description="token ids, used as given")
    n: int = Field(default=1, ge=1, description="samples per prompt")
    max_tokens: int = Field(default=256, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    stop_token_ids: list[int] | None = Field(default=None, description="default: the tokenizer's EOS")
    seed: int | None = None
    kv_policy: Policy | None = Field(default=None, description="default: the server's")
    kv_budget: int | None = Field(default=None, ge=1)
    kv: dict[str, Any] = Field(
        default_factory=dict, description="other KVConfig fields (window, kernel, ...)"
    )

    @model_validator(mode="after")
    def _one_prompt_form(self) -> GenerateRequest:
        if (self.prompts is None) == (self.prompt_ids is None):
            raise ValueError("give exactly one of 'prompts' (texts) or 'prompt_ids' (token ids)")
        items = self.prompts if self.prompts is not None else self.prompt_ids
        if not items:
            raise ValueError("no prompts given")
        for i, item in enumerate(items):
            if len(item) == 0:
                raise ValueError(f"prompt {i} is empty")
        return self


class Completion(BaseModel):
    prompt_index: int
    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    kv: KVStats


class GenerateResponse(BaseModel):
    weight_version: int
    fingerprint: str
    engine: str
    kv_policy: str
    kv_budget: int | None
    completions: list[Completion]
    seconds: float
    tokens_per_s: float


class CompletionRequest(BaseModel):
    """The OpenAI /v1/completions subset sparsecast serves."""

    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields we do not use

    model: Text | None = None
    prompt: Text | list[Text] | list[int] | list[list[int]]
    max_tokens: int = Field(default=16, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=1, description="only the sampled token's log-prob")
    stop: Text | list[Text] | None = None
    seed: int | None = None
    stream: bool = False
    echo: bool = False

    @model_validator(mode="after")
    def _supported(self) -> CompletionRequest:
        if self.stream:
            raise ValueError("stream=true is not supported")
        if self.echo:
            raise ValueError("echo=true is not supported")
        if isinstance(self.stop, list) and len(self.stop) > 4:
            raise ValueError("at most 4 stop sequences")
        return self

    def prompt_list(self) -> list[str] | list[list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [p]  # type: ignore[return-value]
        return p  # type: ignore[return-value]

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class WeightsInfo(BaseModel):
    version: int
    fingerprint: str
    sync_state: str
    last_error: str | None
    last_sync: dict[str, Any]
    history: list[dict[str, Any]]
    engine: str
    registry_url: str | None
    # The KV budget the next batch uses (published with the version, else the worker's own; None: dense).
    kv_budget: int | None = None
    # Generation pause per weight swap over the recent swaps: count, median_s, p99_s, max_s.
    swap_pause: dict[str, float | int] = Field(default_factory=dict)
