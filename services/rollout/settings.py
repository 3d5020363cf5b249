"""Settings of a rollout worker (env prefix SPARSECAST_, e.g. SPARSECAST_KV_POLICY=rkv)."""

from __future__ import annotations

import os
import socket
from typing import Literal

from pydantic import Field, model_validator

from shared.coord import CoordSettings
from shared.dtypes import ModelDtype
from shared.kv import DEFAULT_KV_BUDGET, DEFAULT_KV_BUFFER, LayerBudgets, Policy
from shared.settings import ModelServiceSettings


class RolloutSettings(ModelServiceSettings):
    port: int = 8200
    # A HF model directory; unset: fetch config, tokenizer and weights from the registry, so a
    # worker needs nothing but the registry URL (stateless rollout).
    model: str | None = None
    served_model_name: str = "sparsecast"
    engine: Literal["native", "vllm"] = "native"
    dtype: ModelDtype = "bfloat16"
    data_dir: str = "./data/rollout"

    # Default KV policy and budget; /v1/generate requests may override them (native engine).
    kv_policy: Policy = "rkv"
    kv_budget: int = Field(default=DEFAULT_KV_BUDGET, ge=1)
    kv_buffer: int = Field(default=DEFAULT_KV_BUFFER, ge=1)
    # True: the prompt is never evicted and the budget counts generated tokens only. False:
    # Sparse-RL's semantics, the budget counts every cached token and the prompt becomes evictable
    # at the first compression.
    kv_keep_prompt: bool = True
    # How sparse policies spread the budget over the layers (uniform, or PyramidKV's pyramid).
    kv_layer_budgets: LayerBudgets = "uniform"

    # Request limits: a request asks for at most max_batch sequences (prompts × n).
    max_batch: int = Field(default=64, ge=1)
    max_new_tokens_limit: int = Field(default=4096, ge=1)
    # api_token: if set, /v1/generate and /v1/completions need it as a bearer token.

    # Weight sync (on when registry_url is set).
    sync_streams: int = Field(default=4, ge=1)
    sync_bandwidth_mbps: float | None = Field(default=None, gt=0, description="emulate a slow link")
    sync_poll_s: float = Field(default=2.0, gt=0)
    # Relay fan-out (shared.relay): serve verified pieces to peers at advertise_url and fetch from
    # peers first; announcing to the registry needs its token.
    relay: bool = False
    registry_token: str | None = None

    # Lease-driven worker loop (on when redis_url is set).
    worker_id: str = Field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    advertise_url: str = ""  # how others reach this worker's HTTP API (shown on the dashboard)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    max_new_tokens: int | None = Field(default=None, ge=1, description="default: the task's own")
    coord: CoordSettings = Field(default_factory=CoordSettings)
    # /healthz reports a background loop stuck when it makes no progress for this long: one
    # generation batch (or a model load) must fit in it (docs/coordination.md).
    stall_s: float = Field(default=600.0, gt=0)

    @model_validator(mode="after")
    def _relay_needs_its_addresses(self) -> RolloutSettings:
        if self.relay and not (self.registry_url and self.advertise_url and self.registry_token):
            raise ValueError("relay needs registry_url, advertise_url (where peers reach this worker) "
                             "and registry_token (to announce to the registry)")
        return self
