"""Registry sync benchmark: `python -m bench.registry [--patches DIR] [--shape small] [--device cpu]`.

A registry (`python -m services.registry`, a subprocess on loopback, file store) holds a chain of
weight patches: the ones `python -m bench.patch --save-patches DIR` wrote (`--patches DIR`), or a
chain generated here from a Qwen3-shaped model (`--shape`, default "small") with Adam-like steps:
an fp32 master moves every element by ~lr·N(0,1) per step and the bf16 copy is published, so a
value changes only when it crosses a bf16 rounding boundary (the PULSE mechanism, arXiv 2602.03839).

Measured:
- transfer: the chain's objects fetched by the client (ranged requests, every piece verified)
  with 1, 4, 8 streams, uncapped and capped by the client's token bucket at 100 Mbit/s and
  1 Gbit/s: seconds, MB/s, ratio to payload ÷ bandwidth;
- tc: the same caps enforced by the kernel on the registry's port (htb on lo, tc-htb(8); only
  as root with a working `tc`; the qdisc is always deleted);
- merge: merged a→b plan bytes vs chain bytes for lags 2, 4, 8;
- sync: sync_weights (download + apply + verify) for a lagging worker and for a fresh one.
Targets: capped runs (client token bucket) within 10% of payload ÷ bandwidth, kernel-shaped rows
reported beside them; merged plans smaller than chains.
JSON: bench/results/registry-<device>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import torch

from shared.patch import apply_patch, extract_patch, load_snapshot, save_snapshot
from shared.ports import free_port
from shared.registry.client import RegistryClient
from shared.registry.sync import sync_weights
from shared.registry.wire import ObjectRef

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "bench-token"
STREAMS = (1, 4, 8)
CAPS = (None, 100e6, 1e9)  # bits per second; None = uncapped
LAGS = (2, 4, 8)


def synthetic_chain(shape: str, steps: int, lr: float, seed: int, run: str) -> tuple[bytes, list[bytes], int]:
    """(snapshot of v0, patches v0→1…, parameter count) from Adam-like steps on a Qwen3 shape."""
    from transformers import Qwen3ForCausalLM

    from shared.modeling import qwen3_config

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(qwen3_config(shape))
    # Tied embeddings: one master tensor, published under the embedding's name only.
    master = {k: v.detach().float().clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    del model
    old = {k: v.to(torch.bfloat16) for k, v in master.items()}
    snapshot = save_snapshot(old, run=run, version=0)
    patches = []
    gen = torch.Generator().manual_seed(seed + 1)
    for v in range(1, steps + 1):
        for t in master.values():
            t.add_(torch.randn(t.shape, generator=gen), alpha=lr)
        new = {k: t.to(torch.bfloat16) for k, t in master.items()}
        patches.append(extract_patch(old, new, run=run, base_version=v - 1, target_version=v))
        changed = sum(int((old[k].view(torch.int16) != new[k].view(torch.int16)).sum()) for k in new)
        params = sum(t.numel() for t in new.values())
        print(f"step {v}: {changed / params:.3%} changed, patch {len(patches[-1]) / 1e6:.2f} MB", flush=True)
        old = new
    return snapshot, patches, sum(t.numel() for t in master.values())


def saved_chain(folder: Path) -> tuple[str, str, bytes, list[bytes]]:
    """(run, shape, snapshot, patches) from `python -m bench.patch --save-patches DIR`."""
    manifest = json.loads((folder / "manifest.json").read_text())
    snapshot = (folder / manifest["base"]).read_bytes()
    return (
        manifest["run"],
        manifest["shape"],
        snapshot,
        [(folder / p).read_bytes() for p in manifest["patches"]],
    )


@contextmanager
def registry_process(port: int, store: Path) -> Iterator[str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "SPARSECAST_HOST": "127.0.0.1",
        "SPARSECAST_PORT": str(port),
        "SPARSECAST_STORE_URL": f"file://{store}",
        "SPARSECAST_API_TOKEN": TOKEN,
        "SPARSECAST_SNAPSHOT_EVERY": "0",
        "SPARSECAST_MAX_UPLOAD_BYTES": str(64 << 30),
    }
    proc = subprocess.Popen([sys.executable, "-m", "services.registry"], env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("registry did not start") from None
                time.sleep(0.2)
        yield url
    finally:
        proc.kill()
        proc.wait()


def tc_available() -> bool:
    return os.geteuid() == 0 and shutil.which("tc") is not None


@contextmanager
def shaped_port(port: int, bits_per_s: float) -> Iterator[None]:
    """Shape traffic leaving `port` on lo to bits_per_s with htb; everything else gets 40 Gbit/s."""
    rate = f"{int(bits_per_s / 1e6)}mbit"
    # htb's default burst is about one timer tick of traffic, smaller than two of lo's 64 KiB
    # packets at these rates, and starves a TCP stream (1.21x ideal at 1 Gbit/s, one stream).
    # 2 ms of traffic (at least two packets) is what a real link's queue absorbs.
    burst = max(int(bits_per_s / 8 * 0.002), 2 << 16)
    commands = [
        "tc qdisc add dev lo root handle 1: htb default 20",
        f"tc class add dev lo parent 1: classid 1:10 htb rate {rate} ceil {rate} burst {burst} cburst "
        f"{burst}",
        "tc class add dev lo parent 1: classid 1:20 htb rate 40gbit ceil 40gbit",
        f"tc filter add dev lo protocol ip parent 1:0 prio 1 u32 match ip sport {port} 0xffff flowid 1:10",
    ]
    try:
        for command in commands:
            subprocess.run(command.split(), check=True, capture_output=True)
        yield
    finally:
        subprocess.run("tc qdisc del dev lo root".split(), capture_output=True)


async def transfer(
    url: str, run: str, refs: list[ObjectRef], streams: int, cap: float | None
) -> dict[str, Any]:
    payload = sum(r.size for r in refs)
    async with RegistryClient(url, run, streams=streams, bandwidth_bps=cap) as client:
        t0 = time.perf_counter()
        await client.download(refs)
        seconds = time.perf_counter() - t0
    row: dict[str, Any] = {
        "streams": streams, "cap_bps": cap, "payload_bytes": payload, "seconds": round(seconds, 4),
        "MB_per_s": round(payload / seconds / 1e6, 2),
    }
    if cap:
        ideal = payload * 8 / cap
        row["ideal_seconds"] = round(ideal, 4)
        row["ratio_to_ideal"] = round(seconds / ideal, 4)
    print(json.dumps(row), flush=True)
    return row


async def measure(
    args: argparse.Namespace, url: str, port: int, run: str, snapshot: bytes, patches: list[bytes]
) -> dict[str, Any]:
    device = torch.device(args.device)
    n = len(patches)
    async with RegistryClient(url, run, token=TOKEN, timeout_s=600) as client:
        await client.publish_snapshot(0, snapshot)
        for v, patch in enumerate(patches, start=1):
            await client.publish_patch(v, patch)
        chain_refs = [m.patch for m in await client.versions() if m.patch is not None]

        result: dict[str, Any] = {"transfer": [], "tc": [], "merge": [], "sync": {}}
        for cap in CAPS:
            for streams in STREAMS:
                result["transfer"].append(await transfer(url, run, chain_refs, streams, cap))
        if args.tc and tc_available():
            for cap in CAPS[1:]:
                try:
                    with shaped_port(port, cap):
                        for streams in STREAMS:
                            row = await transfer(url, run, chain_refs, streams, None)
                            ideal = row["payload_bytes"] * 8 / cap
                            row.update(
                                tc_bps=cap,
                                ideal_seconds=round(ideal, 4),
                                ratio_to_ideal=round(row["seconds"] / ideal, 4),
                            )
                            result["tc"].append(row)
                except subprocess.CalledProcessError as exc:
                    result["tc_error"] = exc.stderr.decode().strip()
                    break

        chain_bytes = [r.size for r in chain_refs]
        for lag in LAGS:
            if lag > n:
                continue
            t0 = time.perf_counter()
            plan = await client.plan(n - lag, n)
            plan_s = time.perf_counter() - t0
            index = (await client._http.get(f"/v1/runs/{run}/objects/merged/{n - lag}-{n}.json")).json()
            row = {
                "lag": lag,
                "chain_bytes": sum(chain_bytes[n - lag :]),
                "merged_bytes": index["size"],
                "plan_kind": plan.kind,
                "plan_bytes": plan.total_bytes,
                "first_plan_seconds": round(plan_s, 3),
            }
            row["merged_over_chain"] = round(row["merged_bytes"] / row["chain_bytes"], 4)
            print(json.dumps(row), flush=True)
            result["merge"].append(row)

        base, _ = load_snapshot(snapshot)
        start = max(0, n - 4)
        state = {k: t.to(device) for k, t in base.items()}
        for patch in patches[:start]:
            apply_patch(state, patch)
        for label, current, target_state in (("lagging", start, state), ("fresh", None, {})):
            async with RegistryClient(url, run, streams=4) as worker:
                sync = await sync_weights(worker, target_state, current)
            result["sync"][label] = {
                "from": current,
                "to": sync.version,
                "path": sync.path,
                "bytes": sync.bytes,
                "seconds": round(sync.seconds, 4),
                "MB_per_s": round(sync.bytes / sync.seconds / 1e6, 2),
            }
            print(label, json.dumps(result["sync"][label]), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--patches", metavar="DIR", help="replay `python -m bench.patch --save-patches DIR`")
    parser.add_argument("--shape", default="small", choices=["tiny", "small", "0.6b", "1.7b"])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="where the syncing worker keeps its weights")
    parser.add_argument("--no-tc", dest="tc", action="store_false", help="skip kernel shaping runs")
    parser.add_argument("--out", help="JSON path (default bench/results/registry-<device>.json)")
    args = parser.parse_args()
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))

    t0 = time.perf_counter()
    if args.patches:
        run, shape, snapshot, patches = saved_chain(Path(args.patches))
        source = f"bench.patch --save-patches ({len(patches)} steps)"
        params = sum(t.numel() for t in load_snapshot(snapshot)[0].values())
    else:
        run, shape = "bench", args.shape
        snapshot, patches, params = synthetic_chain(shape, args.steps, args.lr, args.seed, run)
        source = f"synthetic Adam-like steps, lr {args.lr}"
    prepare_s = time.perf_counter() - t0

    port = free_port()
    with (
        tempfile.TemporaryDirectory(prefix="sparsecast-bench-registry-") as store,
        registry_process(port, Path(store)) as url,
    ):
        result = asyncio.run(measure(args, url, port, run, snapshot, patches))

    # The target is about the client's token bucket (the cap workers use); kernel htb rows are reported
    # beside it (on a short transfer they mostly measure TCP slow start under the shaper).
    capped = [r for r in result["transfer"] if r.get("ratio_to_ideal")]
    shaped = [r for r in result["tc"] if r.get("ratio_to_ideal")]
    report = {
        "bench": "registry",
        "device": torch.device(args.device).type,
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "load_avg_1m": os.getloadavg()[0],
        "model": {"shape": shape, "params": params, "dense_bf16_bytes": params * 2, "source": source},
        "chain": {
            "versions": len(patches),
            "snapshot_bytes": len(snapshot),
            "patch_bytes": [len(p) for p in patches],
            "payload_bytes": sum(len(p) for p in patches),
            "prepare_seconds": round(prepare_s, 2),
        },
        **result,
        "targets": {
            "capped_within_10pct": bool(capped) and all(abs(r["ratio_to_ideal"] - 1) <= 0.10 for r in capped),
            "worst_capped_ratio": max((r["ratio_to_ideal"] for r in capped), default=None),
            "kernel_shaped_within_10pct": all(abs(r["ratio_to_ideal"] - 1) <= 0.10 for r in shaped)
            if shaped
            else None,
            "worst_kernel_shaped_ratio": max((r["ratio_to_ideal"] for r in shaped), default=None),
            "merged_smaller_than_chain": bool(result["merge"])
            and all(r["merged_bytes"] < r["chain_bytes"] for r in result["merge"]),
        },
    }
    out = Path(args.out or f"bench/results/registry-{report['device']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report["targets"], indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
