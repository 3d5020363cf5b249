"""The trainer's side of the registry: publishing patches, snapshots and model files."""

from __future__ import annotations

import json
from typing import Any

from shared.registry.transport import RegistryTransport
from shared.registry.wire import METRICS_HEADER, Manifest


class Publisher(RegistryTransport):
    """Writes of one run (the registry checks the token; uploads are never retried once sent)."""

    async def publish_patch(self, version: int, data: bytes, metrics: dict[str, Any] | None = None) -> Manifest:
        headers = {METRICS_HEADER: json.dumps(metrics)} if metrics else {}
        return Manifest.model_validate(await self._put(f"patches/{version}", data, headers))

    async def publish_snapshot(self, version: int, data: bytes) -> Manifest:
        return Manifest.model_validate(await self._put(f"snapshots/{version}", data))

    async def put_model_file(self, name: str, data: bytes) -> None:
        await self._put(f"model/{name}", data)
