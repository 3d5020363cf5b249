"""The registry as a vLLM weight-transfer backend ("sparsecast"): a stock `vllm serve` pulls
published versions of a run itself (docs/vllm.md, "Stock `vllm serve` with the registry as weight
source").

vLLM's native RL weight-update protocol (init → start → update → finish, driven by vLLM's own HTTP
routes or by `services.rollout.vllm.plugin`'s) reaches this engine in every vLLM worker process:

- `init_transfer_engine({"registry_url", "run", "token"?, "version"?})` loads an HF-named CPU copy
  of the served model directory's weights (`load_hf_state`, the VLLMEngine's copy) and finds which
  published version it holds: `version` if given (its fingerprint is checked), else the newest
  version with the same fingerprint, else none (the first pull then takes the snapshot path).
- `update_weights({"version": v})` (None: the head) runs the one weight sync
  (`shared.registry.sync.sync_weights`: plan, ranged sha256-verified downloads, patches applied in
  place with their target fingerprints checked, the snapshot fallback), then reloads the changed
  tensors into vLLM completed to whole fused layers, in place (the VLLMEngine's reload).

Start and finish are no-ops: the reload runs per chunk inside `update_weights`, as for engines
that apply weights in place. The prefix cache is the scheduler's; vLLM's pause (which clears it)
around the update keeps stale KV out, which is what the sparsecast HTTP route does.

On failure the weights stay some verified version (a patch applies all-or-nothing); the error
says which (`HELD`), so the HTTP side can report it. vLLM imports this module lazily, in its
worker processes only (registered as backend "sparsecast" by `services.rollout.vllm.plugin.register`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.model_executor.model_loader.reload.inplace import reload_weights

from services.rollout.vllm.engine import fused_groups, load_hf_state, whole_layer_chunks
from services.rollout.vllm.ext import packed_modules, redispatch_cpu_gemms
from services.rollout.vllm.plugin import HELD
from shared.patch import fingerprint
from shared.registry.client import RegistryClient
from shared.registry.sync import SyncResult, WeightTarget, sync_weights

# Under vLLM's logger tree: vllm serve prints these with its own (it configures only "vllm.*").
log = logging.getLogger("vllm.sparsecast")
T = TypeVar("T")

@dataclass
class RegistryInitInfo(WeightTransferInitInfo):
    registry_url: str
    run: str
    token: str | None = None
    # The version the served model directory holds; None: found by fingerprint.
    version: int | None = None
    streams: int = 4


@dataclass
class RegistryUpdateInfo(WeightTransferUpdateInfo):
    version: int | None = None  # None: the run's head


class _Changes(WeightTarget):
    """The HF-named copy as a sync target, remembering what changed and the last verified version."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        super().__init__(state)
        self.changed: set[str] = set()
        self.version: int | None = None
        self.fingerprint: str | None = None

    def updated(self, names: set[str]) -> None:
        self.changed |= names

    def reached(self, version: int, fingerprint: str) -> None:
        self.version, self.fingerprint = version, fingerprint


def _run(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to completion from vLLM's (synchronous) worker call; in a thread of its
    own if the caller already runs an event loop (vLLM in-process under an async server)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


class RegistryWeightTransferEngine(WeightTransferEngine[RegistryInitInfo, RegistryUpdateInfo]):
    init_info_cls = RegistryInitInfo
    update_info_cls = RegistryUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.source: RegistryInitInfo | None = None
        self._state: dict[str, torch.Tensor] = {}
        self._groups: dict[str, list[str]] = {}
        self.version: int | None = None
        self.fingerprint: str | None = None

    def _client(self) -> RegistryClient:
        assert self.source is not None
        return RegistryClient(self.source.registry_url, self.source.run, token=self.source.token,
                              streams=self.source.streams)

    def init_transfer_engine(self, init_info: RegistryInitInfo) -> None:
        if not self._state:  # a later init (another token, run) keeps the weights served now
            path = Path(self.model_config.model)
            if not (path / "config.json").is_file():
                raise ValueError(f"the sparsecast backend needs a local HF model directory; "
                                 f"vLLM serves {self.model_config.model!r}")
            tied = bool(getattr(self.model_config.hf_config, "tie_word_embeddings", False))
            dtype = self.model_config.dtype  # resolved to a torch dtype once vLLM is up
            assert isinstance(dtype, torch.dtype), dtype
            self._state = load_hf_state(path, dtype, tied=tied)
            self._groups = fused_groups(self._state, packed_modules(self.model))
            self.fingerprint = fingerprint(self._state)
        self.source = init_info

        async def identify() -> int | None:
            async with self._client() as client:
                if init_info.version is None:
                    return await client.version_of(str(self.fingerprint))
                manifest = await client.manifest(init_info.version)
                if manifest.fingerprint != self.fingerprint:
                    raise ValueError(f"the served weights (fingerprint {self.fingerprint}) are not v"
                                     f"{init_info.version} of run {init_info.run!r} ({manifest.fingerprint})")
                return init_info.version

        self.version = _run(identify())
        log.info("sparsecast weight source: run %r at %s; served weights are %s", init_info.run,
                 init_info.registry_url, "unpublished" if self.version is None else f"v{self.version}")

    def start_weight_update(self) -> None:
        """Nothing to prepare: each reload in update_weights is a complete in-place reload."""

    def finish_weight_update(self) -> None:
        """Nothing to finalise (see start_weight_update)."""

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class also synchronizes the accelerator, which a CPU build does not have; the
        # in-place reload copies synchronously.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: RegistryUpdateInfo) -> None:
        if self.source is None:
            raise RuntimeError("call init_weight_transfer_engine with the registry URL and run first")
        target = _Changes(self._state)

        async def pull() -> SyncResult:
            async with self._client() as client:
                return await sync_weights(client, target, self.version, update_info.version)

        wanted = "the head" if update_info.version is None else f"v{update_info.version}"
        try:
            result = _run(pull())
        except Exception as exc:
            self._reload(target)  # what did change is verified: serve it
            held = HELD.format(version=self.version if self.version is not None else -1)
            raise RuntimeError(f"pull of {wanted} of run {self.source.run!r} failed: {exc}; {held}") from exc
        self._reload(target)
        self.version, self.fingerprint = result.version, result.fingerprint
        log.info("sparsecast: v%d by %s (%d bytes, %.2f s%s); %d tensors reloaded", result.version,
                 result.path, result.bytes, result.seconds, ", after a fallback" if result.fell_back else "",
                 len(target.changed))

    def _reload(self, target: _Changes) -> None:
        """Load the changed tensors into vLLM's model in place, whole fused layers per call."""
        if target.version is not None:
            self.version, self.fingerprint = target.version, target.fingerprint
        for chunk in whole_layer_chunks(self._state, target.changed, self._groups):
            reload_weights(self.vllm_config, self.model, weights_iterator=list(chunk.items()),
                           weights_path=None, is_checkpoint_format=True)
            redispatch_cpu_gemms(self.model, chunk)

    def shutdown(self) -> None:
        self.source = None
