"""Issue 13's faults against the real services over HTTP, each on its own redis-server (so clients
can be killed and Redis restarted or emptied without touching the shared one): rows 1, 1b, 4
and 10, and /healthz and /readyz telling the truth."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis
from safetensors.torch import load_file

from services.registry.app import create_app as create_registry
from services.registry.settings import RegistrySettings
from services.rollout.app import create_app as create_rollout
from services.rollout.settings import RolloutSettings
from services.trainer.app import create_app as create_trainer
from services.trainer.settings import TrainerSettings
from shared.coord import Coordinator, CoordSettings
from shared.kv import KVSettings
from shared.patch import save_snapshot
from shared.ports import free_port
from shared.registry.wire import MODEL_FILES
from shared.sampling import SamplingSettings
from shared.schemas import PromptGroup
from tests.conftest import build_tiny_model_dir, serve_app
from tests.integration.fault_stack import AUTH, PREFIX, TOKEN, Stack, get, metric, wait_for
from tests.private_redis import PrivateRedis


def outage_warnings(caplog: pytest.LogCaptureFixture, dependency: str, logger: str) -> int:
    return sum(1 for r in caplog.records if r.name == logger and r.levelno == logging.WARNING
               and r.getMessage().startswith(f"{dependency} unavailable"))


def test_loops_ride_out_redis_client_kill_and_restart(tmp_path: Path, tiny_model_dir: str,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """Row 1: connections killed, then Redis restarted (AOF): the trainer's step loop, the worker
    loop, its heartbeats and weight sync carry on to the last step; each outage is logged once
    per process and counted in /metrics; readiness is false only while Redis is down."""
    caplog.set_level(logging.INFO)
    with PrivateRedis(tmp_path / "redis") as redis_server, Stack(tmp_path, tiny_model_dir, redis_server.url,
                                                                  steps=6) as stack:
        stack.wait_ready()
        worker = stack.add_worker("w1")
        stack.submit(12)
        stack.wait_step(1)
        assert redis_server.kill_clients() >= 2

        def redis_gauges(name: str) -> tuple[float, float]:
            """The worker's and the trainer's `<service>_<name>{dependency="redis"}`."""
            return (metric(get(f"{worker}/metrics").text, f"rollout_{name}", dependency="redis"),
                    metric(get(f"{stack.trainer_url}/metrics").text, f"trainer_{name}", dependency="redis"))

        # A process sees a killed connection only at its next call on it, and may reconnect unawares
        # in between (make test once saw only the worker's on a slow machine): kill again until both
        # have met one.
        wait_for(lambda: min(redis_gauges("dependency_outages")) >= 1 or redis_server.kill_clients() < 0, 120,
                 "the trainer and the worker meeting a killed connection", every=0.5)
        stack.wait_step(3)
        # The restart is a second outage only for a process whose first has ended (a success since):
        # the trainer can step on trajectories the worker sent before the kill while the worker is
        # still backing off.
        wait_for(lambda: redis_gauges("dependency_up") == (1, 1), 60, "both past the killed connections")
        redis_server.stop()
        wait_for(lambda: get(f"{stack.trainer_url}/readyz").status_code == 503, 10, "trainer not ready")
        t0 = time.monotonic()
        status = stack.status()
        assert time.monotonic() - t0 < 1.0  # answered from the last reading, not held up by Redis
        assert "ConnectionError" in status["redis_error"] and status["redis_age_s"] > 0
        assert status["queue"] is not None  # that reading, with its age
        assert get(f"{stack.trainer_url}/healthz").status_code == 200  # waiting is alive
        assert "redis" in " ".join(get(f"{worker}/readyz").json()["reasons"])
        assert get(f"{worker}/healthz").status_code == 200
        # Down for 2 s and until the worker has met it (its loops call Redis while it is down; the
        # trainer's step loop, idle on an empty queue, meets it at its first call after the restart).
        time.sleep(2)
        wait_for(lambda: redis_gauges("dependency_up")[0] == 0, 60, "the worker meeting the outage")
        redis_server.start()  # same folder: the AOF brings the queue back
        stack.wait_step(6)
        assert stack.wait_workers_at_head() == 6
        wait_for(lambda: get(f"{stack.trainer_url}/readyz").status_code == 200, 30, "trainer ready again")
        wait_for(lambda: get(f"{worker}/readyz").status_code == 200, 30, "worker ready again")
        trainer_metrics, worker_metrics = (
            get(f"{stack.trainer_url}/metrics").text,
            get(f"{worker}/metrics").text,
        )
        keys = [k.decode() for k in redis_server.client().scan_iter(match="*")]
    assert metric(trainer_metrics, "trainer_dependency_outages", dependency="redis") >= 2
    assert metric(worker_metrics, "rollout_dependency_outages", dependency="redis") >= 2
    assert metric(trainer_metrics, "trainer_dependency_up", dependency="redis") == 1
    assert metric(trainer_metrics, "trainer_alive") == 1 and metric(worker_metrics, "rollout_alive") == 1
    # Logged once per outage: never more warnings than outages counted, whatever the retries.
    assert 2 <= outage_warnings(caplog, "redis", "services.trainer.core") <= metric(
        trainer_metrics, "trainer_dependency_outages", dependency="redis")
    assert outage_warnings(caplog, "redis", "services.rollout.worker") <= metric(
        worker_metrics, "rollout_dependency_outages", dependency="redis")
    assert max(stack.trained().values()) == 1
    # Row 9: every key of the stack carries the run.
    assert keys and all(k.startswith(f"{PREFIX}:faults:") for k in keys), keys


def test_redis_losing_its_data_loses_no_group(tmp_path: Path, tiny_model_dir: str) -> None:
    """Row 1b: Redis comes back empty mid-run. /v1/status never fails; the trainer notices (epoch
    key), re-creates the streams and re-enqueues what was neither trained nor queued; the run
    reaches its last step, which needs every submitted group trained, and none twice."""
    steps, per_step = 6, 2
    with PrivateRedis(tmp_path / "redis", appendonly=False) as redis_server, \
            Stack(tmp_path, tiny_model_dir, redis_server.url, steps=steps, groups_per_step=per_step) as stack:
        stack.wait_ready()
        worker = stack.add_worker("w1")
        submitted = stack.submit(steps * per_step)
        stack.wait_step(2)
        redis_server.restart(lose_data=True)
        for _ in range(20):  # while it recovers: status answers 200 every time (Stack.status asserts it)
            stack.status()
            time.sleep(0.1)
        final = stack.wait_step(steps, timeout=300)
        assert stack.wait_workers_at_head() == steps
        trained = stack.trained()
        worker_ok = get(f"{worker}/healthz").status_code
    assert sorted(trained) == sorted(submitted), f"lost: {sorted(set(submitted) - set(trained))}"
    assert max(trained.values()) == 1, [g for g, n in trained.items() if n > 1]
    assert final["faults"]["redis_data_losses"] == 1 and final["faults"]["requeued_groups"] >= 1
    assert worker_ok == 200


def test_a_trained_step_waits_for_the_registry(tmp_path: Path, tiny_model_dir: str,
                                               caplog: pytest.LogCaptureFixture) -> None:
    """Row 4: the registry is down longer than the client's own retries; the step trained meanwhile
    is published when it comes back, none is dropped, the chain of versions has no gap, and the
    worker's weight sync resumes to the head."""
    caplog.set_level(logging.INFO)
    with PrivateRedis(tmp_path / "redis") as redis_server, Stack(tmp_path, tiny_model_dir, redis_server.url,
                                                                  steps=4) as stack:
        stack.wait_ready()
        worker = stack.add_worker("w1")
        stack.submit(8)
        stack.wait_step(1)
        stack.stop_registry()
        wait_for(
            lambda: stack.status()["dependencies"]["registry"]["down"], 60, "the trainer to meet the outage"
        )
        assert get(f"{stack.trainer_url}/healthz").status_code == 200
        assert get(f"{stack.trainer_url}/readyz").status_code == 503
        assert get(f"{stack.trainer_url}/v1/versions").status_code == 503  # not a 500
        time.sleep(8)  # far past the client's inner retries (REGISTRY_RETRIES)
        stack.start_registry()
        final = stack.wait_step(4)
        head = stack.wait_workers_at_head()
        versions = stack.versions()
        history = get(f"{stack.trainer_url}/v1/metrics/history").json()["history"]
        trainer_metrics = get(f"{stack.trainer_url}/metrics").text
        assert get(f"{worker}/healthz").status_code == 200
    assert head == 4 and versions == [0, 1, 2, 3, 4]
    assert [h["version"] for h in history] == [1, 2, 3, 4]  # no trained step was dropped
    assert max(h["upload_seconds"] for h in history) > 5  # one waited out the outage
    assert final["error"] is None
    assert metric(trainer_metrics, "trainer_dependency_outages", dependency="registry") >= 1
    assert 1 <= outage_warnings(caplog, "registry", "services.trainer.core") <= metric(
        trainer_metrics, "trainer_dependency_outages", dependency="registry")


def test_worker_started_before_v0_waits_for_the_run(
    tmp_path: Path, tiny_model_dir: str, redis_url: str, redis_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Row 10: a worker whose registry is not up yet, then whose run has no version yet, stays up
    (alive, not ready, one log line) and starts working once the trainer publishes v0."""
    caplog.set_level(logging.INFO)
    run, port = "early", free_port()
    registry_url = f"http://127.0.0.1:{port}"
    settings = RolloutSettings(
        model="",
        registry_url=registry_url,
        run=run,
        device="cpu",
        redis_url=redis_url,
        redis_prefix=redis_prefix,
        worker_id="early",
        data_dir=str(tmp_path / "w"),
    )
    with serve_app(create_rollout(settings)) as worker:
        assert get(f"{worker}/healthz").status_code == 200
        r = get(f"{worker}/readyz")
        assert r.status_code == 503 and "ConnectError" in " ".join(r.json()["reasons"])
        time.sleep(1.5)
        reg = RegistrySettings(store_url=f"file://{tmp_path / 'store'}", api_token=TOKEN)
        with serve_app(create_registry(reg), port=port):
            wait_for(lambda: "has no versions yet" in " ".join(get(f"{worker}/readyz").json()["reasons"]), 30,
                     "the worker to see the empty run")
            time.sleep(1.5)
            assert get(f"{worker}/healthz").status_code == 200
            api = f"{registry_url}/v1/runs/{run}"
            for name in MODEL_FILES:
                path = Path(tiny_model_dir) / name
                if path.is_file():
                    assert (
                        httpx.put(f"{api}/model/{name}", content=path.read_bytes(), headers=AUTH).status_code
                        == 200
                    )
            weights = load_file(str(Path(tiny_model_dir) / "model.safetensors"))
            assert httpx.put(f"{api}/snapshots/0", content=save_snapshot(weights, run=run, version=0),
                             headers=AUTH).status_code == 200
            wait_for(lambda: get(f"{worker}/readyz").status_code == 200, 60, "the worker to load v0")
            assert get(f"{worker}/v1/weights").json()["version"] == 0
            assert get(f"{worker}/healthz").status_code == 200
    waits = [
        r for r in caplog.records if r.name == "services.rollout.app" and "unavailable" in r.getMessage()
    ]
    assert len(waits) == 1, [r.getMessage() for r in waits]  # one outage, one line, however many tries


def test_liveness_fails_when_a_loop_dies_or_sticks(tmp_path: Path, tiny_model_dir: str, redis_url: str,
                                                   redis_prefix: str) -> None:
    """/healthz is liveness: 503 for a worker loop stuck past its bound (here: it waits for an
    engine held by a long request), back to 200 when it moves, and 503 for good once it died."""
    settings = RolloutSettings(
        model=tiny_model_dir,
        device="cpu",
        redis_url=redis_url,
        redis_prefix=redis_prefix,
        registry_url="",
        worker_id="stuck",
        kv=KVSettings(policy="dense"),
        max_new_tokens=4,
        sampling=SamplingSettings(temperature=0),
        stall_s=2.5,
        data_dir=str(tmp_path),
    )
    app = create_rollout(settings)
    with serve_app(app) as worker:
        assert get(f"{worker}/healthz").json()["ok"] is True
        long = {"prompts": ["1+1="], "n": 8, "max_tokens": 3000, "temperature": 0, "kv_policy": "dense"}
        request = threading.Thread(target=lambda: httpx.post(f"{worker}/v1/generate", json=long, timeout=300))
        request.start()
        time.sleep(0.3)
        asyncio.run(_enqueue(redis_url, redis_prefix, settings.run,
                             [PromptGroup(id="g1", task="addition", prompt="1+1=", answer="2", samples=1)]))
        r = wait_for(lambda: (r := get(f"{worker}/healthz")).status_code == 503 and r, 60, "a stuck loop")
        assert any(p.startswith("worker loop stuck") for p in r.json()["problems"]), r.json()
        request.join()
        wait_for(lambda: get(f"{worker}/healthz").status_code == 200, 60, "the loop to move again")
        task = app.state.liveness.task("worker")
        # The loop runs on the server thread's event loop, and Task.cancel is not thread-safe: called
        # from this thread it need not wake that loop (make test once saw no dead loop within 10 s).
        task.get_loop().call_soon_threadsafe(task.cancel)
        # The first 503 may come while the cancelled loop still releases its leases and deregisters:
        # its heartbeat has ended by then, the loop itself not yet (seen under load).
        last: list[object] = []

        def dead() -> bool:
            r = get(f"{worker}/healthz")
            last[:] = [r.status_code, r.json()]
            return r.status_code == 503 and "worker loop was cancelled" in r.json()["problems"]

        try:
            wait_for(dead, 10, "a dead loop")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the last /healthz: {last}") from None
        assert "worker loop was cancelled" in get(f"{worker}/readyz").json()["reasons"]  # cannot work either


async def _enqueue(redis_url: str, prefix: str, run: str, groups: list[PromptGroup]) -> None:
    client = aioredis.from_url(redis_url)
    try:
        await Coordinator(client, prefix, run=run).enqueue(groups)
    finally:
        await client.aclose()


def test_trainer_that_cannot_start_is_not_alive(tmp_path: Path, tiny_model_dir: str, redis_url: str,
                                                redis_prefix: str) -> None:
    """A trainer whose loop died (here: the registry's run holds other weights) answers 503 on
    /healthz and /readyz, so the orchestrator restarts it instead of leaving it half up."""
    run = "taken"
    other = build_tiny_model_dir(tmp_path / "other", seed=1)
    reg = RegistrySettings(store_url=f"file://{tmp_path / 'store'}", api_token=TOKEN)
    with serve_app(create_registry(reg)) as registry_url:
        weights = load_file(str(Path(other) / "model.safetensors"))
        assert httpx.put(f"{registry_url}/v1/runs/{run}/snapshots/0", headers=AUTH,
                         content=save_snapshot(weights, run=run, version=0)).status_code == 200
        settings = TrainerSettings(model=tiny_model_dir, device="cpu", data_dir=str(tmp_path / "t"), run=run,
                                   api_token=TOKEN, registry_url=registry_url, redis_url=redis_url,
                                   redis_prefix=redis_prefix)
        with serve_app(create_trainer(settings)) as trainer:
            r = wait_for(lambda: (r := get(f"{trainer}/healthz")).status_code == 503 and r, 60, "a dead loop")
            assert "trainer loop died: RuntimeError" in r.json()["problems"][0]
            assert get(f"{trainer}/readyz").status_code == 503
            assert get(f"{trainer}/v1/status").json()["state"] == "failed"


def test_a_group_whose_reward_raises_fails_alone(tmp_path: Path, tiny_model_dir: str, redis_url: str,
                                                 redis_prefix: str) -> None:
    """Row 3: two poison groups (a countdown answer that cannot parse, and none at all) in one batch
    with three good ones: the good ones complete, each poison attempt is counted with its error and
    the group dead-lettered after max_attempts; the worker loop lives on."""
    coord = CoordSettings(max_attempts=2, base_claim=5, max_claim=5)
    settings = RolloutSettings(
        model=tiny_model_dir,
        device="cpu",
        redis_url=redis_url,
        redis_prefix=redis_prefix,
        registry_url="",
        worker_id="w-poison",
        kv=KVSettings(policy="dense"),
        max_new_tokens=4,
        data_dir=str(tmp_path),
        coord=coord,
    )
    good = [PromptGroup(id=f"good{i}", task="addition", prompt=f"{i}+1=", answer=str(i + 1), samples=2)
            for i in range(3)]
    poison = [PromptGroup(id="bad-answer", task="countdown", prompt="countdown 3 7 25 to 46\n", answer="46",
                          samples=2),
              PromptGroup(id="no-answer", task="countdown", prompt="countdown 1 2 to 3\n", samples=2)]
    asyncio.run(
        _enqueue(redis_url, redis_prefix, settings.run, [good[0], poison[0], good[1], poison[1], good[2]])
    )

    async def observe(take: bool = False) -> tuple[dict, list[dict], dict[str, str], list[str]]:
        client = aioredis.from_url(redis_url)
        try:
            c = Coordinator(client, redis_prefix, coord, run=settings.run)
            taken = [t.group_id for t in await c.next_trajectories(10, min_version=0)] if take else []
            return await c.stats(), await c.dead_letters(), await c.failures(), taken
        finally:
            await client.aclose()

    with serve_app(create_rollout(settings)) as worker:
        wait_for(lambda: (s := asyncio.run(observe())[0])["dead_letters"] == 2 and s["completions"] == 3, 120,
                 "2 dead letters and 3 completions")
        stats, dead, failures, done = asyncio.run(observe(take=True))
        alive = get(f"{worker}/healthz").status_code
        worker_metrics = get(f"{worker}/metrics").text
    assert sorted(done) == ["good0", "good1", "good2"]
    assert alive == 200
    assert stats["failures"] == 4 and stats["failed_groups"] == 2 and stats["leases_pending"] == 0
    reasons = {d["group_id"]: d["reason"] for d in dead}
    assert reasons["bad-answer"].startswith(
        "failed: 2 attempts; last error: ValueError: a countdown answer looks like"
    )
    assert reasons["no-answer"].startswith("failed: 2 attempts; last error: ValueError")
    assert failures["bad-answer"].startswith("2 w-poison: ValueError")
    assert metric(worker_metrics, "rollout_group_failures") == 4


def test_refusals_are_free_and_status_outlives_a_frozen_redis(tmp_path: Path, tiny_model_dir: str) -> None:
    """Issue 27: a refused submission writes nothing to the trainer's disk (a client retrying
    through 429s once grew the ledger to 121 MB), and /v1/status answers within a second while
    Redis is frozen (SIGSTOP), from its last reading, with that reading's age."""
    coord = CoordSettings(lease_ttl_s=3.0, max_attempts=8, base_claim=2, max_claim=2, max_queue=4)
    with PrivateRedis(tmp_path / "redis") as redis_server, Stack(
            tmp_path, tiny_model_dir, redis_server.url, steps=2, trainer={"coord": coord}) as stack:
        stack.wait_ready()
        stack.submit(4)  # the queue is now full (no worker claims)
        ledger = tmp_path / "trainer" / "groups.jsonl"
        size = ledger.stat().st_size
        big = {"task": "addition", "generate": {"count": 10_000, "seed": 1}}
        for _ in range(20):
            r = httpx.post(f"{stack.trainer_url}/v1/prompts", headers=AUTH, json=big, timeout=60)
            assert r.status_code == 429, r.text
        assert ledger.stat().st_size == size  # not a byte for a refusal
        stack.status()  # a reading taken while Redis answers
        assert redis_server.proc is not None
        redis_server.proc.send_signal(signal.SIGSTOP)
        try:
            for _ in range(3):
                t0 = time.monotonic()
                status = stack.status()
                assert time.monotonic() - t0 < 1.0
                assert status["redis_error"] and status["queue"]["prompts_queued"] == 4
                assert status["redis_age_s"] > 0
        finally:
            redis_server.proc.send_signal(signal.SIGCONT)
