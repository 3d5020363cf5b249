"""Object storage behind one small async interface (obstore underneath).

URLs: ``file://<path>`` (relative paths resolve against the working directory; the default for
local runs), ``s3://<bucket>[/<prefix>]`` for S3 or MinIO (endpoint, region, credentials and
``allow_http`` passed in explicitly, so settings, not the environment, decide), and
``memory://`` for unit tests.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlparse

import obstore
from obstore.exceptions import NotFoundError
from obstore.store import LocalStore, MemoryStore, S3Store

T = TypeVar("T")


class ObjectNotFound(KeyError):
    """The key names no object."""


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int


@dataclass(frozen=True)
class S3Options:
    endpoint: str | None = None
    region: str | None = None
    access_key_id: str | None = None
    secret_access_key: str | None = None
    allow_http: bool = False


def _open_store(url: str, s3: S3Options | None):
    parsed = urlparse(url)
    if parsed.scheme == "memory":
        return MemoryStore()
    if parsed.scheme == "file":
        # file://./data/x keeps "." as netloc; join netloc and path so relative roots work.
        root = Path(parsed.netloc + parsed.path).resolve()
        # Created here rather than with LocalStore(mkdir=True): that flag aborts the
        # interpreter at exit in obstore 0.12.
        root.mkdir(parents=True, exist_ok=True)
        return LocalStore(prefix=root)
    if parsed.scheme == "s3":
        s3 = s3 or S3Options()
        config: dict[str, str] = {}
        if s3.endpoint:
            config["endpoint"] = s3.endpoint
        if s3.region:
            config["region"] = s3.region
        if s3.access_key_id:
            config["access_key_id"] = s3.access_key_id
        if s3.secret_access_key:
            config["secret_access_key"] = s3.secret_access_key
        prefix = parsed.path.strip("/") or None
        return S3Store(
            parsed.netloc,
            prefix=prefix,
            config=config,  # type: ignore[arg-type]  # obstore's S3Config is a TypedDict of these keys
            client_options={"allow_http": s3.allow_http},
        )
    raise ValueError(f"unsupported store URL {url!r}: use file://, s3:// or memory://")


class ObjectStorage:
    """Keys are '/'-separated paths relative to the store's root.

    Every call runs obstore's blocking API in a worker thread: its native async API aborts the
    interpreter at exit now and then (obstore 0.12, Python 3.11), a thread costs nothing here.
    """

    def __init__(self, url: str, *, s3: S3Options | None = None) -> None:
        self.url = url
        self._store = _open_store(url, s3)

    async def _call(self, key: str, fn: Callable[[], T]) -> T:
        try:
            return await asyncio.to_thread(fn)
        except (NotFoundError, FileNotFoundError) as exc:
            raise ObjectNotFound(key) from exc

    async def put(self, key: str, data: bytes | memoryview) -> None:
        # obstore writes atomically on every backend (temp file + rename locally, one PUT or a
        # completed multipart upload on S3): readers see the old object or the new, never half.
        await self._call(key, lambda: obstore.put(self._store, key, data))

    async def get(self, key: str) -> bytes:
        return await self._call(key, lambda: bytes(obstore.get(self._store, key).bytes()))

    async def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of the object."""
        return await self._call(
            key, lambda: bytes(obstore.get_range(self._store, key, start=start, end=end))
        )

    async def stream(
        self, key: str, start: int, end: int, chunk_bytes: int = 1 << 20
    ) -> AsyncIterator[bytes]:
        """Bytes [start, end) in pieces, without holding the whole object in memory."""
        result = await self._call(
            key, lambda: obstore.get(self._store, key, options={"range": (start, end)})
        )
        pieces = iter(result.stream(min_chunk_size=chunk_bytes))
        while (piece := await asyncio.to_thread(next, pieces, None)) is not None:
            yield bytes(piece)

    async def size(self, key: str) -> int:
        return await self._call(key, lambda: int(obstore.head(self._store, key)["size"]))

    async def exists(self, key: str) -> bool:
        try:
            await self.size(key)
        except ObjectNotFound:
            return False
        return True

    async def list(self, prefix: str) -> list[ObjectInfo]:
        """Objects under prefix (a folder-like path, e.g. 'run/manifests/'), sorted by key."""
        metas = await self._call(prefix, lambda: obstore.list(self._store, prefix=prefix).collect())
        return sorted((ObjectInfo(m["path"], int(m["size"])) for m in metas), key=lambda o: o.key)

    async def delete(self, key: str) -> None:
        try:
            await self._call(key, lambda: obstore.delete(self._store, key))
        except ObjectNotFound:
            pass  # already gone: deleting is idempotent

    async def ping(self) -> None:
        """Raises if the store cannot be reached (one listing page is enough)."""
        await asyncio.to_thread(lambda: next(iter(obstore.list(self._store, prefix="__ping__")), None))
