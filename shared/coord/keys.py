"""Redis key names of one run. Every key of a run lives under `{prefix}:{run}:`, so two runs on one
Redis (and one prefix) never share a queue, and one `SCAN MATCH {prefix}:{run}:*` finds (and a
test deletes) all of a run."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Keys:
    prefix: str
    run: str

    def __post_init__(self) -> None:
        if not self.run:
            raise ValueError("a run name is required: every Redis key carries it")

    @property
    def base(self) -> str:  # the common start of every key of this run
        return f"{self.prefix}:{self.run}"

    @property
    def prompts(self) -> str:  # stream of prompt groups; the rollout consumer group reads it
        return f"{self.base}:prompts"

    @property
    def dead(self) -> str:  # stream of dead-lettered groups, each with its reason
        return f"{self.base}:dead"

    @property
    def trajectories(self) -> str:  # stream of completed groups; the trainer reads it
        return f"{self.base}:trajectories"

    @property
    def completed(self) -> str:  # hash group_id -> "attempt worker_id" of the counted completion
        return f"{self.base}:completed"

    @property
    def failures(self) -> str:  # hash group_id -> "attempt worker_id: error" of its last failure
        return f"{self.base}:failures"

    @property
    def stats(self) -> str:  # hash of counters shared by every process
        return f"{self.base}:stats"

    @property
    def reclaim_cursor(self) -> str:  # XAUTOCLAIM cursor, so scans cover the whole pending list
        return f"{self.base}:reclaim-cursor"

    @property
    def trainer_version(self) -> str:
        return f"{self.base}:trainer-version"

    @property
    def inflight_limit(self) -> str:  # max groups leased + completed-but-unread; set by the trainer
        return f"{self.base}:inflight-limit"

    @property
    def epoch(self) -> str:  # the trainer's token for this Redis's data; missing = the data was lost
        return f"{self.base}:epoch"

    @property
    def workers(self) -> str:  # set of worker ids that registered (expired ones pruned on read)
        return f"{self.base}:workers"

    def worker(self, worker_id: str) -> str:  # hash per worker with a TTL
        return f"{self.base}:worker:{worker_id}"

    @property
    def registry_head(self) -> str:  # the registry's newest version of the run (set on publish)
        return f"{self.base}:registry-head"

    @property
    def versions_channel(self) -> str:  # pub/sub channel: the registry announces each new version
        return f"{self.base}:versions"
