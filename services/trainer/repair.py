"""Repairing the registry from the trainer. The trainer holds the head's weights, so when the
registry finds that no good snapshot and chain reach its head (a stored object was found corrupt
and quarantined, docs/registry.md), it asks for a snapshot of the head (`snapshot_wanted` at
GET /v1/runs/{run}/quarantine) and this loop uploads one; lagging and new workers then reach the
head through it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import torch

from shared.patch import fingerprint, save_snapshot
from shared.registry.client import RegistryClient
from shared.registry.errors import RegistryHTTPError
from shared.retry import transient

log = logging.getLogger(__name__)

# How often the trainer asks whether the registry wants a snapshot: the most a repair waits for
# the trainer (docs/registry.md: what corruption costs).
REPAIR_POLL_S = 5.0

# The version the trainer's weights hold and those weights (bf16, on the CPU); None while the
# trainer is starting.
HeadWeights = Callable[[], Awaitable[tuple[int, dict[str, torch.Tensor]] | None]]


async def repair_once(client: RegistryClient, head_weights: HeadWeights) -> int | None:
    """Upload a snapshot of the head if the registry wants one; returns its version, else None.

    The weights are checked against the manifest of their version before the upload: between a
    step's capture and its publish the trainer's weights are one version ahead of its version
    number, and such a snapshot would be refused (409), so it waits for the next round."""
    status = await client.repair_status()
    if status.snapshot_wanted is None:
        return None
    held = await head_weights()
    if held is None:
        return None
    version, weights = held
    if version < status.snapshot_wanted:
        log.warning("the registry wants a snapshot of v%d, the trainer holds v%d: cannot help",
                    status.snapshot_wanted, version)
        return None
    expected = (await client.manifest(version)).fingerprint
    if await asyncio.to_thread(fingerprint, weights) != expected:
        log.info("weights are between versions (a publish is under way): snapshot next round")
        return None
    data = await asyncio.to_thread(save_snapshot, weights, run=client.run, version=version)
    await client.publish_snapshot(version, data)
    log.warning("the registry could not reach its head (quarantined: %s): uploaded a snapshot of v%d",
                ", ".join(q.key for q in status.quarantined) or "none", version)
    return version


async def repair_loop(client: RegistryClient, head_weights: HeadWeights, stop: asyncio.Event,
                      poll_s: float = REPAIR_POLL_S) -> None:
    """repair_once every poll_s until `stop`. Never raises: an unreachable registry is the step
    loop's to report (shared.retry); anything else is logged and tried again next round."""
    while not stop.is_set():
        try:
            await repair_once(client, head_weights)
        except Exception as exc:  # noqa: BLE001 - a repair must never stop the trainer
            if isinstance(exc, RegistryHTTPError) and exc.status == 409 or transient(exc):
                log.debug("registry repair: %s; next round", exc)
            else:
                log.warning("registry repair failed (%s); next round", exc)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=poll_s)
