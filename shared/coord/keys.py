"""Redis key names of one run. Everything of a run lives under one prefix, so one
`SCAN MATCH prefix:*` finds (and a test deletes) all of it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Keys:
    prefix: str

    @property
    def prompts(self) -> str:  # stream of prompt groups; the rollout consumer group reads it
        return f"{self.prefix}:prompts"

    @property
    def dead(self) -> str:  # stream of dead-lettered groups, each with its reason
        return f"{self.prefix}:dead"

    @property
    def trajectories(self) -> str:  # stream of completed groups; the trainer reads it
        return f"{self.prefix}:trajectories"

    @property
    def completed(self) -> str:  # hash group_id -> "attempt worker_id" of the counted completion
        return f"{self.prefix}:completed"

    @property
    def stats(self) -> str:  # hash of counters shared by every process
        return f"{self.prefix}:stats"

    @property
    def reclaim_cursor(self) -> str:  # XAUTOCLAIM cursor, so scans cover the whole pending list
        return f"{self.prefix}:reclaim-cursor"

    @property
    def trainer_version(self) -> str:
        return f"{self.prefix}:trainer-version"

    @property
    def inflight_limit(self) -> str:  # max groups leased + completed-but-unread; set by the trainer
        return f"{self.prefix}:inflight-limit"

    @property
    def workers(self) -> str:  # set of worker ids that registered (expired ones pruned on read)
        return f"{self.prefix}:workers"

    def worker(self, worker_id: str) -> str:  # hash per worker with a TTL
        return f"{self.prefix}:worker:{worker_id}"
