"""How the CLI and the demo show a stack's numbers: formatting and rich tables (no I/O)."""

from __future__ import annotations

import time
from typing import Any

from rich.table import Table


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def pct(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{100 * x:.{digits}f}%"


def num(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def step_summary(row: dict[str, Any]) -> str:
    """One line about a training step (a /v1/metrics/history row)."""
    return (f"step {row.get('step')} → v{row.get('version')}: reward {num(row.get('reward_mean'))}, "
            f"accuracy {pct(row.get('accuracy'))}, patch {human_bytes(row.get('patch_bytes'))} vs "
            f"{human_bytes(row.get('dense_bytes'))} dense ({num(row.get('payload_ratio'), 0)}x), "
            f"changed {pct(row.get('changed_fraction'), 2)}, KV saved {pct(row.get('kv_saved'))}, "
            f"rejected {pct(row.get('rejection_rate'))}, masked {pct(row.get('token_mask_rate'))}")


def workers_table(workers: list[dict[str, Any]], trainer_version: int | None) -> Table:
    table = Table(title="rollout workers", title_justify="left")
    for column in ("worker", "engine", "KV policy", "version", "lag", "leases", "tokens/s", "download", "url"):
        table.add_column(column, justify="right" if column in ("version", "lag", "leases", "tokens/s") else "left")
    now = time.time()
    for w in sorted(workers, key=lambda w: w["worker_id"]):
        policy = w["kv_policy"] + (f"@{w['kv_budget']}" if w.get("kv_budget") else "")
        lag = "-" if trainer_version is None else str(max(0, trainer_version - w["weight_version"]))
        seen = now - w.get("updated_at", now)
        worker = w["worker_id"] + (f" (seen {seen:.0f}s ago)" if seen > 10 else "")
        table.add_row(worker, w["engine"], policy, f"v{w['weight_version']}", lag, str(w["leases"]),
                      f"{w['tokens_per_s']:.0f}", f"{w['download_mbps']:.1f} Mbit/s", w.get("url") or "-")
    return table


def versions_table(rows: list[dict[str, Any]], limit: int) -> Table:
    table = Table(title="published versions", title_justify="left")
    for column in ("version", "from", "patch", "snapshot", "dense", "smaller", "changed", "reward", "accuracy"):
        table.add_column(column, justify="right")
    for row in rows[-limit:] if limit else rows:
        metrics = row.get("metrics") or {}
        table.add_row(f"v{row['version']}", "-" if row.get("base_version") is None else f"v{row['base_version']}",
                      human_bytes(row.get("patch_bytes")), human_bytes(row.get("snapshot_bytes")),
                      human_bytes(row.get("dense_bytes")),
                      "-" if row.get("payload_ratio") is None else f"{row['payload_ratio']:.0f}x",
                      pct(row.get("changed_fraction"), 2), num(metrics.get("reward_mean")),
                      pct(metrics.get("accuracy")))
    return table


def registry_version_row(manifest: dict[str, Any]) -> dict[str, Any]:
    """A registry manifest in the shape of the trainer's /v1/versions rows."""
    patch, snapshot = manifest.get("patch"), manifest.get("snapshot")
    row = {k: v for k, v in manifest.items() if k not in ("patch", "snapshot")}
    return row | {
        "patch_bytes": patch["size"] if patch else None,
        "snapshot_bytes": snapshot["size"] if snapshot else None,
        "payload_ratio": manifest["dense_bytes"] / patch["size"] if patch else None,
        "changed_fraction": (manifest.get("metrics") or {}).get("changed_fraction"),
    }
