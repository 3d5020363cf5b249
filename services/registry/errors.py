"""What the registry refuses, each with the HTTP status the app answers with."""

from __future__ import annotations


class RegistryError(Exception):
    status = 400


class NotFound(RegistryError):
    status = 404


class Conflict(RegistryError):
    status = 409


class TooLarge(RegistryError):
    status = 413


class Invalid(RegistryError):
    status = 422


class TimedOut(RegistryError):
    status = 408


class InsufficientStorage(RegistryError):
    """The store is full (shared.storage.StoreFull): an outage, retried by clients."""

    status = 507
    retry_after_s = 5


class BadRange(RegistryError):
    status = 416

    def __init__(self, message: str, size: int) -> None:
        super().__init__(message)
        self.size = size
