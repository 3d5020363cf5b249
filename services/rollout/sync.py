"""Live weight sync: download in the background, apply at a batch boundary, verify, report.

The sync itself is shared.registry.sync's `sync_weights`; this module gives it the engine as a
`WeightTarget` (writes hold the engine lock, so they land at a batch boundary) and runs the loop
that follows the registry's head. The weights are always exactly some published version; nothing
unverified is ever served.

Each version's manifest may carry a RolloutDirective (the trainer's adaptive KV budget,
services.trainer.kv_budget). The sync reads the target's manifest before it swaps, and the budget
changes with the weights under the same engine lock: every batch on a version's weights uses that
version's budget. If the manifest cannot be read, the weights still move, the old budget stays,
and the loop reads it again on its next round (batches meanwhile report the budget they used).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, MutableMapping
from pathlib import Path
from typing import Any, TypeVar

import httpx
import torch
from pydantic import ValidationError
from safetensors.torch import save_file

from services.rollout.core import RolloutCore
from shared.health import Liveness
from shared.registry.client import RegistryClient
from shared.registry.errors import RegistryHTTPError
from shared.registry.sync import WeightTarget, sync_weights
from shared.registry.wire import Manifest
from shared.relay import WARM_UP_BYTES, Relay
from shared.retry import Outage, transient

log = logging.getLogger(__name__)
T = TypeVar("T")
LOOP = "sync"  # the sync loop's name in Liveness
# A wait for the next version returns at least this often, so the loop beats (shared.health).
VERSION_WAIT_S = 30.0


class SyncFailed(Exception):
    pass


class RunNotReady(Exception):
    """The registry has no version of the run yet: its trainer has not published v0."""


async def check_run_ready(client: RegistryClient) -> None:
    """Raise RunNotReady until the run has a version (the trainer publishes its model files first,
    then v0, so a run with a version also has what a stateless worker needs)."""
    if await client.latest() is None:
        raise RunNotReady(f"run {client.run!r} has no versions yet: waiting for its trainer to publish v0")


async def bootstrap_model(client: RegistryClient, dest: Path) -> int:
    """A worker with no weights: fetch the run's model files and its latest weights into `dest`
    (a HF model directory any engine can load). Returns the version written."""
    dest.mkdir(parents=True, exist_ok=True)
    await client.fetch_model_files(dest)
    state: dict[str, torch.Tensor] = {}
    result = await sync_weights(client, state, None)  # snapshot + chain, each verified
    await asyncio.to_thread(save_file, {k: v.contiguous() for k, v in state.items()},
                            str(dest / "model.safetensors"))
    return result.version


class EngineWeights(WeightTarget):
    """The serving engine's weights: written under the engine lock, status kept in core.weights.
    `budgets`: the KV budget published with versions the sync may reach (read beforehand)."""

    def __init__(self, core: RolloutCore, budgets: dict[int, int | None] | None = None) -> None:
        super().__init__()
        self.core = core
        self.budgets = budgets or {}

    def state(self) -> MutableMapping[str, torch.Tensor]:
        return self.core.engine.state_dict()

    def writing(self) -> contextlib.AbstractAsyncContextManager[object]:
        return self.core.weights_swap()  # the engine lock; its hold counts as stalled on sync

    def updated(self, names: set[str]) -> None:
        self.core.engine.weights_updated(names)

    def reached(self, version: int, fingerprint: str) -> None:
        weights = self.core.weights
        weights.version, weights.fingerprint = version, fingerprint
        if version in self.budgets:  # else the old budget stays until the loop reads this one's
            weights.kv_budget, weights.kv_budget_of = self.budgets[version], version

    def phase(self, phase: str) -> None:
        self.core.weights.sync_state = phase


class WeightSync:
    def __init__(self, core: RolloutCore, client: RegistryClient, poll_s: float = 2.0, *,
                 registry: Outage | None = None, liveness: Liveness | None = None,
                 warm_up_bytes: int = WARM_UP_BYTES) -> None:
        self.core = core
        self.client = client
        self.poll_s = poll_s
        self.warm_up_bytes = warm_up_bytes  # relaying workers only (warm_up); 0: off
        self.registry = registry or Outage("registry", log)
        self.liveness = liveness or Liveness()
        self.syncs = 0
        self.fallbacks = 0
        self.failures = 0
        self.bytes = 0
        self.download_mbps = 0.0
        # The last syncs (version reached, fingerprint, path, bytes, seconds): shown on /v1/weights.
        self.history: deque[dict[str, Any]] = deque(maxlen=256)
        # Why the weights cannot reach the head now (a corrupt object nothing routes around yet);
        # None once a sync succeeds. A stuck worker is not ready (/readyz), and keeps retrying.
        self.stuck: str | None = None

    async def run(self, stop: asyncio.Event) -> None:
        """Follow the registry's head. An unreachable registry is waited out (logged once per
        outage, shared.retry); a sync that fails for another reason is retried with backoff too."""
        backoff = self.poll_s
        relay = self.client.downloader.relay
        # A relaying worker re-announces its holdings between versions to keep its place in the
        # pipeline's order (shared.relay.Relay.keep_place), so it wakes at least that often.
        wait_s = min(VERSION_WAIT_S, relay.announce_every_s) if isinstance(relay, Relay) else VERSION_WAIT_S
        if isinstance(relay, Relay) and self.warm_up_bytes:
            self.liveness.beat(LOOP)
            await _unless_stopped(self.warm_up(relay), stop)
        while not stop.is_set():
            self.liveness.beat(LOOP)
            if self.core.weights.kv_budget_of != self.core.weights.version:
                await self.refresh_budget()  # bootstrapped, or its manifest could not be read
            if isinstance(relay, Relay):
                await relay.keep_place(self.client.downloader)
            try:
                target = await _unless_stopped(
                    self.client.wait_for_version(self.core.weights.version, timeout=wait_s,
                                                 poll_s=self.poll_s), stop)
                if target is not None and target > self.core.weights.version:
                    await self.sync_to(target)
                self.registry.ok()
                self.stuck = None
                backoff = self.poll_s
            except (SyncFailed, RegistryHTTPError, httpx.HTTPError, OSError) as exc:
                self.failures += 1
                cause = exc.__cause__ if isinstance(exc, SyncFailed) and exc.__cause__ is not None else exc
                if transient(cause):
                    await self.registry.failed(cause, stop)
                    continue
                self.stuck = f"weights stuck at v{self.core.weights.version}: {exc}"
                log.warning("weight sync failed (%s); retrying in %.1fs", exc, backoff)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=backoff)
                backoff = min(backoff * 2, 30.0)

    async def warm_up(self, relay: Relay) -> bool:
        """A worker that starts from weights of its own takes its place in the relay's pipeline
        before the first version, on the first pieces of the newest snapshot (shared.relay.Relay.
        warm_up). Skipped without a plan now (the first version then comes on new connections)."""
        try:
            plan = await self.client.plan(None)
        except (RegistryHTTPError, httpx.HTTPError, OSError, ValidationError) as exc:
            log.warning("relay warm-up skipped: no plan for a new worker (%s)", exc)
            return False
        return await relay.warm_up(self.client.downloader, plan, self.warm_up_bytes)

    async def sync_to(self, target: int | None = None) -> int:
        """Bring the engine's weights to `target` (None: latest). Returns the version now held."""
        weights = self.core.weights
        manifest = await self._manifest(target)
        budgets = {manifest.version: manifest.rollout.kv_budget} if manifest is not None else {}
        swaps = self.core.swaps
        if manifest is not None:
            target = manifest.version  # the version whose budget was read, also when asked for the latest
        try:
            result = await sync_weights(self.client, EngineWeights(self.core, budgets), weights.version,
                                        target)
        except Exception as exc:
            weights.sync_state, weights.last_error = "failed", str(exc)
            raise SyncFailed(str(exc)) from exc
        if result.path == "none":
            return weights.version
        plan = result.plan
        self.syncs += 1
        self.fallbacks += result.fell_back
        self.bytes += plan.total_bytes
        self.download_mbps = plan.total_bytes * 8 / 1e6 / max(result.seconds, 1e-6)
        weights.sync_state, weights.last_error = "idle", None
        weights.last_sync = {
            "from": plan.from_version,
            "to": result.version,
            "fingerprint": weights.fingerprint,
            "path": plan.kind,
            "bytes": plan.total_bytes,
            "seconds": round(result.seconds, 4),
            "fell_back": result.fell_back,
            # generation paused this long to write it (one swap per patch of a chain)
            "pause_s": round(sum(self.core.pauses_since(swaps)), 6),
        }
        self.history.append(weights.last_sync)
        log.info("weights now at version %d (%s, %d bytes, %.2fs)", result.version, plan.kind,
                 plan.total_bytes, result.seconds)
        return result.version

    async def _manifest(self, version: int | None) -> Manifest | None:
        """The manifest of `version` (None: the head), or None if it cannot be read now: the KV
        budget is then kept, never a reason to fail a sync."""
        try:
            return await (self.client.latest() if version is None else self.client.manifest(version))
        except (RegistryHTTPError, httpx.HTTPError, OSError, ValidationError) as exc:
            log.warning("cannot read the manifest of %s (%s): keeping KV budget %s, retrying next round",
                        "the head" if version is None else f"v{version}", exc, self.core.weights.kv_budget)
            return None

    async def refresh_budget(self) -> None:
        """Read the budget published with the version held (after a bootstrap or a failed read) and
        apply it at a batch boundary; on failure keep the old one (the next round retries)."""
        version = self.core.weights.version
        manifest = await self._manifest(version) if version >= 0 else None
        if manifest is None:
            return
        async with self.core.engine_lock:
            weights = self.core.weights
            if weights.version == version:
                weights.kv_budget, weights.kv_budget_of = manifest.rollout.kv_budget, version


async def _unless_stopped(coro: Awaitable[T], stop: asyncio.Event) -> T | None:
    """Await `coro`, but cancel it and return None as soon as `stop` is set (prompt shutdown)."""
    task, stopper = asyncio.ensure_future(coro), asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return task.result() if not task.cancelled() else None
