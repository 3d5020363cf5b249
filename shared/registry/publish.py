"""The trainer's side of the registry: publishing patches, snapshots and model files."""

from __future__ import annotations

import json
from typing import Any

from shared.registry.transport import RegistryTransport
from shared.registry.wire import GROUPS_HEADER, METRICS_HEADER, ROLLOUT_HEADER, Manifest, RolloutDirective


class Publisher(RegistryTransport):
    """Writes of one run (the registry checks the token; uploads are never retried once sent)."""

    async def publish_patch(
        self, version: int, data: bytes, metrics: dict[str, Any] | None = None,
        rollout: RolloutDirective | None = None, groups: list[str] | None = None,
    ) -> Manifest:
        headers = {METRICS_HEADER: json.dumps(metrics)} if metrics else {}
        headers |= _rollout(rollout)
        if groups:
            headers[GROUPS_HEADER] = json.dumps(groups, separators=(",", ":"))
        return Manifest.model_validate(await self._put(f"patches/{version}", data, headers))

    async def publish_snapshot(
        self, version: int, data: bytes, rollout: RolloutDirective | None = None
    ) -> Manifest:
        """A snapshot of a new run's first version carries `rollout`; one of a committed version
        keeps the version's directive."""
        return Manifest.model_validate(await self._put(f"snapshots/{version}", data, _rollout(rollout)))

    async def put_model_file(self, name: str, data: bytes) -> None:
        await self._put(f"model/{name}", data)


def _rollout(rollout: RolloutDirective | None) -> dict[str, str]:
    return {ROLLOUT_HEADER: rollout.model_dump_json(exclude_none=True)} if rollout is not None else {}
