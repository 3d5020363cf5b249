"""The demo's supervisor: start the stack, feed prompts, follow training live, summarise, stop."""

from __future__ import annotations

import contextlib
import json
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
from rich.live import Live
from rich.markup import escape

from services.demo.launcher import Stack, console
from services.demo.live import summary, view
from services.demo.options import RUN, TASK, DemoOptions
from services.demo.processes import DemoFailed, Interrupted, signals_raise
from services.views import step_summary

POLL_S = 1.0


class Demo(Stack):
    """The stack, plus the training it drives over the trainer's REST API."""

    def __init__(self, options: DemoOptions) -> None:
        super().__init__(options)
        self.submitted = 0
        self.started = time.monotonic()

    # -- training --

    def api(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        try:
            response = self.http.request(method, self.urls["trainer"] + path, **kwargs)
        except httpx.HTTPError as exc:
            self.procs.check()
            raise DemoFailed(f"trainer unreachable: {exc}") from exc
        if response.status_code >= 400:
            raise DemoFailed(f"trainer answered {response.status_code} to {method} {path}: {response.text}")
        return response.json()

    def top_up(self, status: dict[str, Any]) -> None:
        """Keep about two steps of prompt groups in flight: groups dropped as stale get replaced."""
        q = status.get("queue") or {}
        in_flight = q.get("prompts_queued", 0) + q.get("leases_pending", 0) + q.get("trajectories_queued", 0)
        remaining = self.o.steps - status.get("step", 0)
        want = min(2, remaining) * self.o.groups_per_step
        if remaining > 0 and in_flight < want:
            count = want - in_flight
            options = self.o.task_options()
            self.api(
                "POST",
                "/v1/prompts",
                json={
                    "task": TASK,
                    "samples_per_prompt": self.o.samples_per_prompt,
                    "generate": {
                        "count": count,
                        "seed": 1000 + 1_000_003 * self.o.seed + self.submitted,
                        "options": options,
                    },
                },
            )
            self.submitted += count

    def train(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Feed prompts and show progress until the trainer has taken its last step."""
        self.say(
            f"training: {self.o.steps} steps × {self.o.groups_per_step} prompts × "
            f"{self.o.samples_per_prompt} "
            f"samples of the {TASK!r} task, submitted over REST; dashboard at {self.urls['trainer']}/"
        )
        history: list[dict[str, Any]] = []
        status = self.api("GET", "/v1/status")
        with Live(view(self.o, status, history, self.started), console=console, refresh_per_second=2,
                  transient=False) if self.interactive else contextlib.nullcontext() as live:
            while True:
                self.procs.check()
                status = self.api("GET", "/v1/status")
                if status.get("state") in ("failed", "stopped"):  # stopped before its last step
                    raise DemoFailed(
                        f"the trainer stopped at step {status.get('step')}: "
                        f"{status.get('error') or 'no error given'} (log {self.procs.log_dir}/trainer.log)"
                    )
                since = history[-1]["step"] if history else 0
                new = self.api("GET", "/v1/metrics/history", params={"since": since})["history"]
                history += new
                if live is not None:
                    live.update(view(self.o, status, history, self.started))
                else:
                    for row in new:
                        self.say(step_summary(row))
                if status.get("state") == "finished" or (history and history[-1]["step"] >= self.o.steps):
                    return status, history
                self.top_up(status)
                time.sleep(POLL_S)

    def figures(self, status: dict[str, Any], history: list[dict[str, Any]]) -> dict[str, Any]:
        """What the run did, as numbers: the summary table and the JSON report show these."""

        def mean(key: str, rows: list[dict[str, Any]]) -> float | None:
            values = [r[key] for r in rows if isinstance(r.get(key), int | float)]
            return sum(values) / len(values) if values else None

        head, tail = history[:3], history[-3:]
        versions = self.http.get(f"{self.urls['registry']}/v1/runs/{RUN}/versions").json()
        patches = [v["patch"]["size"] for v in versions if v.get("patch")]
        kv_saved, sparse_kv = mean("kv_saved", history), mean("kv_peak_bytes_mean", history)
        evals = [r["heldout_accuracy"] for r in history if isinstance(r.get("heldout_accuracy"), int | float)]
        baseline = status.get("heldout_baseline") or {}
        speeds = {w["worker_id"]: w["tokens_per_s"] for w in status.get("workers") or []}
        return {
            "steps": len(history),
            "wall_seconds": time.monotonic() - self.started,
            "versions": len(versions),
            "patches": len(patches),
            "dense_bytes": versions[-1]["dense_bytes"] if versions else 0,
            "patch_bytes_mean": sum(patches) / len(patches) if patches else None,
            "reward_first3": mean("reward_mean", head),
            "reward_last3": mean("reward_mean", tail),
            "accuracy_first3": mean("accuracy", head),
            "accuracy_last3": mean("accuracy", tail),
            "heldout_accuracy_start": baseline.get("heldout_accuracy"),
            "heldout_accuracy_end": evals[-1] if evals else None,
            "changed_fraction": mean("changed_fraction", history),
            "kv_saved": kv_saved,
            # Per sequence at its longest: what the sampler's cache held, and what a dense one would
            # have (kv_saved = 1 − Σ peak tokens / Σ sequence tokens, same bytes per token).
            "kv_sparse_bytes_mean": sparse_kv,
            "kv_dense_bytes_mean": sparse_kv / (1 - kv_saved) if sparse_kv and kv_saved is not None else None,
            "rejection_rate": mean("rejection_rate", history),
            # The budget published with the first and the last version (the adaptive controller's).
            "kv_budget_first": next((r["kv_budget"] for r in history if r.get("kv_budget")), None),
            "kv_budget_last": next((r["kv_budget"] for r in reversed(history) if r.get("kv_budget")), None),
            # Why the controller's budget stayed put, step by step ("moved" when it did).
            "kv_held_by_steps": dict(Counter(r.get("kv_held_by") or "moved" for r in history
                                             if r.get("kv_budget") is not None)),
            "token_mask_rate": mean("token_mask_rate", history),
            "workers": {
                f"demo-worker-{n}": {"version": v, "tokens_per_s": speeds.get(f"demo-worker-{n}")}
                for n, v in self.worker_versions(status.get("version")).items()
            },
        }

    # -- all of it --

    def run(self) -> int:
        self.prepare()
        budget = self.o.kv_budget or "sized below"
        self.say(f"[bold]sparsecast demo[/]: {self.o.workers} rollout workers ({self.o.kv_policy} KV, budget "
                 f"{budget}), {self.o.steps} steps; logs in {self.procs.log_dir}")
        self.start_redis()
        self.start_registry()
        model_dir = self.warm_start_model()
        self.calibrate_kv(model_dir)
        self.resolve_kv_budget(model_dir)
        # Everything boots at once: the trainer's registry client retries refused connections, and
        # a worker waits (not ready) until the trainer has published v0, so their imports overlap.
        self.start_trainer(model_dir)
        self.start_workers()
        self.wait_ready(["registry", "trainer", *(f"rollout-{n}" for n in range(1, self.o.workers + 1))])
        env_file = self.write_env_file()
        status, history = self.train()
        figures = self.figures(status, history)
        console.print(summary(self.o, figures, self.urls["trainer"], self.procs.log_dir))
        if self.o.report:
            options = {
                k: str(v) if isinstance(v, Path) else v for k, v in vars(self.o).items() if k != "token"
            }
            self.o.report.parent.mkdir(parents=True, exist_ok=True)
            report = {"options": options, "kv_calibration": self.calibration, "summary": figures,
                      "history": history}
            self.o.report.write_text(json.dumps(report, indent=1) + "\n")
            self.say(f"report written to {self.o.report}")
        if self.o.keep_running:
            self.say(f"the stack keeps running: dashboard {self.urls['trainer']}/ · for the CLI: "
                     f"set -a; . {env_file}; set +a; sparsecast status · Ctrl-C stops everything")
            while True:
                self.procs.check()
                time.sleep(1.0)
        return 0


def run_demo(options: DemoOptions) -> int:
    demo = Demo(options)
    code = 0
    with signals_raise():
        try:
            code = demo.run()
        except DemoFailed as exc:
            console.print(f"[red]demo failed:[/] {escape(str(exc))}")
            code = 1
        except (Interrupted, KeyboardInterrupt) as exc:
            console.print(f"\n{exc or 'interrupted'}: stopping every process the demo started …")
            code = 0 if options.keep_running else 130
        finally:
            _stop(demo)
    return code


def _stop(demo: Demo) -> None:
    def hurry(signum: int, frame: Any) -> None:
        demo.procs.hurry = True

    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, hurry)
    running = [c.name for c in demo.procs.children if c.alive()]
    demo.procs.stop_all()
    demo.cleanup_external_redis()
    demo.http.close()
    with contextlib.suppress(FileNotFoundError):
        (demo.folder / "stack.env").unlink()
    if running:
        console.print(f"stopped: {', '.join(running)}")


