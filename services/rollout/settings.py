"""Settings of a rollout worker (env prefix SPARSECAST_, e.g. SPARSECAST_KV__POLICY=rkv).

The KV cache is one section, `kv` (`shared.kv.KVSettings`: SPARSECAST_KV__POLICY, __BUDGET, __BUFFER,
__KEEP_PROMPT, __LAYER_BUDGETS, __PYRAMID_BETA). The flat names it replaced (SPARSECAST_KV_POLICY,
SPARSECAST_KV_BUDGET, SPARSECAST_KV_BUFFER, SPARSECAST_KV_KEEP_PROMPT, SPARSECAST_KV_LAYER_BUDGETS)
still set it, with a deprecation warning; in Python, `kv=KVSettings(...)` is the only way.
"""

from __future__ import annotations

import os
import socket
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from shared.coord import CoordSettings
from shared.dtypes import ModelDtype
from shared.kv import KVSettings
from shared.relay import PEER_CONGESTION, WARM_UP_BYTES
from shared.sampling import FLAT_SAMPLING_NAMES, SamplingSettings
from shared.settings import ModelServiceSettings

# The flat names of the `kv` and `sync` sections' fields before they were sections (deprecated;
# FlatAliases).
FLAT_KV_NAMES: dict[str, tuple[str, str]] = {
    f"kv_{field}": ("kv", field) for field in ("policy", "budget", "buffer", "keep_prompt", "layer_budgets")
}
FLAT_SYNC_NAMES: dict[str, tuple[str, str]] = {
    "sync_streams": ("sync", "streams"), "sync_bandwidth_mbps": ("sync", "bandwidth_mbps"),
    "sync_poll_s": ("sync", "poll_s"), "relay": ("sync", "relay"),
}


class SyncSettings(BaseModel):
    """How a worker follows the registry's versions (on when registry_url is set)."""

    model_config = ConfigDict(extra="forbid")

    streams: int = Field(default=4, ge=1, description="parallel download streams")
    bandwidth_mbps: float | None = Field(default=None, gt=0, description="emulate a slow link")
    poll_s: float = Field(default=2.0, gt=0, description="polling fallback when Redis is not there")
    # Relay fan-out (shared.relay): serve what it fetches to peers at advertise_url (bytes as they
    # land; every receiver verifies) and fetch from peers first; announcing needs registry_token.
    relay: bool = False
    # A relaying worker that starts from weights of its own reads this much of the newest snapshot
    # through the relay before the first version, so that version's pipeline runs on connections
    # whose windows are open (shared.relay.Relay.warm_up). 0: off.
    warm_up_mb: int = Field(default=WARM_UP_BYTES >> 20, ge=0, le=4096,
                            description="relay: MiB of the newest snapshot read at start")
    # The TCP congestion control of the worker's listener, so of every hop it serves (shared.relay,
    # PEER_CONGESTION: why cubic rather than an app-limited BBR); "": the host's default.
    peer_congestion: str = Field(default=PEER_CONGESTION, pattern=r"^[a-z0-9_]{0,15}$",
                                 description="relay: TCP congestion control of served peers ('': the host's)")


class RolloutSettings(ModelServiceSettings):
    port: int = 8200
    # A HF model directory; unset: fetch config, tokenizer and weights from the registry, so a
    # worker needs nothing but the registry URL (stateless rollout).
    model: str | None = None
    served_model_name: str = "sparsecast"
    engine: Literal["native", "vllm"] = "native"
    dtype: ModelDtype = "bfloat16"
    data_dir: str = "./data/rollout"

    # The worker's KV cache (policy, budget, ...); /v1/generate requests and the budget the trainer
    # publishes with the weights override single fields of it (native engine; RolloutCore.kv_config).
    kv: KVSettings = Field(default_factory=KVSettings)
    # Ship with each sample what its compressed cache hid from each query (Sample.evicted_at), so a
    # trainer with LossConfig.recompute = "replayed" skips its own replay (native engine only; off:
    # the trainer replays). layers × KV heads × tokens integers a sample: for small models.
    record_evictions: bool = False

    # Request limits: a request asks for at most max_batch sequences (prompts × n).
    max_batch: int = Field(default=64, ge=1)
    max_new_tokens_limit: int = Field(default=4096, ge=1)
    # api_token: if set, /v1/generate and /v1/completions need it as a bearer token.

    # Weight sync (on when registry_url is set); registry_token: the worker's token for relay
    # announcements to the registry.
    sync: SyncSettings = Field(default_factory=SyncSettings)
    registry_token: str | None = None

    # Lease-driven worker loop (on when redis_url is set).
    worker_id: str = Field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    advertise_url: str = ""  # how others reach this worker's HTTP API (shown on the dashboard)
    # How the worker samples; must equal the trainer's (shared.sampling, shared.agreement).
    sampling: SamplingSettings = Field(default_factory=SamplingSettings)
    max_new_tokens: int | None = Field(default=None, ge=1, description="default: the task's own")
    coord: CoordSettings = Field(default_factory=CoordSettings)
    # The worker credential (SPARSECAST_WORKER_TOKEN): every trajectory is signed with it
    # (shared.signing); a trainer that has one refuses trajectories without its signature. A
    # worker never holds the publish token nor the object store's keys.
    worker_token: str | None = None
    # /healthz reports a background loop stuck when it makes no progress for this long: one
    # generation batch (or a model load) must fit in it (docs/coordination.md).
    stall_s: float = Field(default=600.0, gt=0)

    flat_aliases = FLAT_KV_NAMES | FLAT_SYNC_NAMES | FLAT_SAMPLING_NAMES

    @model_validator(mode="after")
    def _relay_needs_its_addresses(self) -> RolloutSettings:
        if self.sync.relay and not (self.registry_url and self.advertise_url and self.registry_token):
            raise ValueError("relay needs registry_url, advertise_url (where peers reach this worker) "
                             "and registry_token (to announce to the registry)")
        return self
