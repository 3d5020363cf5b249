"""The trainer service without HTTP: its lifecycle (Redis, registry, ledger, the step loop), and
what its endpoints report (status, versions, readiness, Prometheus metrics). services.trainer.app
is a thin FastAPI layer over this; services.trainer.core.Trainer is the step loop itself."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import secrets
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from services.trainer.admission import worker_refusal
from services.trainer.core import LOOP, Trainer, TrainerHealth
from services.trainer.intake import PromptIn, PromptsAccepted, enqueue
from services.trainer.ledger import GroupLedger
from services.trainer.repair import repair_loop
from services.trainer.settings import TrainerSettings
from services.trainer.warmstart import steps_trained
from shared.agreement import sampling_mismatch
from shared.coord import Coordinator, connect
from shared.health import HealthMetrics
from shared.registry.client import RegistryClient
from shared.registry.errors import RegistryHTTPError
from shared.settings import publish_credential

log = logging.getLogger(__name__)
# The trainer's own calls ride out registry outages (shared.retry: logged once, counted), so its
# client retries only once inside, for a blip.
REGISTRY_RETRIES = 1
# How long /readyz waits for Redis and the registry to answer.
PROBE_TIMEOUT_S = 2.0
# /v1/status waits this long for Redis, then answers from its last reading (with its age).
STATUS_REDIS_TIMEOUT_S = 0.5
# Worker throughput is sampled by the server (not by whoever has the dashboard open): every
# THROUGHPUT_EVERY_S seconds, the last THROUGHPUT_SAMPLES kept (one hour).
THROUGHPUT_EVERY_S = 5.0
THROUGHPUT_SAMPLES = 720


class Unavailable(Exception):
    """The trainer or a dependency cannot answer now (HTTP 503)."""


def load_api_token(settings: TrainerSettings) -> str:
    if settings.api_token:
        return settings.api_token
    path = Path(settings.data_dir) / "api-token"
    if path.is_file():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(24)
    path.write_text(token + "\n")
    path.chmod(0o600)
    log.warning("no SPARSECAST_API_TOKEN set: generated one in %s", path)
    return token


class TrainerMetrics:
    """The trainer's Prometheus gauges, refreshed on each scrape."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self.gauges = {
            name: Gauge(f"trainer_{name}", doc, registry=registry)
            for name, doc in {
                "step": "Optimizer steps taken",
                "version": "Weight version published last",
                "reward_mean": "Mean reward of the last batch",
                "accuracy": "Exact-answer rate of the last batch",
                "rejection_rate": "Sequences vetoed by the Sparse-RL correction",
                "token_mask_rate": "Tokens masked (ξ out of band)",
                "xi_mean": "Mean ξ = π_old_dense/π_sampler",
                "kl_old_sampler": "KL(π_old_dense ‖ π_sampler) estimate",
                "changed_fraction": "Fraction of bf16 weights changed by the last step",
                "patch_bytes": "Bytes of the last patch",
                "payload_ratio": "Dense bf16 bytes / patch bytes",
                "step_seconds": "Wall time of the last step",
                "kv_saved": "KV memory the samplers saved vs a dense cache",
                "kv_budget": "KV budget published with the last version (the workers' from it on)",
                "kv_signal": "The KV budget controller's smoothed mismatch signal",
            }.items()
        }
        self.coord = Gauge("coord", "Coordination counters and depths", ["name"], registry=registry)
        self.faults = {name: Gauge(f"trainer_{name}", doc, registry=registry) for name, doc in {
            "requeued_groups": "Groups queued again because Redis no longer held them",
            "duplicate_trajectories": "Trajectories dropped because their group was trained or held already",
            "redis_data_losses": "Times Redis was found without the run's data",
        }.items()}
        self.health = HealthMetrics(registry, "trainer")
        self.staleness = Gauge("trainer_staleness_groups", "Groups of the last batch by version lag", ["lag"],
                               registry=registry)
        # Reasons are short texts of a few kinds (sampling contract, services.trainer.admission).
        self.refused = Gauge("trainer_refused_trajectories", "Trajectories refused (not trained), by reason",
                             ["reason"], registry=registry)

    def update(
        self, trainer: Trainer | None, health: TrainerHealth, coord_stats: dict[str, Any] | None
    ) -> None:
        if trainer is not None:
            self.gauges["step"].set(trainer.step)
            self.gauges["version"].set(trainer.version)
            last = trainer.history[-1] if trainer.history else {}
            for name, gauge in self.gauges.items():
                if isinstance(last.get(name), int | float):
                    gauge.set(last[name])
            for lag, count in (last.get("staleness") or {}).items():
                self.staleness.labels(lag).set(count)
            for reason, count in trainer.refused.items():
                self.refused.labels(reason).set(count)
            self.faults["requeued_groups"].set(trainer.requeued)
            self.faults["duplicate_trajectories"].set(trainer.duplicates_dropped)
            self.faults["redis_data_losses"].set(trainer.redis_data_losses)
        self.health.update([health.redis, health.registry, health.disk], health.liveness)
        for name, value in (coord_stats or {}).items():
            self.coord.labels(name).set(value)

    def text(self) -> bytes:
        return generate_latest(self.registry)


class TrainerService:
    """One trainer process: `state` holds the Trainer once it has booted (None before), the
    error that stopped it, and its coordinator, registry client and ledger while running."""

    def __init__(self, settings: TrainerSettings) -> None:
        self.settings = settings
        self.token = load_api_token(settings)
        self.health = TrainerHealth()
        self.metrics = TrainerMetrics()
        self.state: dict[str, Any] = {"trainer": None, "error": None}
        self.throughput: collections.deque[dict[str, Any]] = collections.deque(maxlen=THROUGHPUT_SAMPLES)
        self._redis_reading: tuple[float, Any, Any, Any] | None = None  # (time, stats, workers, leases)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Connect, boot the trainer in the background (resume, publish v0, then the step loop),
        and on exit stop it and close the connections."""
        settings, state = self.settings, self.state
        redis = connect(settings.redis_url)
        coord = Coordinator(redis, settings.redis_prefix, settings.coord, run=settings.run)
        # Published with the publish token (least privilege: the API token only submits prompts);
        # with neither set, the generated API token (a loopback registry without tokens takes any).
        publish_token = (publish_credential(settings.publish_token, settings.api_token, "trainer")
                         or self.token)
        client = RegistryClient(settings.registry_url, settings.run, token=publish_token,
                                retries=REGISTRY_RETRIES)
        ledger = await asyncio.to_thread(GroupLedger.in_dir, settings.data_dir, settings.run)
        state["coord"], state["registry"], state["ledger"] = coord, client, ledger
        stop = asyncio.Event()
        built: list[Trainer] = []
        boot_clock: list[int] = []  # CPU clock of the thread that builds the trainer

        def build() -> Trainer:
            boot_clock.append(time.pthread_getcpuclockid(threading.get_ident()))
            return Trainer(settings, client, coord, ledger=ledger, health=self.health)

        def boot_progress() -> float:
            """While the trainer is built (warm start, model load: nothing beats yet, and either can
            outlast SPARSECAST_STALL_S), progress is the warm start's steps plus the building thread's
            CPU seconds: a load that computes or reads is alive, one blocked on nothing is stuck.
            Constant once built: the loop's own beats count from then on."""
            if built or not boot_clock:
                return 0.0
            return steps_trained() + time.clock_gettime(boot_clock[0])

        async def boot() -> None:
            try:
                trainer = await asyncio.to_thread(build)
                built.append(trainer)
                await trainer.start(stop)
                state["trainer"] = trainer
                await trainer.run(stop)
            except Exception as exc:
                if stop.is_set():
                    return  # shutting down: an outage wait was cut short
                state["error"] = f"{type(exc).__name__}: {exc}"
                log.exception("trainer stopped")
                raise  # the loop is dead: /healthz says so, and the orchestrator restarts us

        async def sample_throughput() -> None:
            while not stop.is_set():
                with contextlib.suppress(Exception):  # Redis down: a gap in the history, no error
                    workers = await coord.workers()
                    self.throughput.append({"time": time.time(),
                                            "workers": {w.worker_id: w.tokens_per_s for w in workers}})
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), THROUGHPUT_EVERY_S)

        async def head_weights() -> tuple[int, dict[str, Any]] | None:
            trainer = state["trainer"]
            if trainer is None:  # not started: the registry's head is not ours yet
                return None
            version = trainer.version  # read first: the weights are this version or the next
            return version, trainer._cpu(await asyncio.to_thread(trainer.learner.full_published))

        task = asyncio.create_task(boot())
        sampler = asyncio.create_task(sample_throughput())
        # Uploads a snapshot of the head when the registry, finding a stored object corrupt,
        # cannot reach its head otherwise (services.trainer.repair).
        repairer = asyncio.create_task(repair_loop(client, head_weights, stop))
        self.health.liveness.watch(LOOP, task, settings.stall_s, may_finish=True, progress=boot_progress)
        try:
            yield
        finally:
            stop.set()
            sampler.cancel()
            repairer.cancel()
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
                await asyncio.wait_for(task, timeout=60)
            for trainer in built:  # under torchrun: let the other ranks go
                await asyncio.to_thread(trainer.learner.close)
            await client.aclose()
            await redis.aclose()

    @property
    def trainer(self) -> Trainer | None:
        return self.state["trainer"]

    def running_trainer(self) -> Trainer:
        """The trainer, or Unavailable while it starts or after it failed."""
        if self.trainer is None:
            raise Unavailable(
                self.state["error"] or "trainer is starting (loading or warm-starting the model)"
            )
        return self.trainer

    async def submit(self, task: str | None, samples: int | None, items: list[PromptIn]) -> PromptsAccepted:
        return await enqueue(self.settings, self.state["ledger"], self.state["coord"], task, samples, items)

    async def status(self) -> dict[str, Any]:
        """Never fails for a Redis fault: with Redis unreachable, queue and workers are null and
        `redis_error` says why."""
        trainer, settings, state = self.trainer, self.settings, self.state
        coord: Coordinator = state["coord"]
        stats: dict | None = None
        workers: list = []
        redis_error = None
        held: dict[str, int] = {}
        table: list = []
        try:
            # Bounded: a frozen Redis must not hold status up (it answers from the last reading).
            stats, workers, table = await asyncio.wait_for(
                asyncio.gather(coord.stats(), coord.workers(), coord.leases(1000)), STATUS_REDIS_TIMEOUT_S)
            self._redis_reading = (time.time(), stats, workers, table)
        except Exception as exc:  # noqa: BLE001 - status reports a broken dependency, it does not fail
            redis_error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            if self._redis_reading is not None:
                _, stats, workers, table = self._redis_reading
        # Leases each worker holds now, from the same table as the queue's count: the two agree.
        for row in table:
            if row["expires_in_s"] > 0:
                held[row["holder"]] = held.get(row["holder"], 0) + 1
        redis_age = round(time.time() - self._redis_reading[0], 3) if self._redis_reading else None
        return {
            "run": settings.run,
            "state": trainer.state if trainer else ("failed" if state["error"] else "starting"),
            "error": state["error"] or (trainer.last_error if trainer else None),
            "paused": bool(trainer and trainer.paused.is_set()),
            "step": trainer.step if trainer else 0,
            "version": trainer.version if trainer else None,
            "max_steps": settings.max_steps,
            "queue": stats,
            # A worker whose samples this trainer would refuse says why (shared.agreement, admission).
            "workers": [w.model_dump() | {"disagreement": sampling_mismatch(settings.sampling, w.sampling)
                                          or worker_refusal(w, settings.worker_token),
                                          "leases_held": held.get(w.worker_id, 0)} for w in workers],
            "redis_error": redis_error,
            "redis_age_s": redis_age,  # how old queue/workers are: 0 unless Redis failed to answer now
            "dependencies": {"redis": self.health.redis.state(), "registry": self.health.registry.state(),
                             "disk": self.health.disk.state()},
            "faults": {
                "requeued_groups": trainer.requeued if trainer else 0,
                "duplicate_trajectories": trainer.duplicates_dropped if trainer else 0,
                "redis_data_losses": trainer.redis_data_losses if trainer else 0,
            },
            "last": trainer.history[-1] if trainer and trainer.history else None,
            # Trajectories the trainer would not train on (sampling contract, admission), by reason.
            "refused_trajectories": dict(trainer.refused) if trainer else {},
            "heldout_baseline": trainer.eval_baseline if trainer else None,
            # The checkpoint this process resumed from: its version and the state's checksum as
            # saved and as loaded (equal: Adam's moments and the step survived the restart).
            "resumed": trainer.resumed if trainer else None,
            # The KV budget published with the last version and the controller behind it.
            "kv_control": ({"mode": settings.kv_control.mode, "metric": settings.kv_control.metric,
                            "target": settings.kv_control.target} | trainer.kv_control.state()
                           if trainer else None),
        }

    async def versions(self) -> dict[str, Any]:
        try:
            manifests = await self.state["registry"].versions()
        except (RegistryHTTPError, httpx.HTTPError) as exc:
            raise Unavailable(f"the registry is unavailable: {exc}") from exc
        return {"run": self.settings.run, "versions": [
            m.model_dump(exclude={"patch", "snapshot"}) | {
                "patch_bytes": m.patch.size if m.patch else None,
                "snapshot_bytes": m.snapshot.size if m.snapshot else None,
                "payload_ratio": m.payload_ratio,
                "changed_fraction": m.metrics.get("changed_fraction"),
            } for m in manifests]}

    def throughput_since(self, since: float) -> list[dict[str, Any]]:
        return [r for r in self.throughput if r["time"] > since]

    async def leases(self, limit: int) -> dict[str, Any]:
        """Leases held now (holder, seconds to expiry, reclaims; expired or released ones wait for
        the next claim) and the dead letters with their reasons. Unavailable while Redis is down."""
        coord: Coordinator = self.state["coord"]
        try:
            held, dead = await asyncio.gather(coord.leases(limit), coord.dead_letters(limit))
        except Exception as exc:  # noqa: BLE001 - a Redis fault is a 503, whatever its type
            raise Unavailable(f"Redis is unreachable: {exc}") from exc
        return {"lease_ttl_s": self.settings.coord.lease_ttl_s, "leases": held, "dead_letters": [
            {k: d.get(k) for k in ("entry_id", "group_id", "worker_id", "attempts", "reason")}
            | {"time": int(d["id"].split("-")[0]) / 1000} for d in dead]}

    def history(self, since: int) -> list[dict[str, Any]]:
        rows = self.trainer.history if self.trainer else []
        return [r for r in rows if r.get("step", 0) > since]

    def liveness(self) -> dict[str, Any]:
        """The step loop died or made no progress for stall_s (waiting out an outage counts as
        progress): `ok` is false."""
        problems = self.health.liveness.problems()
        return {"ok": not problems, "problems": problems, "loops": self.health.liveness.loops()}

    async def readiness(self) -> dict[str, Any]:
        """The model is loaded and running, and Redis and the registry answer now."""
        trainer, state = self.trainer, self.state
        reasons = []
        if trainer is None:
            reasons.append(state["error"] or "starting: loading the model and publishing v0")
        elif state["error"]:
            reasons.append(state["error"])
        reasons += self.health.liveness.problems()  # a dead or stuck loop cannot work either
        redis_error, registry_error = await asyncio.gather(
            _probe(state["coord"].redis.ping()), _probe(state["registry"].ping(PROBE_TIMEOUT_S)))
        if redis_error:
            reasons.append(f"redis: {redis_error}")
        if registry_error:
            reasons.append(f"registry: {registry_error}")
        if self.health.disk.down:
            reasons.append(f"data dir full, waiting for space: {self.health.disk.last_error}")
        return {
            "ready": not reasons,
            "state": trainer.state if trainer else "starting",
            "error": state["error"],
            "reasons": reasons,
        }

    async def metrics_text(self) -> bytes:
        stats = None
        with contextlib.suppress(Exception):
            stats = await self.state["coord"].stats()
        self.metrics.update(self.trainer, self.health, stats)
        return self.metrics.text()


async def _probe(call: Any) -> str | None:
    """None when the awaitable completes within PROBE_TIMEOUT_S, else what went wrong."""
    try:
        await asyncio.wait_for(call, timeout=PROBE_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - any failure means: not ready
        return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return None
