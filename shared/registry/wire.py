"""The registry's wire types (its JSON) and constants, shared by the server and its client."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

# The config and tokenizer files a run carries beside its weights (a worker needs nothing else).
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)
# Request header of a patch upload: the trainer's step metrics as JSON, kept in the manifest.
METRICS_HEADER = "X-Sparsecast-Metrics"
# Request header of a patch or snapshot upload: the RolloutDirective of the version, as JSON.
ROLLOUT_HEADER = "X-Sparsecast-Rollout"
# Request header of a patch upload: the prompt group ids trained into the version, as a JSON list.
# The manifest keeps them: the registry, not the trainer's disk, records which version trained
# which group, so a crash between the commit and the trainer's ledger cannot train a group twice.
GROUPS_HEADER = "X-Sparsecast-Groups"


class ObjectRef(BaseModel):
    """A stored object of a run, with the sha256 of each `piece_bytes` piece for verification."""

    key: str  # relative to the run: "patches/3-4.patch", "snapshots/0.safetensors", "merged/2-6.patch"
    size: int
    piece_bytes: int
    pieces: list[str]


class RolloutDirective(BaseModel):
    """What the trainer asks rollout workers to use from a version on (they take it up when their
    weights reach it). None: the worker's own setting. Unknown fields are ignored when read (a newer
    trainer's manifest still loads), refused when uploaded (services.registry.app)."""

    kv_budget: int | None = Field(default=None, ge=1)


class Manifest(BaseModel):
    run: str
    version: int
    fingerprint: str  # of the weights at this version
    base_version: int | None = None  # None for a first snapshot
    base_fingerprint: str | None = None
    patch: ObjectRef | None = None  # base_version → version
    snapshot: ObjectRef | None = None
    dense_bytes: int  # bytes of the full weights
    changed: int | None = None  # elements the patch changes
    created_at: float
    metrics: dict[str, Any] = {}
    rollout: RolloutDirective = Field(default_factory=RolloutDirective)  # absent in older manifests
    groups: list[str] = []  # prompt groups trained into this version (GROUPS_HEADER); [] for snapshots

    @property
    def payload_ratio(self) -> float | None:
        """Dense bytes per patch byte (how much smaller than a full sync)."""
        return self.dense_bytes / self.patch.size if self.patch else None


class PlanStep(BaseModel):
    kind: Literal["snapshot", "patch"]
    object: ObjectRef
    base_version: int | None  # None for a snapshot
    target_version: int
    fingerprint: str  # weights after this step


PlanKind = Literal["none", "merged", "chain", "snapshot"]


class Plan(BaseModel):
    run: str
    from_version: int | None
    to_version: int
    kind: PlanKind
    fingerprint: str
    total_bytes: int
    steps: list[PlanStep]
    lease_s: float  # the registry keeps the plan's objects at least this long
    peers: dict[str, list[str]] = {}  # object key → peers serving it (shared.relay), best first


class QuarantinedObject(BaseModel):
    """A stored object found not to match its manifest's piece hashes (or gone): plans route
    around it and nothing is built from it until it is written again."""

    key: str
    reason: str
    found_by: Literal["reader", "scrub", "registry"]  # a worker's report, the scrub, a merge/snapshot build
    at: float  # time.time() it was found


class RepairStatus(BaseModel):
    """GET /v1/runs/{run}/quarantine: the bad objects, and whether the registry needs a snapshot of
    the head from the trainer (no good snapshot and chain reach the head: new workers could not
    start)."""

    run: str
    head: int | None
    snapshot_wanted: int | None  # the version a snapshot is wanted of (the head), None: none wanted
    quarantined: list[QuarantinedObject]


class Verdict(BaseModel):
    """The answer to a reader's report of a corrupt object: the registry re-checks what it stores."""

    key: str
    corrupt: bool
    reason: str | None = None
    quarantined: bool
