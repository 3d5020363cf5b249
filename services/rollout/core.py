"""The rollout core: one engine, its tokenizer and the version of the weights it holds.

No HTTP here. Every use of the engine — a generation batch or a weight update — holds
`engine_lock`, so weights change only at batch boundaries and no sequence mixes two versions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import statistics
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase

from services.rollout.engine.config import GenerationOutput, KVConfig, SamplingParams, check_token_ids
from services.rollout.settings import RolloutSettings
from shared.agreement import DENSE_ONLY_ENGINES
from shared.coord.scheduling import StallMeter
from shared.dtypes import DTYPES
from shared.patch import fingerprint

log = logging.getLogger(__name__)



class Engine(Protocol):
    name: str

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, kv: KVConfig
    ) -> list[GenerationOutput]: ...

    def state_dict(self) -> dict[str, torch.Tensor]: ...

    def weights_updated(self, names: set[str]) -> None: ...


def load_engine(settings: RolloutSettings, model_dir: Path) -> Engine:
    dtype = DTYPES[settings.dtype]
    if settings.engine == "vllm":
        if settings.record_evictions:
            raise ValueError("record_evictions needs the native engine (vLLM does not report its eviction)")
        from services.rollout.vllm.engine import VLLMEngine

        return VLLMEngine.from_pretrained(model_dir, device=settings.resolved_device(), dtype=dtype)
    from services.rollout.engine import LLMEngine

    engine = LLMEngine.from_pretrained(model_dir, device=settings.resolved_device(), dtype=dtype)
    engine.record_evictions = settings.record_evictions
    if engine.dtype != dtype:
        log.info("generation computes in %s: this CPU has no native %s products", engine.dtype, dtype)
    return engine


@dataclass
class Batch:
    """One engine call: the version of the weights that produced every output in it, and the KV
    configuration it ran with."""

    version: int
    fingerprint: str
    outputs: list[GenerationOutput]
    seconds: float
    kv: KVConfig

    @property
    def generated_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)


@dataclass
class WeightState:
    version: int = 0
    fingerprint: str = ""
    sync_state: str = "idle"  # idle | downloading | decoding | applying | failed
    last_error: str | None = None
    last_sync: dict[str, Any] = field(default_factory=dict)
    # The KV budget published with `version` (the registry manifest's RolloutDirective; None: the
    # worker's own), and the version it was read for (None: not read yet, the sync loop retries).
    kv_budget: int | None = None
    kv_budget_of: int | None = None


class RolloutCore:
    def __init__(self, settings: RolloutSettings, engine: Engine, tokenizer: PreTrainedTokenizerBase,
                 model_dir: Path, version: int = 0) -> None:
        self.settings = settings
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_dir = model_dir
        self.config = AutoConfig.from_pretrained(model_dir)
        self.max_positions = int(getattr(self.config, "max_position_embeddings", 1 << 30))
        self.engine_lock = asyncio.Lock()
        self.sync_stall = StallMeter()  # generation lost to weight sync, for the scheduler
        # Seconds the engine was held per weight swap (the generation pause of a version), the
        # last ones; swap_observers hear each (the service's Prometheus histogram).
        self.swap_pauses: deque[float] = deque(maxlen=1024)
        self.swaps = 0  # swaps ever done
        self.swap_observers: list[Callable[[float], None]] = []
        self.weights = WeightState(version=version, fingerprint=fingerprint(engine.state_dict()))
        self.generated_tokens = 0
        self.generation_seconds = 0.0

    @classmethod
    def from_model_dir(cls, settings: RolloutSettings, model_dir: Path, version: int = 0) -> RolloutCore:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        return cls(settings, load_engine(settings, model_dir), tokenizer, model_dir, version)

    # -- generation --

    def default_stop_ids(self) -> tuple[int, ...]:
        eos = self.tokenizer.eos_token_id
        return (eos,) if eos is not None else ()

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text).input_ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def kv_config(self, policy: str | None = None, budget: int | None = None, **extra: Any) -> KVConfig:
        """The KV configuration of a batch: the worker's `kv` section with a request's own values
        (None: not given), else the budget published with the weights held
        (services.rollout.sync), in place of single fields."""
        if self.engine.name in DENSE_ONLY_ENGINES:
            return KVConfig(policy="dense")
        section = self.settings.kv
        overrides: dict[str, Any] = {"policy": policy or section.policy,
                                     "budget": budget or self.weights.kv_budget or section.budget}
        if overrides["policy"] == "dense":
            overrides["layer_budgets"] = "uniform"  # a dense cache spreads no budget over layers
        overrides |= {name: value for name, value in extra.items() if value is not None}
        return KVConfig.of(section, **overrides)

    def check_lengths(self, prompts: list[list[int]], max_new_tokens: int) -> None:
        """Raise ValueError for a request the engine would refuse, before it takes the engine lock:
        bad token ids, or a prompt that cannot fit the model's context with its new tokens."""
        check_token_ids(prompts, SamplingParams(max_new_tokens=max_new_tokens), self.config.vocab_size)
        for i, ids in enumerate(prompts):
            if len(ids) + max_new_tokens > self.max_positions:
                raise ValueError(
                    f"prompt {i} has {len(ids)} tokens; with max_tokens={max_new_tokens} it exceeds the "
                    f"model's context of {self.max_positions}"
                )

    async def generate(self, prompts: list[list[int]], params: SamplingParams,
                       kv: KVConfig | None = None) -> Batch:
        """One engine batch; `kv` None: the worker's default (`kv_config()`) for the weights it
        runs on, read under the engine lock so a budget swapped with the weights applies at once."""
        async with self.engine_lock:
            version, fp = self.weights.version, self.weights.fingerprint
            kv = kv or self.kv_config()
            t0 = time.perf_counter()
            outputs = await asyncio.to_thread(self.engine.generate, prompts, params, kv)
            seconds = time.perf_counter() - t0
        batch = Batch(version, fp, outputs, seconds, kv)
        self.generated_tokens += batch.generated_tokens
        self.generation_seconds += seconds
        return batch

    @contextlib.asynccontextmanager
    async def weights_swap(self) -> AsyncIterator[None]:
        """Hold the engine for a weight change (a batch boundary); the time it is held counts as
        stalled on sync, and is the generation pause of the swap (swap_pauses)."""
        async with self.engine_lock:
            t0 = time.perf_counter()
            try:
                yield
            finally:
                pause = time.perf_counter() - t0
                self.sync_stall.add(pause)
                self.swap_pauses.append(pause)
                self.swaps += 1
                for observe in self.swap_observers:
                    observe(pause)

    def pauses_since(self, swaps: int) -> list[float]:
        """The pauses of the swaps done after the first `swaps` (those still kept)."""
        n = min(self.swaps - swaps, len(self.swap_pauses))
        return list(self.swap_pauses)[len(self.swap_pauses) - n:]

    def pause_summary(self) -> dict[str, float | int]:
        """The recent swaps' generation pauses: count, median, p99 and max seconds."""
        pauses = sorted(self.swap_pauses)
        if not pauses:
            return {"count": 0}
        return {"count": len(pauses), "median_s": statistics.median(pauses),
                "p99_s": pauses[min(len(pauses) - 1, math.ceil(0.99 * len(pauses)) - 1)], "max_s": pauses[-1]}

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.generation_seconds if self.generation_seconds else 0.0
