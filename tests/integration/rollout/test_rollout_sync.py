"""Rollout workers against a real registry and Redis: live weight sync, stateless bootstrap,
and a worker killed mid-batch whose lease is reclaimed."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis
import torch
from safetensors.torch import load_file

from services.registry.app import create_app as create_registry
from services.registry.settings import RegistrySettings
from services.rollout.app import create_app as create_rollout
from services.rollout.settings import RolloutSettings, SyncSettings
from shared.coord import Coordinator, CoordSettings
from shared.kv import KVSettings
from shared.patch import extract_patch, fingerprint, save_snapshot
from shared.ports import free_port
from shared.schemas import PromptGroup
from tests.conftest import serve_app
from tests.paths import REPO_ROOT

ROOT = REPO_ROOT
TOKEN = "sync-test-token"
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


def _weights(model_dir: str) -> dict[str, torch.Tensor]:
    return load_file(str(Path(model_dir) / "model.safetensors"))


def _optimizer_like_step(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Move ~3% of every tensor by a few bf16 ulps, like an Adam step at an RL learning rate."""
    gen = torch.Generator().manual_seed(seed)
    new = {}
    for name, t in state.items():
        flat = t.clone().view(-1)
        k = max(1, flat.numel() // 30)
        idx = torch.randperm(flat.numel(), generator=gen)[:k]
        flat[idx] = (flat[idx].float() * 1.5 + 0.02).to(torch.bfloat16)
        new[name] = flat.view(t.shape)
    return new


def _wait_for(predicate, timeout: float = 60.0, every: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError("condition not met in time")


def test_patch_applied_mid_stream(tmp_path: Path, tiny_model_dir: str) -> None:
    run = "sync"
    reg_settings = RegistrySettings(
        store_url=f"file://{tmp_path / 'store'}", api_token=TOKEN, snapshot_every=0
    )
    v0 = _weights(tiny_model_dir)
    v1 = _optimizer_like_step(v0, seed=1)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with serve_app(create_registry(reg_settings)) as registry_url:
        api = f"{registry_url}/v1/runs/{run}"
        for name in MODEL_FILES:
            r = httpx.put(
                f"{api}/model/{name}", content=(Path(tiny_model_dir) / name).read_bytes(), headers=auth
            )
            assert r.status_code < 300, r.text
        r = httpx.put(f"{api}/snapshots/0", content=save_snapshot(v0, run=run, version=0), headers=auth)
        assert r.status_code < 300, r.text

        def rollout_settings(name: str) -> RolloutSettings:
            return RolloutSettings(model="", registry_url=registry_url, run=run, device="cpu", redis_url="",
                                   data_dir=str(tmp_path / name), sync=SyncSettings(poll_s=0.1),
                                   kv=KVSettings(policy="dense"))

        long_request = {"prompts": ["1234+5678="], "n": 2, "max_tokens": 120, "temperature": 1.0, "seed": 11,
                        "stop_token_ids": []}
        with serve_app(
            create_rollout(rollout_settings("a"))
        ) as worker:  # stateless: bootstraps from the registry
            w = httpx.get(f"{worker}/v1/weights").json()
            assert w["version"] == 0 and w["fingerprint"] == fingerprint(v0)
            before = httpx.post(f"{worker}/v1/generate", json=long_request, timeout=120).json()

            # Publish v1 while a long batch is generating: that batch finishes on v0 throughout.
            in_flight: dict = {}
            thread = threading.Thread(target=lambda: in_flight.update(
                httpx.post(f"{worker}/v1/generate", json=long_request, timeout=120).json()))
            thread.start()
            time.sleep(0.2)
            patch = extract_patch(v0, v1, run=run, base_version=0, target_version=1)
            r = httpx.put(f"{api}/patches/1", content=patch, headers=auth)
            assert r.status_code < 300, r.text
            thread.join()
            assert in_flight["weight_version"] == 0
            assert [c["token_ids"] for c in in_flight["completions"]] == [
                c["token_ids"] for c in before["completions"]
            ]

            _wait_for(lambda: httpx.get(f"{worker}/v1/weights").json()["version"] == 1)
            w = httpx.get(f"{worker}/v1/weights").json()
            assert w["fingerprint"] == fingerprint(v1)  # the trainer's fingerprint of v1
            assert w["last_sync"]["path"] in ("chain", "merged")
            after = httpx.post(f"{worker}/v1/generate", json=long_request, timeout=120).json()
            assert after["weight_version"] == 1

        with serve_app(create_rollout(rollout_settings("b"))) as fresh:  # a new worker loaded at v1
            assert httpx.get(f"{fresh}/v1/weights").json()["version"] == 1
            again = httpx.post(f"{fresh}/v1/generate", json=long_request, timeout=120).json()
        assert [c["token_ids"] for c in again["completions"]] == [
            c["token_ids"] for c in after["completions"]
        ]
        assert [c["logprobs"] for c in again["completions"]] == [c["logprobs"] for c in after["completions"]]


def test_worker_killed_mid_batch_leaves_its_lease_to_be_reclaimed(
    tiny_model_dir: str, redis_url: str, redis_prefix: str, tmp_path: Path
) -> None:
    coord_settings = CoordSettings(lease_ttl_s=2.0)
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "SPARSECAST_MODEL": tiny_model_dir,
        "SPARSECAST_DEVICE": "cpu",
        "SPARSECAST_PORT": str(free_port()),
        "SPARSECAST_REDIS_URL": redis_url,
        "SPARSECAST_REDIS_PREFIX": redis_prefix,
        "SPARSECAST_REGISTRY_URL": "",
        "SPARSECAST_WORKER_ID": "doomed",
        "SPARSECAST_RUN": "kill",
        "SPARSECAST_KV__POLICY": "dense",
        # A batch long enough to be killed in the middle: greedy on the fixture model never samples
        # EOS, so both samples run the full 4000 tokens (seconds, not the sub-second a sampled
        # sequence takes to hit EOS by chance).
        "SPARSECAST_MAX_NEW_TOKENS": "4000",
        "SPARSECAST_SAMPLING__TEMPERATURE": "0",
        "SPARSECAST_COORD__LEASE_TTL_S": "2.0",
        "SPARSECAST_DATA_DIR": str(tmp_path),
    }
    proc = subprocess.Popen([sys.executable, "-m", "services.rollout"], env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    async def scenario() -> None:
        redis = aioredis.Redis.from_url(redis_url)
        coord = Coordinator(redis, redis_prefix, coord_settings, run="kill")
        try:
            await coord.enqueue(
                [PromptGroup(id="g-kill", task="addition", prompt="123+456=", answer="579", samples=2)]
            )
            deadline = time.monotonic() + 90
            while (await coord.stats())["leases_pending"] == 0:
                assert proc.poll() is None, "the rollout service exited early"
                assert time.monotonic() < deadline, "the worker never claimed the group"
                await asyncio.sleep(0.1)
            await asyncio.sleep(0.5)  # well inside generation
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
            assert (await coord.stats())["completions"] == 0
            await asyncio.sleep(coord_settings.lease_ttl_s + 0.5)
            leases = await coord.claim("rescuer", 1)
            assert [lease.group_id for lease in leases] == ["g-kill"]
            assert leases[0].attempt == 2
            assert (await coord.stats())["reclaims"] == 1
        finally:
            await redis.aclose()

    try:
        asyncio.run(scenario())
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


@pytest.mark.parametrize("policy", ["rkv"])
def test_worker_loop_completes_groups_with_rewards(
    tiny_model_dir: str, redis_url: str, redis_prefix: str, tmp_path: Path, policy: str
) -> None:
    """The lease-driven loop inside the service: claims, generates with a sparse policy, scores, completes."""
    settings = RolloutSettings(
        model=tiny_model_dir,
        device="cpu",
        redis_url=redis_url,
        redis_prefix=redis_prefix,
        registry_url="",
        worker_id="w1",
        kv=KVSettings(policy=policy, budget=8, buffer=4),
        max_new_tokens=24,
        data_dir=str(tmp_path),
    )

    async def read_trajectories() -> list:
        redis = aioredis.Redis.from_url(redis_url)
        coord = Coordinator(redis, redis_prefix, settings.coord, run=settings.run)
        try:
            got: list = []
            deadline = time.monotonic() + 90
            while len(got) < 3 and time.monotonic() < deadline:
                got += await coord.next_trajectories(3 - len(got), block_ms=500)
            workers = await coord.workers()
            return [got, workers, await coord.stats()]
        finally:
            await redis.aclose()

    async def enqueue() -> None:
        redis = aioredis.Redis.from_url(redis_url)
        try:
            await Coordinator(redis, redis_prefix, settings.coord, run=settings.run).enqueue(
                [
                    PromptGroup(
                        id=f"g{i}", task="addition", prompt=f"{i}1+{i}2=", answer=str(23 + 20 * i), samples=3
                    )
                    for i in range(3)
                ]
            )
        finally:
            await redis.aclose()

    asyncio.run(enqueue())
    with serve_app(create_rollout(settings)):
        trajectories, workers, stats = asyncio.run(read_trajectories())
    assert sorted(t.group_id for t in trajectories) == ["g0", "g1", "g2"]
    for t in trajectories:
        assert t.worker_id == "w1" and t.policy_version == 0 and len(t.samples) == 3
        for s in t.samples:
            assert len(s.completion_ids) == len(s.logprobs) <= 24
            assert 0.0 <= s.reward <= 1.0
            assert s.kv.peak_tokens <= len(s.prompt_ids) + 8 + 4
    assert stats["completions"] == 3
    assert [w.worker_id for w in workers] == ["w1"] and workers[0].kv_policy == policy


def test_sigterm_stops_a_syncing_worker_promptly(tmp_path: Path, tiny_model_dir: str) -> None:
    """A worker idling in its version wait must still shut down at once on SIGTERM."""
    run = "term"
    reg_settings = RegistrySettings(
        store_url=f"file://{tmp_path / 'store'}", api_token=TOKEN, snapshot_every=0
    )
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with serve_app(create_registry(reg_settings)) as registry_url:
        api = f"{registry_url}/v1/runs/{run}"
        for name in MODEL_FILES:
            httpx.put(f"{api}/model/{name}", content=(Path(tiny_model_dir) / name).read_bytes(), headers=auth)
        httpx.put(f"{api}/snapshots/0", content=save_snapshot(_weights(tiny_model_dir), run=run, version=0),
                  headers=auth)
        port = free_port()
        env = {**os.environ, "PYTHONPATH": str(ROOT), "SPARSECAST_PORT": str(port), "SPARSECAST_MODEL": "",
               "SPARSECAST_REGISTRY_URL": registry_url, "SPARSECAST_RUN": run, "SPARSECAST_REDIS_URL": "",
               "SPARSECAST_DEVICE": "cpu", "SPARSECAST_DATA_DIR": str(tmp_path / "w")}
        proc = subprocess.Popen([sys.executable, "-m", "services.rollout"], env=env, cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            _wait_for(lambda: _ready(f"http://127.0.0.1:{port}"), timeout=120, every=0.2)
            time.sleep(1.0)  # the sync loop is now inside its 30 s version wait
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            # uvicorn shuts down gracefully, then re-raises the signal: exit status -SIGTERM.
            assert proc.wait(timeout=15) in (0, -signal.SIGTERM)
            assert time.monotonic() - t0 < 10
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/readyz", timeout=1).status_code == 200
    except httpx.TransportError:
        return False
