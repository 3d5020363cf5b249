"""Helpers of the registry tests: tiny weight chains, and the registry as a real subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import torch

from services.registry.core import Registry
from shared.patch import extract_patch, save_snapshot
from tests.paths import REPO_ROOT

ROOT = REPO_ROOT
TOKEN = "test-token"


def tiny_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """A few bf16 tensors with HF-like names (~200 KB): fast, yet several download pieces."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {
        "model.embed_tokens.weight": (256, 128),
        "model.layers.0.self_attn.q_proj.weight": (128, 128),
        "model.layers.0.mlp.up_proj.weight": (256, 128),
        "model.norm.weight": (128,),
    }
    return {name: torch.randn(shape, generator=gen).to(torch.bfloat16) for name, shape in shapes.items()}


def step(state: dict[str, torch.Tensor], seed: int, fraction: float = 0.03) -> dict[str, torch.Tensor]:
    """An optimizer-like step: a small fraction of the values move a little (bf16 rounding)."""
    gen = torch.Generator().manual_seed(1000 + seed)
    new = {}
    for name, t in state.items():
        flat = t.clone().view(-1)
        k = max(1, int(flat.numel() * fraction))
        idx = torch.randperm(flat.numel(), generator=gen)[:k]
        flat[idx] = (flat[idx].float() * (1 + 0.05 * torch.randn(k, generator=gen))).to(torch.bfloat16)
        new[name] = flat.view(t.shape)
    return new


@dataclass
class Chain:
    run: str
    states: list[dict[str, torch.Tensor]]  # states[v] = weights at version v
    patches: dict[int, bytes]  # patches[v] = v-1 → v

    def snapshot(self, v: int) -> bytes:
        return save_snapshot(self.states[v], run=self.run, version=v)


async def publish(registry: Registry, chain: Chain, upto: int, snapshots: tuple[int, ...] = (0,)) -> None:
    """The chain's v0 snapshot and patches 1..upto into an in-process registry, with snapshots at
    `snapshots`."""
    await registry.publish_snapshot(chain.run, 0, chain.snapshot(0))
    for v in range(1, upto + 1):
        await registry.publish_patch(chain.run, v, chain.patches[v], {"step": v})
        if v in snapshots:
            await registry.publish_snapshot(chain.run, v, chain.snapshot(v))


def make_chain(run: str, versions: int, seed: int = 0, chunk_bytes: int = 4 << 10) -> Chain:
    states = [tiny_state(seed)]
    patches = {}
    for v in range(1, versions + 1):
        states.append(step(states[-1], seed * 100 + v))
        patches[v] = extract_patch(
            states[v - 1], states[v], run=run, base_version=v - 1, target_version=v, chunk_bytes=chunk_bytes
        )
    return Chain(run, states, patches)


def clone(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state.items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Bit-exact equality (views as int16 so NaN patterns compare too)."""
    return a.keys() == b.keys() and all(
        torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a
    )


@contextmanager
def registry_process(port: int, store_url: str, **env: str) -> Iterator[subprocess.Popen]:
    """`python -m services.registry` on loopback; yields the process once /healthz answers."""
    proc = start_registry(port, store_url, **env)
    try:
        yield proc
    finally:
        stop(proc)


def start_registry(port: int, store_url: str, **env: str) -> subprocess.Popen:
    full_env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "SPARSECAST_HOST": "127.0.0.1",
        "SPARSECAST_PORT": str(port),
        "SPARSECAST_STORE_URL": store_url,
        "SPARSECAST_API_TOKEN": TOKEN,
        "OMP_NUM_THREADS": "1",
        **env,
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.registry"], env=full_env, cwd=ROOT,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 180  # importing torch on a loaded 2-core machine is slow
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"registry exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    stop(proc)
    raise RuntimeError("registry did not start")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=10)
