"""What the registry client raises."""

from __future__ import annotations


class RegistryHTTPError(Exception):
    """The registry answered with an error status (0: the connection broke mid-upload)."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"registry answered {status}: {detail}")
        self.status = status
        self.detail = detail


class CorruptObjectError(Exception):
    """A downloaded piece does not match its sha256, even after a refetch."""


class SyncError(Exception):
    """A sync could not reach its target; `version` is the version the weights hold (intact)."""

    def __init__(self, message: str, version: int | None) -> None:
        super().__init__(message)
        self.version = version
