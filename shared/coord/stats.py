"""Counters kept in one Redis hash so every process (trainer, workers, CLI) sees the same numbers."""

from __future__ import annotations

# Every counter the scripts and the coordinator increment; stats() reports all, 0 when unset.
COUNTERS: tuple[str, ...] = (
    "enqueued",  # groups accepted by enqueue
    "refused",  # groups refused by enqueue because the queue was full
    "claimed",  # leases handed out (first deliveries and reclaims)
    "reclaims",  # leases taken over after their TTL expired
    "released",  # leases given back by their worker
    "lagging_refusals",  # claims refused because the worker's weights were too stale
    "window_refusals",  # claims refused because the in-flight window (leased + unread) was full
    "completions",  # groups counted as completed (exactly one per group)
    "late_completions",  # of those, completed by an attempt whose lease had been reclaimed
    "duplicates",  # completions refused because the group was already completed
    "rejected",  # completions refused because the entry had been dead-lettered
    "dead_letters",  # entries moved to the dead-letter stream (all reasons)
    "max_attempts_exceeded",  # of those, after max_attempts expired leases
    "malformed",  # of those, entries that did not parse as a PromptGroup
    "worker_rejected",  # of those, groups a worker rejected with a reason
    "failed_groups",  # of those, groups whose processing failed max_attempts times
    "failures",  # attempts that failed while processing a group (e.g. its reward raised)
    "requeued",  # groups enqueued again because they were in no stream (Redis lost them, or stale)
    "trajectories_read",  # trajectories handed to the trainer
    "dropped_stale",  # trajectories dropped for being more than max_lag versions old
    "malformed_trajectories",  # trajectory entries that did not parse (dropped)
)


def decode(value: bytes | str) -> str:
    """Redis clients may or may not decode responses; the coordinator accepts both. Bytes that
    are not UTF-8 (a broken producer) become U+FFFD, so parsing fails cleanly instead of raising."""
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def counters_from_hash(raw: dict) -> dict[str, int]:
    values = {decode(k): int(v) for k, v in raw.items()}
    return {name: values.get(name, 0) for name in COUNTERS}
