"""Async client of one run of the weight-patch registry (services/registry).

A rollout worker needs only the registry URL:

    async with RegistryClient("http://registry:8100", "run1", streams=4) as client:
        await client.fetch_model_files("model/")          # config + tokenizer
        state: dict[str, Tensor] = {}
        result = await sync_weights(client, state, None)  # snapshot + chain → latest
        ...
        v = await client.wait_for_version(result.version, timeout=60)
        result = await sync_weights(client, engine.state_dict(), result.version)   # in place

(`sync_weights` is shared.registry.sync's.) Reads and waits live here; downloads are
shared.registry.download's, writes shared.registry.publish's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path

from shared.coord.keys import Keys
from shared.registry.download import Downloader
from shared.registry.errors import RegistryHTTPError
from shared.registry.publish import Publisher
from shared.registry.wire import Manifest, ObjectRef, Plan, RepairStatus, Verdict

log = logging.getLogger(__name__)


class RegistryClient(Publisher):
    """Client of one run. `bandwidth_bps` is in bits per second (None: uncapped)."""

    def __init__(
        self,
        base_url: str,
        run: str,
        *,
        token: str | None = None,
        streams: int = 4,
        bandwidth_bps: float | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        redis_url: str | None = None,
        redis_prefix: str = "sparsecast",
        retries: int = 8,
        backoff_s: float = 0.2,
        max_backoff_s: float = 4.0,
        timeout_s: float = 120.0,
    ) -> None:
        super().__init__(base_url, run, token=token, streams=streams, retries=retries, backoff_s=backoff_s,
                         max_backoff_s=max_backoff_s, timeout_s=timeout_s)
        self.redis_url = redis_url
        self.redis_prefix = redis_prefix
        self.downloader = Downloader(self, bandwidth_bps=bandwidth_bps, cache_dir=cache_dir)

    async def __aenter__(self) -> RegistryClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- reads --

    async def ping(self, timeout_s: float = 2.0) -> None:
        """Raise unless the registry says it is ready (its store answers) within timeout_s; one
        try, for readiness probes."""
        response = await self._http.get("/readyz", timeout=timeout_s)
        self._raise_for(response)

    async def latest(self) -> Manifest | None:
        """The head manifest, or None while the run has no version."""
        try:
            return Manifest.model_validate(await self._get_json("latest"))
        except RegistryHTTPError as exc:
            if exc.status == 404:
                return None
            raise

    async def versions(self) -> list[Manifest]:
        return [Manifest.model_validate(m) for m in await self._get_json("versions")]

    async def manifest(self, version: int) -> Manifest:
        return Manifest.model_validate(await self._get_json(f"manifests/{version}"))

    async def version_of(self, fingerprint: str) -> int | None:
        """The newest published version whose weights have this fingerprint, if any."""
        for manifest in sorted(await self.versions(), key=lambda m: m.version, reverse=True):
            if manifest.fingerprint == fingerprint:
                return manifest.version
        return None

    async def plan(self, from_version: int | None, to_version: int | None = None) -> Plan:
        """Cheapest way from from_version (None: no weights) to to_version (None: latest)."""
        params: dict[str, int] = {"from": -1 if from_version is None else from_version}
        if to_version is not None:
            params["to"] = to_version
        return Plan.model_validate(await self._get_json("plan", params))

    async def repair_status(self) -> RepairStatus:
        """The run's quarantined objects and whether a snapshot of the head is wanted."""
        return RepairStatus.model_validate(await self._get_json("quarantine"))

    async def report_corrupt(self, key: str) -> Verdict:
        """Tell the registry that `key` failed its sha256 here; it re-checks its copy."""

        async def action() -> Verdict:
            response = await self._http.post(self._path(f"quarantine/{key}"), headers=self._auth())
            self._raise_for(response)
            return Verdict.model_validate(response.json())

        return await self._retrying(action, f"POST quarantine/{key}")

    async def download(self, refs: Sequence[ObjectRef]) -> list[memoryview]:
        """The objects' bytes, every piece verified (shared.registry.download)."""
        return await self.downloader.download(refs)

    async def wait_for_version(self, after: int, timeout: float, poll_s: float = 1.0) -> int | None:
        """The first version > after, or None at timeout. Woken by the registry's Redis
        announcement when redis_url is set; polls /latest otherwise (and as a safety net)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        pubsub = None
        redis_client = None
        if self.redis_url:
            import redis.asyncio as aioredis

            try:
                redis_client = aioredis.Redis.from_url(self.redis_url)
                pubsub = redis_client.pubsub()
                await pubsub.subscribe(Keys(self.redis_prefix, self.run).versions_channel)
                poll_s = max(poll_s, 5.0)  # announcements wake us; polling is only the safety net
            except Exception as exc:  # noqa: BLE001 - any Redis trouble means: poll instead
                log.debug("version announcements unavailable (%s); polling", exc)
                pubsub = None
        try:
            while True:
                latest = await self.latest()
                if latest is not None and latest.version > after:
                    return latest.version
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return None
                wait = min(poll_s, remaining)
                if pubsub is None:
                    await asyncio.sleep(wait)
                    continue
                try:
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=wait)
                except Exception as exc:  # noqa: BLE001 - Redis went away: poll for the rest of the wait
                    log.debug("version announcements lost (%s); polling", exc)
                    await pubsub.aclose()
                    pubsub = None
                    continue
                if message is not None:
                    event = json.loads(message["data"])
                    if event.get("run") == self.run and event.get("version", -1) > after:
                        return int(event["version"])
        finally:
            if pubsub is not None:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()
            if redis_client is not None:
                with contextlib.suppress(Exception):
                    await redis_client.aclose()

    async def fetch_model_files(self, dest: str | os.PathLike[str]) -> list[Path]:
        """Download the run's config and tokenizer files into dest; returns the written paths."""
        dest = Path(dest)
        dest.mkdir(parents=True, exist_ok=True)
        written = []
        for name in await self._get_json("model"):

            async def action(name: str = name) -> bytes:
                response = await self._http.get(self._path(f"model/{name}"))
                self._raise_for(response)
                return response.content

            path = dest / name
            path.write_bytes(await self._retrying(action, f"GET model/{name}"))
            written.append(path)
        return written
