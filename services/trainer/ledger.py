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
import errno
import json
import os
import secrets
from collections.abc import Iterable, Sequence
from pathlib import Path

from shared.coord import Coordinator
from shared.schemas import PromptGroup

LEDGER_FILE = "groups.jsonl"  # in the trainer's data dir
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)  # a write that failed for want of space: an outage
# Rewritten to its live rows (open groups in full, trained and dead ids) once it is this big and
# twice its size after the last rewrite: withdrawn groups and settled ones' prompts drop out.
COMPACT_FROM_BYTES = 4 << 20


def disk_full(exc: BaseException) -> bool:
    """Whether a write failed for want of space, also when wrapped (torch.distributed.checkpoint
    reports its writers' errors inside a CheckpointException, by rank)."""
    pending, seen = [exc], set()
    while pending:
        e = pending.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in DISK_FULL:
            return True
        pending += [x for x in (e.__cause__, e.__context__) if x is not None]
        failures = getattr(e, "failures", None)  # CheckpointException: rank -> (exception, traceback)
        if isinstance(failures, dict):
            pending += [f[0] for f in failures.values() if isinstance(f, tuple) and f
                        and isinstance(f[0], BaseException)]
    return False


def fsync_dir(path: Path) -> None:
    """A rename inside `path` survives a power loss only once the folder itself is synced."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """A checkpoint is trusted after a power loss only if its bytes reached the disk."""
    for path in root.rglob("*"):
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())
    fsync_dir(root)


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
        self.last_version = 0  # the newest version a `trained` row names
        if self.existed:
            self._load()
        self._compacted_bytes = path.stat().st_size if self.existed else 0
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
                if row.get("trained") is not None:
                    self.last_version = max(self.last_version, int(row.get("version") or 0))
                for gid in row.get("dead", ()):
                    self.dead.add(gid)
                    self.open.pop(gid, None)

    def _append(self, rows: Iterable[dict]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        text = memoryview("".join(json.dumps(row, separators=(",", ":")) + "\n" for row in rows).encode())
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            end = os.lseek(fd, 0, os.SEEK_END)
            try:
                while text:
                    text = text[os.write(fd, text):]
                os.fsync(fd)
            except BaseException:
                # A write cut short (ENOSPC) must not leave half a row: the retried row would be
                # appended to it and both lost on reading.
                os.ftruncate(fd, end)
                raise
        finally:
            os.close(fd)

    async def submit(self, coord: Coordinator, groups: Sequence[PromptGroup]) -> list[str]:
        """Record the groups, then enqueue them. A refusal writes nothing: the queue's room is
        checked first (QueueFull); only a queue that filled between that check and the enqueue
        costs a `withdrawn` row."""
        async with self.lock:
            await coord.check_room(len(groups))
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
            finally:
                await asyncio.to_thread(self._maybe_compact)

    def settle_trained(self, group_ids: Sequence[str], version: int) -> None:
        """The groups' trajectories are in published version `version`."""
        self._append([{"trained": list(group_ids), "version": version}])
        self.trained.update(group_ids)
        self.last_version = max(self.last_version, version)
        for gid in group_ids:
            self.open.pop(gid, None)
        self._maybe_compact()

    def _maybe_compact(self) -> None:
        size = self.path.stat().st_size if self.path.is_file() else 0
        if size >= COMPACT_FROM_BYTES and size >= 2 * self._compacted_bytes:
            self.compact()

    def compact(self) -> None:
        """Rewrite the file to what it says now, atomically (a crash leaves the old or the new)."""
        rows: list[dict] = [{"epoch": self.epoch, "run": self.run}]
        if self.open:
            rows.append({"submitted": [g.model_dump() for g in self.open.values()]})
        if self.trained:
            rows.append({"trained": sorted(self.trained), "version": self.last_version})
        if self.dead:
            rows.append({"dead": sorted(self.dead)})
        tmp = self.path.with_name(self.path.name + ".tmp")
        with tmp.open("w") as f:
            for row in rows:
                f.write(json.dumps(row, separators=(",", ":")) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        fsync_dir(self.path.parent)
        self._compacted_bytes = self.path.stat().st_size

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

