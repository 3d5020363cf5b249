"""Tunables of the coordination layer; services embed this model in their own settings."""

from __future__ import annotations

from pydantic import BaseModel, Field, model_validator


class CoordSettings(BaseModel):
    """Defaults and their reasons are in docs/coordination.md."""

    # Leases: an unacknowledged stream entry whose idle time passes the TTL is reclaimed.
    # Workers heartbeat every lease_ttl_s / 3, so two missed heartbeats are tolerated.
    lease_ttl_s: float = Field(default=30.0, gt=0)
    max_attempts: int = Field(default=3, ge=1)
    # Prompt groups queued or leased at once; enqueue past it raises QueueFull (HTTP 429).
    max_queue: int = Field(default=4096, ge=1)
    # Trajectories more than max_lag versions behind the trainer are dropped (counted).
    max_lag: int = Field(default=2, ge=0)
    # A worker whose weights are more than staleness_bound versions behind stops claiming.
    staleness_bound: int = Field(default=1, ge=0)
    # Claim size: base_claim groups for a worker of average fleet throughput, clamped.
    base_claim: int = Field(default=4, ge=1)
    min_claim: int = Field(default=1, ge=1)
    max_claim: int = Field(default=32, ge=1)
    # A worker's registry entry expires unless refreshed within this time.
    worker_ttl_s: float = Field(default=30.0, gt=0)
    consumer_group: str = Field(default="rollout", min_length=1)

    @model_validator(mode="after")
    def _consistent(self) -> CoordSettings:
        if not self.min_claim <= self.base_claim <= self.max_claim:
            raise ValueError("need min_claim <= base_claim <= max_claim")
        return self

    @property
    def lease_ttl_ms(self) -> int:
        return max(1, int(self.lease_ttl_s * 1000))

    @property
    def heartbeat_interval_s(self) -> float:
        return self.lease_ttl_s / 3

    def inflight_limit(self, groups_per_step: int) -> int:
        """The in-flight window the trainer sets (leased + completed-unread groups): a worker's
        weights may be staleness_bound versions old and its results are read within
        limit / groups_per_step steps, so none is older than max_lag when read."""
        return max(1, self.max_lag - self.staleness_bound) * groups_per_step
