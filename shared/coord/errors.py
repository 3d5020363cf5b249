"""Typed errors of the coordination layer."""

from __future__ import annotations


class CoordError(Exception):
    """Base class of coordination errors."""


class QueueFull(CoordError):
    """The prompt queue is at its bound; services answer 429 and producers retry later."""

    def __init__(self, depth: int, requested: int, max_queue: int) -> None:
        super().__init__(
            f"prompt queue full: {depth} queued or leased + {requested} new > max_queue {max_queue}"
        )
        self.depth = depth
        self.requested = requested
        self.max_queue = max_queue
