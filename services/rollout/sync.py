"""Live weight sync: download in the background, apply at a batch boundary, verify, report.

Downloads (and, for the snapshot path, decoding) run while the engine keeps generating; only the
in-place writes hold the engine lock. Every patch is applied all-or-nothing with its target
fingerprint checked, so the weights are always exactly some published version. Any verification
failure falls back to the snapshot path; nothing unverified is ever served.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from pathlib import Path

import httpx
import torch
from safetensors.torch import save_file

from services.rollout.core import RolloutCore
from shared.health import Liveness
from shared.patch import PatchError, apply_patch, fingerprint, load_snapshot
from shared.registry_client import CorruptObjectError, Plan, RegistryClient, RegistryHTTPError
from shared.retry import Outage, transient

log = logging.getLogger(__name__)
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
    result = await client.sync_to(state, None)  # snapshot + chain, each verified
    await asyncio.to_thread(save_file, {k: v.contiguous() for k, v in state.items()}, str(dest / "model.safetensors"))
    return result.version


async def match_registry_version(client: RegistryClient, local_fingerprint: str) -> int | None:
    """The newest published version whose fingerprint equals the local weights', if any."""
    for manifest in sorted(await client.versions(), key=lambda m: m.version, reverse=True):
        if manifest.fingerprint == local_fingerprint:
            return manifest.version
    return None


class WeightSync:
    def __init__(self, core: RolloutCore, client: RegistryClient, poll_s: float = 2.0, *,
                 registry: Outage | None = None, liveness: Liveness | None = None) -> None:
        self.core = core
        self.client = client
        self.poll_s = poll_s
        self.registry = registry or Outage("registry", log)
        self.liveness = liveness or Liveness()
        self.syncs = 0
        self.fallbacks = 0
        self.failures = 0
        self.bytes = 0
        self.download_mbps = 0.0
        # The last syncs (version reached, fingerprint, path, bytes, seconds): shown on /v1/weights.
        self.history: deque[dict] = deque(maxlen=256)

    async def run(self, stop: asyncio.Event) -> None:
        """Follow the registry's head. An unreachable registry is waited out (logged once per
        outage, shared.retry); a sync that fails for another reason is retried with backoff too."""
        backoff = self.poll_s
        while not stop.is_set():
            self.liveness.beat(LOOP)
            try:
                target = await _unless_stopped(
                    self.client.wait_for_version(self.core.weights.version, timeout=VERSION_WAIT_S,
                                                 poll_s=self.poll_s), stop)
                if target is not None and target > self.core.weights.version:
                    await self.sync_to(target)
                self.registry.ok()
                backoff = self.poll_s
            except (SyncFailed, RegistryHTTPError, httpx.HTTPError, OSError) as exc:
                self.failures += 1
                cause = exc.__cause__ if isinstance(exc, SyncFailed) and exc.__cause__ is not None else exc
                if transient(cause):
                    await self.registry.failed(cause, stop)
                    continue
                log.warning("weight sync failed (%s); retrying in %.1fs", exc, backoff)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=backoff)
                backoff = min(backoff * 2, 30.0)

    async def sync_to(self, target: int | None = None) -> int:
        """Bring the engine's weights to `target` (None: latest). Returns the version now held."""
        weights = self.core.weights
        t0 = time.perf_counter()
        plan = await self.client.plan(weights.version, target)
        if plan.kind == "none" or plan.to_version == weights.version:
            return weights.version
        weights.sync_state = "downloading"
        fallbacks_before = self.fallbacks
        try:
            try:
                version = await self._follow(plan)
            except (CorruptObjectError, PatchError) as exc:
                log.warning("sync %s→%s failed verification (%s); taking the snapshot path",
                            weights.version, plan.to_version, exc)
                self.fallbacks += 1
                version = await self._follow(await self.client.plan(None, plan.to_version))
        except Exception as exc:
            weights.sync_state, weights.last_error = "failed", str(exc)
            raise SyncFailed(str(exc)) from exc
        seconds = time.perf_counter() - t0
        self.syncs += 1
        self.bytes += plan.total_bytes
        self.download_mbps = plan.total_bytes * 8 / 1e6 / max(seconds, 1e-6)
        weights.sync_state, weights.last_error = "idle", None
        weights.last_sync = {"from": plan.from_version, "to": version, "fingerprint": weights.fingerprint,
                             "path": plan.kind, "bytes": plan.total_bytes, "seconds": round(seconds, 4),
                             "fell_back": self.fallbacks > fallbacks_before}
        self.history.append(weights.last_sync)
        log.info("weights now at version %d (%s, %d bytes, %.2fs)", version, plan.kind, plan.total_bytes, seconds)
        return version

    async def _follow(self, plan: Plan) -> int:
        blobs = await self.client.download([step.object for step in plan.steps])
        if plan.kind == "snapshot":
            return await self._install_snapshot(plan, blobs)
        return await self._apply_patches(blobs)

    async def _apply_patches(self, blobs: list[memoryview]) -> int:
        core = self.core
        async with core.weights_swap():  # batch boundary: no generation runs while weights change
            core.weights.sync_state = "applying"
            state = core.engine.state_dict()
            changed: set[str] = set()
            try:
                for blob in blobs:
                    header = await asyncio.to_thread(apply_patch, state, blob, verify=True)
                    changed.update(t.name for t in header.tensors)
                    core.weights.version, core.weights.fingerprint = header.target_version, header.target_fingerprint
            finally:
                if changed:
                    core.engine.weights_updated(changed)
            return core.weights.version

    async def _install_snapshot(self, plan: Plan, blobs: list[memoryview]) -> int:
        def build() -> tuple[dict[str, torch.Tensor], str]:
            tensors, info = load_snapshot(blobs[0])  # verifies the tensors against its fingerprint
            for blob in blobs[1:]:
                apply_patch(tensors, blob, verify=True)
            return tensors, fingerprint(tensors)

        tensors, fp = await asyncio.to_thread(build)  # decoded off the lock, while generation goes on
        if fp != plan.fingerprint:
            raise SyncFailed(f"snapshot path ends at fingerprint {fp}, plan promised {plan.fingerprint}")
        core = self.core
        async with core.weights_swap():
            core.weights.sync_state = "applying"
            state = core.engine.state_dict()
            if set(state) != set(tensors):
                raise SyncFailed("snapshot tensor names differ from the engine's weights")
            for name, tensor in tensors.items():  # check everything before the first write
                if state[name].shape != tensor.shape or state[name].dtype != tensor.dtype:
                    raise SyncFailed(f"{name}: snapshot has {tensor.dtype}{list(tensor.shape)}, engine differs")
            with torch.no_grad():
                for name, tensor in tensors.items():
                    state[name].copy_(tensor)
            core.engine.weights_updated(set(tensors))
            core.weights.version, core.weights.fingerprint = plan.to_version, fp
            return plan.to_version


async def _unless_stopped(coro, stop: asyncio.Event):
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
