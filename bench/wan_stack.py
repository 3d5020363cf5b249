"""The parts of the commodity-network benchmark that its runs share (bench/wan.py, the worker
runs; bench/wan_relay.py, the relay fan-out): addresses and the token, the start barrier every
process waits at, and the Redis + registry stack in the hub namespace.

Its own module so that wan.py and wan_relay.py import it, not each other.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.netns import Net

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "wan-bench-token"
RUN = "wan"
REGISTRY_PORT = 8100
REDIS_PORT = 6391
PEER_PORT = 8300
MBIT = 1e6
GBIT = 1e9


async def barrier(cfg: dict[str, Any]) -> float:
    """Say ready, then wait for the common start time (the orchestrator writes it once every
    process is ready: a start under CPU load must not cost tokens)."""
    Path(cfg["out"] + ".ready").touch()
    go = Path(cfg["go"])
    while not go.exists():
        await asyncio.sleep(0.05)
    return float(go.read_text())


# --- orchestration (root namespace) -----------------------------------------------------------


class Stack:
    """Redis for the whole benchmark and a fresh registry per run, in the hub namespace."""

    def __init__(self, net: Net, scratch: Path) -> None:
        self.net, self.scratch = net, scratch
        self.procs: list[subprocess.Popen[bytes]] = []
        self.redis = self._spawn(net.hub, ["redis-server", "--bind", Net.HUB_IP, "--port", str(REDIS_PORT),
                                           "--save", "", "--appendonly", "no", "--protected-mode", "no"],
                                 scratch / "redis.log")

    def _spawn(
        self, ns: str, argv: list[str], log: Path, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        with open(log, "ab") as out:
            proc = subprocess.Popen([*self.net.ns_prefix(ns), *argv], stdout=out, stderr=subprocess.STDOUT,
                                    env={**os.environ, **(env or {})}, cwd=ROOT)
        self.procs.append(proc)
        return proc

    def python(self, ns: str, role: str, cfg: dict[str, Any], log: Path) -> subprocess.Popen[bytes]:
        flag = "--" + role.replace("_", "-")
        return self._spawn(ns, [sys.executable, "-m", "bench.wan", flag, json.dumps(cfg)], log)

    def registry(self, store: Path, prefix: str, log: Path,
                 settings: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """The registry on a fresh store; `settings`: more SPARSECAST_ variables."""
        env = {
            "SPARSECAST_HOST": Net.HUB_IP,
            "SPARSECAST_PORT": str(REGISTRY_PORT),
            "SPARSECAST_API_TOKEN": TOKEN,
            "SPARSECAST_STORE_URL": f"file://{store}",
            "SPARSECAST_REDIS_URL": f"redis://{Net.HUB_IP}:{REDIS_PORT}",
            "SPARSECAST_REDIS_PREFIX": prefix,
            "SPARSECAST_RUN": RUN,
            "SPARSECAST_SNAPSHOT_EVERY": "0",
            "SPARSECAST_MAX_PUBLISH_MERGES": "0",
            **(settings or {}),
        }
        return self._spawn(self.net.hub, [sys.executable, "-m", "services.registry"], log, env)

    @staticmethod
    def stop(proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def close(self) -> None:
        for proc in self.procs:
            self.stop(proc)
