"""A whole stack in this process for fault tests: registry (file store, restartable on its port),
trainer and rollout workers, over real HTTP on loopback and a real Redis (usually a PrivateRedis,
so the test may kill its clients or restart it)."""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from services.registry.app import create_app as create_registry
from services.registry.settings import RegistrySettings
from services.rollout.app import create_app as create_rollout
from services.rollout.settings import RolloutSettings, SyncSettings
from services.trainer.app import create_app as create_trainer
from services.trainer.ledger import LEDGER_FILE
from services.trainer.optim import OptimSettings
from services.trainer.settings import TrainerSettings
from shared.coord import CoordSettings
from shared.kv import KVSettings
from shared.ports import free_port
from shared.sampling import SamplingSettings
from tests.conftest import serve_app

TOKEN = "fault-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PREFIX = "sc"
# Short leases so a lost worker's groups come back within seconds; attempts high enough that
# ordinary faults (a killed worker, a Redis restart) never dead-letter a good group.
COORD = CoordSettings(lease_ttl_s=3.0, max_attempts=8, base_claim=2, max_claim=2)


def wait_for(check: Callable[[], Any], timeout: float, what: str, every: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s waiting for {what}"
        time.sleep(every)


def get(url: str) -> httpx.Response:
    return httpx.get(url, timeout=10)


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in a Prometheus text page (0 when absent)."""
    label = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = re.escape(name) + (r"\{" + re.escape(label) + r"\}" if label else "") + r" ([0-9.e+-]+)"
    found = re.search(r"^" + pattern + "$", text, re.M)
    return float(found.group(1)) if found else 0.0


class Stack:
    def __init__(self, tmp_path: Path, model_dir: str, redis_url: str, *, run: str = "faults", steps: int = 6,
                 groups_per_step: int = 2, trainer: dict | None = None, worker: dict | None = None) -> None:
        self.tmp = tmp_path
        self.model_dir = model_dir
        self.redis_url = redis_url
        self.run = run
        self.steps = steps
        self.registry_port = free_port()
        self.registry_url = f"http://127.0.0.1:{self.registry_port}"
        self._exit = contextlib.ExitStack()
        self._registry: contextlib.ExitStack | None = None
        self.workers: list[str] = []
        self.trainer_settings = TrainerSettings(**{
            "model": model_dir, "device": "cpu", "data_dir": str(tmp_path / "trainer"), "run": run,
            "api_token": TOKEN, "registry_url": self.registry_url, "redis_url": redis_url,
            "redis_prefix": PREFIX, "coord": COORD, "groups_per_step": groups_per_step, "max_steps": steps,
            "micro_batch": 16, "optim": OptimSettings(lr=1e-4), "checkpoint_every": 0,
            "reconcile_every_s": 1.0, "seed": 0,
        } | (trainer or {}))
        self.worker_overrides = worker or {}
        self.trainer_url = ""

    def __enter__(self) -> Stack:
        self.start_registry()
        self.trainer_url = self._exit.enter_context(serve_app(create_trainer(self.trainer_settings)))
        return self

    def __exit__(self, *exc: object) -> None:
        self._exit.close()
        if self._registry is not None:
            self._registry.close()

    # -- registry: stop and start on the same port, over the same store --

    def start_registry(self) -> None:
        settings = RegistrySettings(store_url=f"file://{self.tmp / 'store'}", api_token=TOKEN,
                                    redis_url=self.redis_url, redis_prefix=PREFIX, snapshot_every=5)
        self._registry = contextlib.ExitStack()
        self._registry.enter_context(serve_app(create_registry(settings), port=self.registry_port))

    def stop_registry(self) -> None:
        assert self._registry is not None
        self._registry.close()
        self._registry = None

    # -- workers and prompts --

    def add_worker(self, name: str) -> str:
        settings = RolloutSettings(model="", registry_url=self.registry_url, run=self.run, device="cpu",
                                   redis_url=self.redis_url, redis_prefix=PREFIX, worker_id=name,
                                   kv=KVSettings(policy="dense"), max_new_tokens=8,
                                   sampling=SamplingSettings(temperature=1.0),
                                   data_dir=str(self.tmp / name), sync=SyncSettings(poll_s=0.2), coord=COORD,
                                   **self.worker_overrides)
        url = self._exit.enter_context(serve_app(create_rollout(settings)))
        self.workers.append(url)
        return url

    def submit(self, count: int, start: int = 0) -> list[str]:
        from shared.tasks import get_task

        pairs = get_task("addition").make_prompts(count, seed=start)
        prompts = [{"id": f"p{start + i:04d}", "prompt": p, "answer": a} for i, (p, a) in enumerate(pairs)]
        r = httpx.post(f"{self.trainer_url}/v1/prompts", headers=AUTH, timeout=30,
                       json={"task": "addition", "samples_per_prompt": 2, "prompts": prompts})
        assert r.status_code == 200, r.text
        return [p["id"] for p in prompts]

    # -- observing --

    def status(self) -> dict:
        r = get(f"{self.trainer_url}/v1/status")
        assert r.status_code == 200, r.text  # never a 500, whatever Redis does
        return r.json()

    def wait_ready(self, timeout: float = 120) -> None:
        wait_for(
            lambda: get(f"{self.trainer_url}/readyz").status_code == 200, timeout, "the trainer to be ready"
        )

    def wait_step(self, step: int, timeout: float = 300) -> dict:
        """Until step `step` is trained and published (a fresh run publishes v<step> for it)."""
        def reached() -> dict | None:
            status = self.status()
            assert status["error"] is None, status["error"]
            assert status["state"] not in ("stopped", "failed"), status
            return status if status["step"] >= step and (status["version"] or 0) >= step else None

        return wait_for(reached, timeout, f"step {step}", every=0.3)

    def wait_workers_at_head(self, timeout: float = 60) -> int:
        head = get(f"{self.registry_url}/v1/runs/{self.run}/latest").json()["version"]
        for url in self.workers:
            wait_for(lambda url=url: get(f"{url}/v1/weights").json()["version"] == head, timeout,
                     f"worker {url} at v{head}")
        return head

    def trained(self) -> Counter:
        """How often each group went into a published step, from the trainer's ledger."""
        counts: Counter = Counter()
        for line in (self.tmp / "trainer" / LEDGER_FILE).read_text().splitlines():
            counts.update(json.loads(line).get("trained", ()))
        return counts

    def versions(self) -> list[int]:
        return [m["version"] for m in get(f"{self.registry_url}/v1/runs/{self.run}/versions").json()]
