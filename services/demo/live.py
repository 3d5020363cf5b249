"""The demo's live view while it trains, and its closing summary table."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rich.console import Group
from rich.panel import Panel
from rich.table import Table

from services.demo.options import DemoOptions
from services.views import human_bytes, num, pct, workers_table


def view(o: DemoOptions, status: dict[str, Any], history: list[dict[str, Any]], started: float) -> Group:
    """The live panel: the last step's numbers and the workers."""
    last = history[-1] if history else {}
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    grid.add_row("step", f"{status.get('step', 0)}/{o.steps}  ({status.get('state')}, "
                         f"{time.monotonic() - started:.0f}s)")
    grid.add_row("version", f"v{status.get('version')}" if status.get("version") is not None else "-")
    grid.add_row("reward", num(last.get("reward_mean")) + trend(history, "reward_mean"))
    grid.add_row("accuracy", pct(last.get("accuracy")) + trend(history, "accuracy", as_pct=True))
    grid.add_row(
        "patch",
        f"{human_bytes(last.get('patch_bytes'))} vs {human_bytes(last.get('dense_bytes'))} dense"
        f" ({num(last.get('payload_ratio'), 0)}x smaller), changed "
        f"{pct(last.get('changed_fraction'), 2)}",
    )
    grid.add_row("KV saved", f"{pct(last.get('kv_saved'))} with {o.kv_policy}@{o.kv_budget} "
                             f"(peak {human_bytes(last.get('kv_peak_bytes_mean'))} per sequence)")
    if o.kv_adaptive:  # the budget the trainer published with its last version, and why
        grid.add_row("KV budget", f"{last.get('kv_budget') or o.kv_budget} tokens from the next swap "
                                  f"(adaptive: {signal_text(last)})")
    grid.add_row("corrections", f"rejected {pct(last.get('rejection_rate'))}, masked "
                                f"{pct(last.get('token_mask_rate'))} of tokens")
    q = status.get("queue") or {}
    grid.add_row("queue", f"{q.get('prompts_queued', 0)} waiting, {q.get('leases_pending', 0)} leased, "
                          f"{q.get('trajectories_queued', 0)} trajectories")
    workers = status.get("workers") or []
    return Group(Panel(grid, title="sparsecast demo", title_align="left"),
                 workers_table(workers, status.get("version")))


# The demo's documented runs veto 38-51 % of their sequences and learn; at 67-98 % they did not
# (bench/results/demo-cpu-avx512bf16.json): the summary then says why the batches stay flat.
MOSTLY_VETOED = 0.65
# Runs that learn gain 9-17 points; those capped by the cache 0-2 (bench/results/demo-cpu*.json).
FLAT_RISE = 0.05


def summary(o: DemoOptions, f: dict[str, Any], dashboard: str, log_dir: Path) -> Table:
    """The closing table of what the run did (`f`: Demo.figures)."""
    table = Table(title="sparsecast demo: summary", title_justify="left")
    table.add_column("", style="bold")
    table.add_column("value")
    rise = (f["accuracy_last3"] - f["accuracy_first3"]
            if f["accuracy_last3"] is not None and f["accuracy_first3"] is not None else None)
    table.add_row("steps", f"{f['steps']} in {f['wall_seconds']:.0f}s (whole demo)")
    table.add_row("versions published", f"{f['versions']} (v0 snapshot + {f['patches']} patches)")
    table.add_row("reward (first 3 → last 3 steps)", f"{num(f['reward_first3'])} → {num(f['reward_last3'])}")
    table.add_row(
        "accuracy (first 3 → last 3 steps)",
        f"{pct(f['accuracy_first3'])} → {pct(f['accuracy_last3'])}"
        + (f" ({rise * 100:+.0f} points)" if rise is not None else ""),
    )
    if f["heldout_accuracy_start"] is not None and f["heldout_accuracy_end"] is not None:
        table.add_row("held-out accuracy (dense cache, T=1)",
                      f"{pct(f['heldout_accuracy_start'])} → {pct(f['heldout_accuracy_end'])}")
    if f["patches"]:
        dense, patch = f["dense_bytes"], f["patch_bytes_mean"]
        table.add_row("patch per step (mean)", f"{human_bytes(patch)} vs {human_bytes(dense)} dense: "
                                               f"{dense / patch:.0f}x smaller")
        table.add_row("bytes shipped per worker", f"{human_bytes(patch * f['patches'])} instead of "
                                                  f"{human_bytes(dense * f['patches'])}")
    table.add_row("weights changed per step", pct(f["changed_fraction"], 2))
    table.add_row("KV per sequence (sparse vs dense)",
                  f"{human_bytes(f['kv_sparse_bytes_mean'])} vs {human_bytes(f['kv_dense_bytes_mean'])}: "
                  f"{pct(f['kv_saved'])} saved ({o.kv_policy}, budget {kv_budget_text(o, f)} tokens"
                  f"{' + the prompt' if o.kv_keep_prompt else ', prompt included'})")
    if held := f.get("kv_held_by_steps"):
        table.add_row("KV budget, step by step", held_text(held, o))
    table.add_row("corrections: sequences vetoed / tokens masked",
                  f"{pct(f['rejection_rate'])} / {pct(f['token_mask_rate'])}")
    remedy = ("a larger --kv-budget keeps more, --kv-calibrate 0.7 picks one for the model "
              "(docs/training.md, \"On another machine: the warm start decides\")")
    if (f["rejection_rate"] or 0.0) >= MOSTLY_VETOED:
        table.add_row("[yellow]note[/]",
                      "most batches were vetoed: under this cache the sampler writes tokens the dense "
                      f"policy rejects, and little is left to learn from; {remedy}")
    elif rise is not None and rise < FLAT_RISE and o.kv_policy != "dense":
        table.add_row("[yellow]note[/]",
                      f"the batches, sampled under the {o.kv_policy} cache, barely rose: this cache caps "
                      f"what the sampler gets right, whatever the policy learns (held-out above); {remedy}")
    for name, w in f["workers"].items():
        table.add_row(f"worker {name}", f"serving v{w['version']}"
                      + (f", {w['tokens_per_s']:.0f} tokens/s" if w["tokens_per_s"] else ""))
    table.add_row("dashboard", f"{dashboard}/" + ("" if o.keep_running else " (while running)"))
    table.add_row("logs", str(log_dir))
    return table


def kv_budget_text(o: DemoOptions, f: dict[str, Any]) -> str:
    """The workers' budget, or with the adaptive controller its first → last published value."""
    first, last = f.get("kv_budget_first"), f.get("kv_budget_last")
    if not o.kv_adaptive or first is None or last is None:
        return str(o.kv_budget)
    return f"{first} → {last} (adaptive)"


# The controller's metrics (services.trainer.kv_budget.Metric) in words; shares print as percentages.
METRIC_WORDS = {"divergent_rate": "divergent share", "rejection_rate": "veto rate",
                "kl_old_sampler": "KL(dense ‖ sampler)"}
HELD_WORDS = {"moved": "moved", "target": "held inside the target band", "evidence": "waited for evidence",
              "floor": "held by the floor on the KV saved", "min_budget": "held at --kv-min",
              "max_budget": "held at --kv-max", "fixed": "fixed"}


def signal_text(last: dict[str, Any]) -> str:
    """The controller's smoothed signal against its target, and why the budget stayed if it did."""
    metric = last.get("kv_metric")
    value, target = last.get("kv_signal"), last.get("kv_target")
    fmt = num if metric == "kl_old_sampler" else pct
    text = f"{METRIC_WORDS.get(metric or '', 'mismatch')} {fmt(value)}"
    if target is not None:
        text += f", target {fmt(target)}"
    held = last.get("kv_held_by")
    return text + (f"; {HELD_WORDS.get(held, held)}" if held else "")


def held_text(held: dict[str, int], o: DemoOptions) -> str:
    """How many steps the controller moved its budget or held it, and by what (most first)."""
    words = dict(HELD_WORDS, floor=f"held by the floor ({pct(o.kv_min_saved)} of the KV saved)")
    total = sum(held.values())
    return ", ".join(f"{words.get(k, k)} {n}" for k, n in sorted(held.items(), key=lambda kv: -kv[1])) + (
        f" of {total} steps")


def trend(history: list[dict[str, Any]], key: str, as_pct: bool = False) -> str:
    values = [r[key] for r in history if isinstance(r.get(key), int | float)]
    if len(values) < 2:
        return ""
    first = sum(values[:3]) / len(values[:3])
    fmt = pct if as_pct else num
    return f"  (first steps {fmt(first)})"
