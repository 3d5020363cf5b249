"""A version reaches a serving engine with generation paused only for the write: the patch is
staged off the engine lock, and the pause (the lock's hold) is recorded per swap."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from services.rollout.core import RolloutCore
from services.rollout.service import RolloutService
from services.rollout.settings import RolloutSettings
from services.rollout.sync import EngineWeights
from shared.patch import extract_patch, fingerprint
from shared.patch.codec import bits
from shared.registry import sync as registry_sync


def _core(model_dir: str) -> RolloutCore:
    return RolloutCore.from_model_dir(RolloutSettings(model=model_dir, device="cpu"), Path(model_dir))


def _chain(state: dict[str, torch.Tensor], n: int) -> tuple[list[memoryview], dict[str, torch.Tensor]]:
    """n patches, each against the version before it, and the last version's weights."""
    patches, live = [], {k: v.clone() for k, v in state.items()}
    for version in range(n):
        new = {k: v.clone() for k, v in live.items()}
        for t in new.values():
            bits(t)[:: 5 + version] += 1
        patches.append(memoryview(extract_patch(
            live, new, run="r", base_version=version, target_version=version + 1,
            base_fingerprint=fingerprint(live), target_fingerprint=fingerprint(new))))
        live = new
    return patches, live


def test_a_patch_is_staged_off_the_engine_lock_and_its_pause_recorded(
        tiny_model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    core = _core(tiny_model_dir)
    service = RolloutService(core.settings, core)
    staged_under_lock: list[bool] = []
    real_stage = registry_sync.stage_patch

    def stage(*args, **kwargs):
        staged_under_lock.append(core.engine_lock.locked())
        return real_stage(*args, **kwargs)

    monkeypatch.setattr(registry_sync, "stage_patch", stage)
    patches, live = _chain(core.engine.state_dict(), 3)  # a chain of three: three swaps
    reached = asyncio.run(registry_sync.apply_patches(EngineWeights(core), patches, 0))
    assert reached == 3 and core.weights.version == 3
    assert core.weights.fingerprint == fingerprint(live) == fingerprint(core.engine.state_dict())
    assert staged_under_lock == [False, False, False]
    assert core.swaps == 3 and len(core.pauses_since(0)) == 3
    summary = core.pause_summary()
    assert summary["count"] == 3 and 0 < summary["median_s"] <= summary["p99_s"] <= summary["max_s"]
    assert service.weights().swap_pause == summary  # the worker's status
    histogram = service.metrics.registry.get_sample_value("rollout_weight_swap_pause_seconds_count")
    assert histogram == 3
    text = service.metrics_text().decode()
    assert "rollout_weight_swap_pause_seconds_bucket" in text


def test_the_weights_mapping_is_read_off_the_engine_lock(tiny_model_dir: str) -> None:
    """Building the engine's state mapping walks every parameter (milliseconds for a 1.7B model,
    most of a GPU swap's pause when it ran under the lock): the sync reads it before the lock."""
    core = _core(tiny_model_dir)
    read_under_lock: list[bool] = []

    class Weights(EngineWeights):
        def state(self):  # type: ignore[no-untyped-def]
            read_under_lock.append(core.engine_lock.locked())
            return super().state()

    patches, live = _chain(core.engine.state_dict(), 2)
    assert asyncio.run(registry_sync.apply_patches(Weights(core), patches, 0)) == 2
    assert fingerprint(core.engine.state_dict()) == fingerprint(live)
    assert read_under_lock and not any(read_under_lock)


def test_the_pause_is_the_time_the_engine_is_held(tiny_model_dir: str) -> None:
    core = _core(tiny_model_dir)
    service = RolloutService(core.settings, core)

    async def swap() -> None:
        async with core.weights_swap():
            await asyncio.sleep(0.05)

    asyncio.run(swap())
    assert core.pauses_since(0)[0] >= 0.05
    total = service.metrics.registry.get_sample_value("rollout_weight_swap_pause_seconds_sum")
    assert total is not None and total >= 0.05
    assert service.metrics.registry.get_sample_value(
        "rollout_weight_swap_pause_seconds_bucket", {"le": "0.02"}) == 0
