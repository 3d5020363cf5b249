"""Registry configuration: environment variables prefixed SPARSECAST_ (e.g. SPARSECAST_PORT)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from shared.registry.transport import KEEP_ALIVE_S
from shared.settings import ServiceSettings


class RegistrySettings(ServiceSettings):
    port: int = 8100
    # file://<dir> (default), s3://<bucket>[/<prefix>] for S3/MinIO, gs://, az://; memory:// only
    # for tests. store_options: the store's connection settings in obstore's names (shared.storage),
    # one variable each: SPARSECAST_STORE_OPTIONS__ENDPOINT=http://minio:9000, ..._REGION, ...
    store_url: str = "file://./data/registry"
    store_options: dict[str, str] = Field(default_factory=dict)
    # api_token: the bearer token for writes and for plans that may build merged patches. Unset:
    # writes are open, which is allowed on a loopback bind only (the service refuses to start
    # otherwise). run: the run served by default (e.g. the CLI's); the HTTP API serves any run
    # named in the path. redis_url: where new versions are announced (unset: not announced).
    # publish_token (SPARSECAST_PUBLISH_TOKEN): the bearer token of publishing (patches, snapshots,
    # model files), held by the trainer alone; unset: api_token (deprecated, warned once). The api
    # token then stays for workers' relay announcements and merge-building plans (the publish
    # token is accepted there too).
    publish_token: str | None = None
    # The registry materializes a full snapshot every N versions (grail/PULSE keep a full
    # checkpoint every 10 versions, arXiv 2602.03839); 0 turns that off (trainer uploads only).
    snapshot_every: int = Field(default=10, ge=0)
    keep_snapshots: int = Field(default=2, ge=1)
    max_upload_bytes: int = Field(default=16 << 30, gt=0)
    # Download verification unit: each piece of each stored object has its sha256 in the manifest.
    piece_bytes: int = Field(default=4 << 20, gt=0)
    # Objects named by a plan are kept at least this long after the plan was handed out.
    plan_lease_s: float = Field(default=300.0, ge=0)
    # Merged a→b patches are only computed for lags up to this (beyond it snapshots win anyway).
    max_merge_lag: int = Field(default=32, ge=0)
    # Unauthenticated plans never build merges; the lags they wanted within this long are merged
    # when the next versions are published, at most max_publish_merges per publish.
    merge_demand_s: float = Field(default=600.0, ge=0)
    max_publish_merges: int = Field(default=4, ge=0)
    # Relay fan-out (shared.relay): a worker's announcement of the objects it serves lasts this
    # long; plans and announcements list at most peer_max_listed peers per object.
    peer_ttl_s: float = Field(default=60.0, gt=0)
    peer_max_listed: int = Field(default=3, ge=0)
    # Workers keep one order from version to version (warm connections between the same
    # neighbours): an announcement waits at most this long for predecessors expected on the same
    # new patch (services/registry/peers.py; 0: arrival order).
    peer_order_wait_s: float = Field(default=1.0, ge=0)
    # How workers are arranged for a new patch: "chain" (the order above), or "measured" (a tree
    # by the paths workers measure and report, the chain where nothing is measured yet;
    # services/registry/peers.py). The chain by default: the tree is measured with one slow uplink
    # only (docs/registry.md, "A tree chosen by measured paths").
    peer_tree: Literal["chain", "measured"] = "chain"
    # The scrub re-hashes every stored object of every run in the store against its manifest's piece
    # hashes every scrub_every_s (0: never; readers' reports still quarantine), reading at most
    # scrub_bytes_per_s so that it never competes with serving (docs/registry.md, self-repair).
    scrub_every_s: float = Field(default=3600.0, ge=0)
    scrub_bytes_per_s: float = Field(default=float(64 << 20), gt=0)
    # An idle keep-alive connection is closed after keep_alive_s: long enough that workers reuse
    # warm connections from one version to the next (shared.registry.transport.KEEP_ALIVE_S). An
    # upload whose body stalls for upload_idle_s, or takes longer than upload_timeout_s in all, is
    # refused (408).
    keep_alive_s: int = Field(default=KEEP_ALIVE_S, ge=1)
    upload_idle_s: float = Field(default=60.0, gt=0)
    upload_timeout_s: float = Field(default=3600.0, gt=0)
