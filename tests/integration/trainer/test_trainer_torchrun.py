"""The trainer service under `torchrun --nproc_per_node 2` on CPU (gloo), over real HTTP with a real
registry and Redis: rank 0 serves the API and drives rank 1; a stand-in worker answers the
prompts; every version is published, a client reaches the last one by patches from the v0
snapshot (fingerprints verified), and both ranks wrote their shards of the checkpoint."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from transformers import AutoTokenizer

from services.registry.app import create_app as create_registry
from services.registry.settings import RegistrySettings
from services.rollout.engine.config import GenerationOutput
from services.rollout.worker import score_samples
from shared.coord import Coordinator, CoordSettings, connect
from shared.patch import fingerprint
from shared.ports import free_port
from shared.registry.client import RegistryClient
from shared.registry.sync import sync_weights
from shared.schemas import KVStats, SamplingInfo, Trajectory, WorkerInfo
from shared.tasks import get_task
from tests.conftest import serve_app
from tests.paths import REPO_ROOT

TOKEN = "torchrun-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ROOT = REPO_ROOT
STEPS = 3


async def answer_prompts(redis_url: str, prefix: str, run: str, model_dir: str, until: float) -> int:
    """A worker that samples random tokens: claims groups and completes them until `until`, its
    samples scored as a real worker scores them (the trainer admits nothing else)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    redis = connect(redis_url)
    coord = Coordinator(redis, prefix, CoordSettings(), run=run)
    rng = random.Random(0)
    done = 0
    try:
        while time.monotonic() < until:
            version = await coord.trainer_version()
            await coord.register_worker(WorkerInfo(worker_id="w", weight_version=max(version, 0)))
            for lease in await coord.claim("w", 2, block_ms=200):
                task = get_task(lease.group.task)
                prompt_ids = list(tokenizer(lease.group.prompt).input_ids)
                outputs = []
                for _ in range(lease.group.samples):
                    completion = [rng.randrange(4, len(tokenizer)) for _ in range(rng.randrange(2, 8))]
                    outputs.append(GenerationOutput(
                        token_ids=completion, logprobs=[-rng.uniform(1, 5) for _ in completion],
                        finish_reason="stop", kv=KVStats(peak_tokens=6, peak_bytes=100, evicted=0)))
                samples = score_samples(
                    task, lease.group.answer or "", prompt_ids, outputs,
                    lambda ids: str(tokenizer.decode(list(ids), skip_special_tokens=True)))
                trajectory = Trajectory(
                    group_id=lease.group_id,
                    attempt=lease.attempt,
                    policy_version=version,
                    worker_id="w",
                    task=lease.group.task,
                    prompt=lease.group.prompt,
                    samples=samples,
                    sampling=SamplingInfo(temperature=1.0, top_p=1.0, top_k=0),
                )
                done += await coord.complete(lease, trajectory)
            if version >= STEPS:
                break
    finally:
        await redis.aclose()
    return done


async def sync_from_scratch(registry_url: str, run: str) -> tuple[dict, int, str, str]:
    async with RegistryClient(registry_url, run, token=TOKEN) as client:
        state: dict = {}
        await sync_weights(client, state, None, 0)  # the v0 snapshot
        result = await sync_weights(client, state, 0)  # then every patch
        latest = await client.latest()
        assert latest is not None
        return state, result.version, result.path, latest.fingerprint


def wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            r = httpx.get(f"{url}/readyz")
        except httpx.ConnectError:  # rank 0 still loading
            time.sleep(0.5)
            continue
        if r.status_code == 200:
            return
        assert r.json().get("error") is None, r.json()
        time.sleep(0.2)
    raise AssertionError("trainer not ready: " + log.read_text()[-3000:])


def test_trainer_service_under_torchrun(
    tmp_path: Path, tiny_model_dir: str, redis_url: str, redis_prefix: str
) -> None:
    reg = RegistrySettings(store_url=f"file://{tmp_path / 'store'}", api_token=TOKEN)
    with serve_app(create_registry(reg)) as registry_url:
        port = free_port()
        env = os.environ | {
            "SPARSECAST_MODEL": tiny_model_dir,
            "SPARSECAST_DEVICE": "cpu",
            "SPARSECAST_PORT": str(port),
            "SPARSECAST_DATA_DIR": str(tmp_path / "trainer"),
            "SPARSECAST_RUN": "tr",
            "SPARSECAST_API_TOKEN": TOKEN,
            "SPARSECAST_REGISTRY_URL": registry_url,
            "SPARSECAST_REDIS_URL": redis_url,
            "SPARSECAST_REDIS_PREFIX": redis_prefix,
            "SPARSECAST_GROUPS_PER_STEP": "2",
            "SPARSECAST_OPTIM__LR": "1e-3",
            "SPARSECAST_MICRO_BATCH": "2",
            "SPARSECAST_MAX_STEPS": str(STEPS),
            "SPARSECAST_CHECKPOINT_EVERY": "2",
            # Far beyond the test's timings: every step waits for its two groups. A short timeout
            # lets a slow machine step on whatever arrived first (one group), so the trainer would
            # reach v3 with groups left unanswered.
            "SPARSECAST_COLLECT_TIMEOUT_S": "600",
            "OMP_NUM_THREADS": "1",
        }
        log = (tmp_path / "torchrun.log").open("w")
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc_per_node",
                "2",
                "--master_port",
                str(free_port()),
                "-m",
                "services.trainer",
            ],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            url = f"http://127.0.0.1:{port}"
            wait_ready(url, proc, tmp_path / "torchrun.log")
            r = httpx.post(
                f"{url}/v1/prompts",
                json={"generate": {"count": 2 * STEPS, "seed": 1}, "samples_per_prompt": 4},
                headers=AUTH,
            )
            assert r.status_code == 200, r.text
            answered = asyncio.run(
                answer_prompts(redis_url, redis_prefix, "tr", tiny_model_dir, time.monotonic() + 150)
            )
            assert answered == 2 * STEPS
            deadline = time.monotonic() + 60
            while httpx.get(f"{url}/v1/status").json()["version"] < STEPS:
                assert time.monotonic() < deadline, (tmp_path / "torchrun.log").read_text()[-3000:]
                time.sleep(0.5)
            status = httpx.get(f"{url}/v1/status").json()
            assert status["step"] == STEPS and status["error"] is None
            state, version, path, head = asyncio.run(sync_from_scratch(registry_url, "tr"))
            assert version == STEPS and path in ("chain", "merged") and fingerprint(state) == head
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
            log.close()
    text = (tmp_path / "torchrun.log").read_text()
    assert "rank 1 of 2" in text and "rank 0 of 2" in text
    saved = tmp_path / "trainer" / "checkpoints" / f"v{STEPS - STEPS % 2:08d}"  # CHECKPOINT_EVERY 2
    shards = sorted(p.name for p in saved.glob("*.distcp"))
    assert len(shards) == 2, shards  # one file of weights and optimizer state per rank
