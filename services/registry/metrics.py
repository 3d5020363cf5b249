"""Prometheus metrics of the registry, on a registry of their own so several apps can coexist."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class RegistryMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.publishes = Counter(
            "sparsecast_registry_publishes_total",
            "Accepted uploads, by kind (patch, snapshot, materialized).",
            ["kind"],
            registry=self.registry,
        )
        self.rejections = Counter(
            "sparsecast_registry_rejections_total",
            "Refused requests, by HTTP status.",
            ["status"],
            registry=self.registry,
        )
        self.plans = Counter(
            "sparsecast_registry_plans_total",
            "Plans handed out, by kind (none, merged, chain, snapshot).",
            ["kind"],
            registry=self.registry,
        )
        self.bytes_served = Counter(
            "sparsecast_registry_bytes_served_total",
            "Object bytes sent to clients.",
            registry=self.registry,
        )
        self.head = Gauge(
            "sparsecast_registry_head_version", "Latest committed version.", ["run"], registry=self.registry
        )
        self.merge_seconds = Histogram(
            "sparsecast_registry_merge_seconds",
            "Time to build a merged a→b patch.",
            buckets=(0.01, 0.05, 0.2, 1, 5, 20, 60),
            registry=self.registry,
        )
        self.deleted = Counter(
            "sparsecast_registry_deleted_objects_total",
            "Objects removed by retention.",
            registry=self.registry,
        )
        # Self-repair (services.registry.repair, docs/registry.md).
        self.store_full = Gauge(
            "sparsecast_registry_store_full", "1 while the store refuses writes for lack of space.",
            registry=self.registry,
        )
        self.store_full_refusals = Counter(
            "sparsecast_registry_store_full_refusals_total",
            "Writes the store refused for lack of space (answered 507).",
            registry=self.registry,
        )
        self.corrupt_found = Counter(
            "sparsecast_registry_corrupt_objects_total",
            "Stored objects found corrupt or gone, by who found them (reader, scrub, registry).",
            ["found_by"],
            registry=self.registry,
        )
        self.quarantined = Gauge(
            "sparsecast_registry_quarantined_objects", "Objects quarantined now.", ["run"],
            registry=self.registry,
        )
        self.snapshot_wanted = Gauge(
            "sparsecast_registry_snapshot_wanted",
            "1 while no good snapshot and chain reach the run's head (the trainer is asked for one).",
            ["run"],
            registry=self.registry,
        )
        self.scrubbed_bytes = Counter(
            "sparsecast_registry_scrubbed_bytes_total", "Bytes re-hashed by the scrub.",
            registry=self.registry,
        )
        self.scrub_passes = Counter(
            "sparsecast_registry_scrub_passes_total", "Completed scrub passes.", registry=self.registry,
        )
