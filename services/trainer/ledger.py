"""The trainer's authoritative record of prompt groups: submitted, trained, dead-lettered.

Redis holds the queues, but Redis can lose data (restarted without persistence, or the last
second of an `everysec` AOF). So the trainer keeps its own list, an append-only JSON-lines file
in its data dir, synced to disk before a submission is acknowledged and after each published step:
- a group accepted by POST /v1/prompts is `submitted`;
- a group whose trajectories went into a published version is `trained` (never trained again:
  a trajectory for it arriving later is dropped as a duplicate);
- a group the workers dead-lettered is `dead`.
Every submitted group that is neither trained, dead, held by the trainer in memory, nor in any of
the run's streams has been lost; `Trainer.reconcile` queues it again (docs/coordination.md).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
from collections.abc import Iterable, Sequence
from pathlib import Path

from shared.coord import Coordinator
from shared.schemas import PromptGroup

LEDGER_FILE = "groups.jsonl"  # in the trainer's data dir


class GroupLedger:
    def __init__(self, path: Path, run: str) -> None:
        self.path = path
        self.run = run
        self.epoch: str | None = None  # this trainer's token in Redis: a missing key = lost data
        self.open: dict[str, PromptGroup] = {}  # submitted, neither trained nor dead yet
        self.trained: set[str] = set()
        self.dead: set[str] = set()
        # Submissions and reconciliation exclude each other: a group recorded here but not yet
        # enqueued must not look lost.
        self.lock = asyncio.Lock()
        if path.is_file() and self._run_of_file() not in (run, None):
            # The data dir was reused for another run: that run's record is kept aside, not mixed in.
            path.rename(path.with_name(f"{path.name}.{self._run_of_file()}"))
        self.existed = path.is_file()  # False: a new run (its Redis keys are expected to be absent)
        if self.existed:
            self._load()
        if self.epoch is None:
            self.epoch = secrets.token_hex(8)
            self._append([{"epoch": self.epoch, "run": run}])

    @classmethod
    def in_dir(cls, data_dir: str | Path, run: str) -> GroupLedger:
        return cls(Path(data_dir) / LEDGER_FILE, run)

    def _run_of_file(self) -> str | None:
        with self.path.open() as f:
            try:
                return json.loads(f.readline()).get("run")
            except json.JSONDecodeError:
                return None

    def _load(self) -> None:
        with self.path.open() as f:
            for line in f:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a torn last line from a crash mid-write: that write never returned
                if "epoch" in row:
                    self.epoch = row["epoch"]
                for raw in row.get("submitted", ()):
                    group = PromptGroup.model_validate(raw)
                    if group.id not in self.trained and group.id not in self.dead:
                        self.open[group.id] = group
                for gid in row.get("withdrawn", ()):
                    self.open.pop(gid, None)
                for gid in row.get("trained", ()):
                    self.trained.add(gid)
                    self.open.pop(gid, None)
                for gid in row.get("dead", ()):
                    self.dead.add(gid)
                    self.open.pop(gid, None)

    def _append(self, rows: Iterable[dict]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            for row in rows:
                f.write(json.dumps(row, separators=(",", ":")) + "\n")
            f.flush()
            os.fsync(f.fileno())

    async def submit(self, coord: Coordinator, groups: Sequence[PromptGroup]) -> list[str]:
        """Record the groups, then enqueue them (QueueFull: withdrawn again and re-raised)."""
        async with self.lock:
            # An id already open stays as it was; one already trained or dead is not reopened (its
            # new copy is dropped as a duplicate of the counted completion, as before).
            fresh = [
                g
                for g in groups
                if g.id not in self.open and g.id not in self.trained and g.id not in self.dead
            ]
            if fresh:
                await asyncio.to_thread(self._append, [{"submitted": [g.model_dump() for g in fresh]}])
                self.open.update((g.id, g) for g in fresh)
            try:
                return await coord.enqueue(groups)
            except BaseException:
                # Refused or not known to be queued: the client is told it failed, so forget them.
                # (A group queued although its answer was lost is still trained once: the trainer
                # trains what arrives, and its ledger then records it.)
                ids = [g.id for g in fresh]
                for gid in ids:
                    self.open.pop(gid, None)
                if ids:
                    await asyncio.to_thread(self._append, [{"withdrawn": ids}])
                raise

    def settle_trained(self, group_ids: Sequence[str], version: int) -> None:
        """The groups' trajectories are in published version `version`."""
        self._append([{"trained": list(group_ids), "version": version}])
        self.trained.update(group_ids)
        for gid in group_ids:
            self.open.pop(gid, None)

    def settle_dead(self, group_ids: Sequence[str]) -> None:
        fresh = [gid for gid in group_ids if gid not in self.dead]
        if fresh:
            self._append([{"dead": fresh}])
            self.dead.update(fresh)
            for gid in fresh:
                self.open.pop(gid, None)

    def unsettled(self, held: set[str]) -> list[PromptGroup]:
        """Submitted groups neither trained, dead, nor held by the trainer in memory."""
        return [g for gid, g in self.open.items() if gid not in held]

