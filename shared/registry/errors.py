"""What the registry client raises."""

from __future__ import annotations

from shared.errors import ServiceHTTPError


class RegistryHTTPError(ServiceHTTPError):
    """The registry answered with an error status (0: the connection broke mid-upload)."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__("registry", status, detail)


class CorruptObjectError(Exception):
    """A downloaded piece does not match its sha256, even after a refetch. `key`: the object's
    (reported to the registry, which re-checks its copy and quarantines it if bad)."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class SyncError(Exception):
    """A sync could not reach its target; `version` is the version the weights hold (intact)."""

    def __init__(self, message: str, version: int | None) -> None:
        super().__init__(message)
        self.version = version
