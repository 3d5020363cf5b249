"""What the registry knows of a run in memory (its manifests, merged patches, leases, merge
wishes), and how its stored objects are checked."""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass, field

from shared.registry.wire import Manifest, ObjectRef, QuarantinedObject

SNAPSHOT_LAG = 0  # key of RunState.wanted for the snapshot s → head merge (real lags are >= 2)


def piece_hashes(data: bytes, piece_bytes: int) -> list[str]:
    view = memoryview(data)
    return [hashlib.sha256(view[i : i + piece_bytes]).hexdigest() for i in range(0, len(data), piece_bytes)]


def stored(ref: ObjectRef | None, what: str) -> ObjectRef:
    """A manifest's patch or snapshot reference that the caller knows is there."""
    if ref is None:
        raise LookupError(f"{what} has no stored object")
    return ref


def object_ref(key: str, data: bytes, piece_bytes: int) -> ObjectRef:
    """The reference to a stored object: its size and the sha256 of each piece."""
    return ObjectRef(key=key, size=len(data), piece_bytes=piece_bytes, pieces=piece_hashes(data, piece_bytes))


@dataclass
class RunState:
    manifests: dict[int, Manifest] = field(default_factory=dict)
    merged: dict[tuple[int, int], ObjectRef] = field(default_factory=dict)
    leases: dict[str, float] = field(default_factory=dict)  # object key → monotonic expiry
    # Merges that plans could not use because nobody may build them on a read: lag b−a → when a
    # plan last wanted it; SNAPSHOT_LAG stands for "newest snapshot → head" (fresh workers).
    wanted: dict[int, float] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Stored objects found corrupt or gone (services.registry.repair), by key: no plan names them
    # and nothing is built from them until they are written again.
    quarantine: dict[str, QuarantinedObject] = field(default_factory=dict)

    @property
    def head(self) -> int | None:
        return max(self.manifests) if self.manifests else None

    def snapshots(self) -> list[int]:
        """Versions with a good (not quarantined) stored snapshot."""
        return sorted(v for v, m in self.manifests.items()
                      if m.snapshot is not None and m.snapshot.key not in self.quarantine)

    def chain(self, a: int, b: int) -> list[Manifest] | None:
        """The good stored patches a→a+1→…→b, or None if one is missing or quarantined."""
        if b - a > len(self.manifests):  # cannot all be retained: answer without walking b−a
            return None
        chain = [self.manifests.get(v) for v in range(a + 1, b + 1)]
        good = [m for m in chain
                if m is not None and m.patch is not None and m.patch.key not in self.quarantine]
        return good if len(good) == len(chain) else None

    def reachable_from(self, version: int) -> int | None:
        """The newest good snapshot from which good patches lead to `version`, if any."""
        return max((s for s in self.snapshots() if s <= version and self.chain(s, version) is not None),
                   default=None)

    def snapshot_wanted(self) -> int | None:
        """The head, when no good snapshot and chain reach it (a new worker could not start): the
        trainer, which holds the head's weights, is asked for a snapshot of it."""
        head = self.head
        return head if head is not None and self.reachable_from(head) is None else None
