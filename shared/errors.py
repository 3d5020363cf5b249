"""The error any service client raises for an HTTP answer it cannot use.

Generic code (shared.retry's backoff loop) asks an error whether it is worth waiting out without
knowing which client raised it: each client's error subclasses `ServiceHTTPError`.
"""

from __future__ import annotations


class ServiceHTTPError(Exception):
    """A service answered with an error status (0: the connection broke mid-transfer)."""

    def __init__(self, service: str, status: int, detail: str) -> None:
        super().__init__(f"{service} answered {status}: {detail}")
        self.status = status
        self.detail = detail

    @property
    def transient(self) -> bool:
        """The service is unreachable or restarting (5xx, or the connection broke): retry later.
        A 4xx is a refused request: retrying it unchanged cannot help."""
        return self.status == 0 or self.status >= 500
