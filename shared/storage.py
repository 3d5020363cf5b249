"""Object storage behind one small async interface (obstore underneath).

URLs: ``file://<path>`` (relative paths resolve against the working directory; the default for
local runs), ``memory://`` for unit tests, and every URL obstore opens: ``s3://<bucket>[/<prefix>]``
(S3, MinIO, R2), ``gs://`` (GCS), ``az://`` / ``abfs://`` (Azure), ``http(s)://`` (WebDAV-style
servers). A store's connection settings are string options in obstore's own names (S3:
``endpoint``, ``region``, ``access_key_id``, ``secret_access_key``, ``allow_http``; GCS:
``service_account_path``; ...), passed in explicitly, so settings, not the environment, decide.
A new store therefore needs no code here: a URL and its options.
"""

from __future__ import annotations

import asyncio
import errno
import re
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlparse

import obstore
from obstore.exceptions import BaseError as ObstoreError
from obstore.exceptions import NotFoundError
from obstore.store import LocalStore, MemoryStore, from_url

T = TypeVar("T")

# Options obstore takes as HTTP-client settings (the keys of obstore.store.ClientConfig, a TypedDict
# that exists in its type stubs only); every other option is the store's own configuration.
CLIENT_OPTION_KEYS = frozenset({
    "allow_http", "allow_invalid_certificates", "connect_timeout", "default_content_type",
    "pool_idle_timeout", "pool_max_idle_per_host", "proxy_url", "proxy_ca_certificate",
    "proxy_excludes", "root_certificate", "randomize_addresses", "read_timeout", "timeout",
    "user_agent",
})
_BOOLEAN_CLIENT_OPTIONS = frozenset({"allow_http", "allow_invalid_certificates", "randomize_addresses"})
_TRUE, _FALSE = frozenset({"true", "1", "yes"}), frozenset({"false", "0", "no", ""})


def _client_option(key: str, value: str) -> str | bool:
    if key not in _BOOLEAN_CLIENT_OPTIONS:
        return value
    if value.lower() not in _TRUE | _FALSE:
        raise ValueError(f"store option {key} must be true or false, got {value!r}")
    return value.lower() in _TRUE


class ObjectNotFound(KeyError):
    """The key names no object."""


class StoreFull(OSError):
    """The store refused a write for lack of space or quota: a local ENOSPC or EDQUOT, an S3 quota
    or 507 answer, MinIO's full drives. An outage that ends when space is freed, not a bad request."""


# How obstore words a full store: it wraps the OS error (os error 28 ENOSPC, 122 EDQUOT) or the
# service's answer in a message of its own, without an errno.
_FULL_STORE = re.compile(
    r"No space left on device|os error (28|122)\b|StorageFull|Disk quota exceeded|QuotaExceeded"
    r"|Insufficient ?Storage|XMinioStorageFull|status:? 507\b", re.IGNORECASE)


def store_full(exc: BaseException) -> bool:
    """The error means the store is out of space or quota (see StoreFull)."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return isinstance(exc, ObstoreError) and bool(_FULL_STORE.search(str(exc)))


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int


def _open_store(url: str, options: Mapping[str, str]) -> Any:
    parsed = urlparse(url)
    if parsed.scheme in ("memory", "file") and options:
        raise ValueError(f"{parsed.scheme}:// takes no store options (got {sorted(options)})")
    if parsed.scheme == "memory":
        return MemoryStore()
    if parsed.scheme == "file":
        # file://./data/x keeps "." as netloc; join netloc and path so relative roots work.
        root = Path(parsed.netloc + parsed.path).resolve()
        # Created here rather than with LocalStore(mkdir=True): that flag aborts the
        # interpreter at exit in obstore 0.12.
        root.mkdir(parents=True, exist_ok=True)
        return LocalStore(prefix=root)
    keys = {key.lower(): value for key, value in options.items()}
    client = {key: _client_option(key, value) for key, value in keys.items() if key in CLIENT_OPTION_KEYS}
    config = {key: value for key, value in keys.items() if key not in CLIENT_OPTION_KEYS}
    try:
        return from_url(url, config=config, client_options=client)  # type: ignore[call-overload]
    except Exception as exc:  # obstore's errors for an unknown scheme or option are generic
        raise ValueError(f"cannot open store {url!r} with options {sorted(keys)}: {exc}") from exc


class ObjectStorage:
    """Keys are '/'-separated paths relative to the store's root.

    Every call runs obstore's blocking API in a worker thread: its native async API aborts the
    interpreter at exit now and then (obstore 0.12, Python 3.11), a thread costs nothing here.
    """

    def __init__(self, url: str, *, options: Mapping[str, str] | None = None) -> None:
        self.url = url
        self._store = _open_store(url, options or {})

    async def _call(self, key: str, fn: Callable[[], T]) -> T:
        try:
            return await asyncio.to_thread(fn)
        except (NotFoundError, FileNotFoundError) as exc:
            raise ObjectNotFound(key) from exc
        except Exception as exc:
            if store_full(exc):
                first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                raise StoreFull(errno.ENOSPC, f"store {self.url} is full: {first}") from exc
            raise

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

    async def folders(self) -> list[str]:  # above list(): in the class body `list` is that method
        """The top-level folders of the store (e.g. a registry's runs), sorted."""
        listing = await self._call("", lambda: obstore.list_with_delimiter(self._store))
        return sorted(p.rstrip("/") for p in listing["common_prefixes"])

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
