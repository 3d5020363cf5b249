"""Issue 27, the registry's store fills mid-run: its patch PUTs answer 507 (never a 500), the trainer
waits and retries the same version (no step dropped, no gap in the chain), and the run resumes by
itself when space returns. The stack of tests.integration.fault_stack, with the registry's file
store refusing writes (ENOSPC) while the test says it is full."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

from fastapi import Request

from services.registry.app import create_app as create_registry
from services.registry.settings import RegistrySettings
from tests.conftest import serve_app
from tests.integration.fault_stack import PREFIX, TOKEN, Stack, get, metric, wait_for
from tests.private_redis import PrivateRedis
from tests.unit.services.registry.test_registry_repair import FullableStore

STEPS = 4


class FullStoreStack(Stack):
    def start_registry(self) -> None:
        settings = RegistrySettings(store_url=f"file://{self.tmp / 'store'}", api_token=TOKEN,
                                    redis_url=self.redis_url, redis_prefix=PREFIX, snapshot_every=5)
        self.store = FullableStore(settings.store_url)
        self.statuses: list[int] = []  # every answer of the registry to a patch upload
        app = create_registry(settings, storage=self.store)

        @app.middleware("http")
        async def record(request: Request, call_next: Any) -> Any:
            try:
                response = await call_next(request)
            except Exception:
                response = None
            if request.method == "PUT" and "/patches/" in request.url.path:
                self.statuses.append(500 if response is None else response.status_code)
            return response

        self._registry = contextlib.ExitStack()
        self._registry.enter_context(serve_app(app, port=self.registry_port))


def test_a_full_registry_store_is_waited_out_with_no_step_dropped(tmp_path: Path,
                                                                  tiny_model_dir: str) -> None:
    with PrivateRedis(tmp_path / "redis") as redis_server, FullStoreStack(
            tmp_path, tiny_model_dir, redis_server.url, run="storefull", steps=STEPS) as stack:
        stack.wait_ready()
        stack.add_worker("w1")
        submitted = stack.submit(2 * STEPS)
        stack.wait_step(1)
        stack.store.full = True
        wait_for(lambda: stack.status()["dependencies"]["registry"]["down"], 120,
                 "the trainer to meet the full store")
        error = stack.status()["dependencies"]["registry"]["last_error"]
        assert "507" in error and "full" in error, error
        health = get(f"{stack.registry_url}/healthz").json()
        assert health["status"] == "degraded" and "store full" in health["reasons"][0]
        time.sleep(3)  # several refused tries: each a 507, none a 500
        registry_metrics = get(f"{stack.registry_url}/metrics").text
        refused = list(stack.statuses)
        stack.store.full = False  # space is freed: nobody does anything else
        final = stack.wait_step(STEPS, timeout=180)
        versions = stack.versions()
        trained = stack.trained()
        history = get(f"{stack.trainer_url}/v1/metrics/history").json()["history"]
        assert get(f"{stack.registry_url}/healthz").json()["status"] == "ok"
    assert metric(registry_metrics, "sparsecast_registry_store_full_refusals_total") >= 2
    assert refused.count(507) >= 2 and set(refused) <= {200, 507}, refused
    assert 500 not in stack.statuses
    assert versions == list(range(STEPS + 1))  # no gap: the refused version was published later
    assert [h["version"] for h in history] == list(range(1, STEPS + 1))  # no trained step dropped
    assert final["error"] is None
    assert len(trained) == len(submitted) and max(trained.values()) == 1  # none lost, none twice
