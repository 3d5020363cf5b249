"""Commodity-network benchmark: `python -m bench.wan` (root; `make bench-wan`).

Rollout workers on shaped links, fed by the registry, versus an unthrottled run of the same setup.
Real processes, real transfers: the registry (`python -m services.registry`) and Redis in one
network namespace, each worker in its own, joined through a router namespace by veth pairs shaped
with htb (bench/netns.py; Linux tc-htb(8)). A publisher in the registry's namespace
PUTs one patch of the 1.7B shape per trainer step; workers learn of it from Redis and download
it from the registry with the real client (parallel ranged streams, every piece checked by sha256).

Generation is TIMED, not computed: 2 CPU cores cannot decode a 1.7B model at GPU speed, so each
worker replays a decode profile measured on a GPU (ms per decode step at a batch size, from
bench/results/engine-cuda-1.7b-gen8192-h100.json: an H100 80GB, dense batch 16 and R-KV at dense's
KV memory). A batch of `--gen` decode steps runs for gen × ms_per_step and yields batch × gen
tokens; weights change only between batches. Applying a patch on the GPU is timed too, at the
mean apply_s that bench.patch measured on the H100 for this shape. The patches are a synthetic
chain of the 1.7B shape (bench/wan_chain.py: one-ulp flips at the changed fraction measured per
step), so the bytes on the wire are those of a real 1.7B chain within a few percent.

Arms: transfer = full (the dense weights every step: the v0 snapshot object, 3.44 GB, stands in
for each version's snapshot, streamed and verified piece by piece), chain (every patch in turn),
merged (the registry's plan: a merged lag-2 patch where a worker is two behind); sync = overlap
(download while generating, swap at a batch boundary) or stop (stop generating, download, apply).
Links: unthrottled, 1 Gbit/s and 100 Mbit/s per worker, and a mix (a fast rkv worker and a dense
one on 1 Gbit/s, an rkv worker on 100 Mbit/s). A worker may generate with weights at most
`--staleness-bound` versions behind the newest it knows (CoordSettings' default, 1); beyond that it
waits. Reported per run: tokens/s and its ratio to the unthrottled run of the same arm (and to the
profile's ideal), staleness per batch and per version, sync times, registry egress bytes (the
uplink's counter and the registry's own). A run in which no sync ended inside its window (full
weights, even unthrottled on a 2-core host) is marked `unmeasurable` and gets no ratio.

Delay (`--rtt-ms R`, default 0): every pair of endpoints (worker ↔ registry, worker ↔ worker) is R
apart, R / 2 on each link, the uplink's included (bench/netns.py every_pair_rtt; a userspace delay
line over TUN devices, bench/delayline.py, since tc-netem is not available here). Every link then
goes through the delay line, whose throughput ceiling caps the unthrottled arms (docs/results.md).
Each run records its link rates and RTT, with the step time and the number of versions.

Relay fan-out (`--relay`): 8 workers behind one shaped registry uplink fetch each version direct
or through peers (shared/relay.py); egress per version and the time for all to reach it.
JSON and plot: bench/results/wan-<device>.json/.png.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.netns import Link, Net, every_pair_rtt
from bench.wan_relay import MODES as RELAY_MODES
from bench.wan_relay import worker_links
from bench.wan_stack import GBIT, MBIT, REDIS_PORT, REGISTRY_PORT, ROOT, RUN, TOKEN, Stack, barrier
from shared.coord import CoordSettings

PROFILE_FILE = "bench/results/engine-cuda-1.7b-gen8192-h100.json"
APPLY_FILE = "bench/results/patch-cuda-1.7b-h100.json"


@dataclass
class Profile:
    name: str
    batch: int
    ms_per_step: float
    source: str

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.ms_per_step * 1000


def load_profiles() -> dict[str, Profile]:
    data = json.loads((ROOT / PROFILE_FILE).read_text())
    dense = next(r for r in data["policies"] if r["policy"] == "dense")
    fixed = data["fixed_kv_memory"][0]
    where = f"{PROFILE_FILE} ({data['device']})"
    return {
        # A Sparse-RL worker: R-KV at a quarter of the length, as many sequences as the dense KV memory holds.
        "rkv": Profile(f"rkv batch {fixed['batch']}", fixed["batch"], fixed["ms_per_step"], where),
        # A slower worker: dense KV at its own batch.
        "dense": Profile(f"dense batch {dense['batch']}", dense["batch"], dense["ms_per_step"], where),
    }


def apply_seconds() -> float:
    data = json.loads((ROOT / APPLY_FILE).read_text())
    return statistics.mean(s["apply_s"] for s in data["per_step"])


def apply_device() -> str:
    return str(json.loads((ROOT / APPLY_FILE).read_text()).get("device_name", "?"))


# --- worker (runs in its namespace) -----------------------------------------------------------


async def stream_verify(client: Any, ref: Any, streams: int) -> int:
    """Stream one object in `streams` ranged requests, checking each piece's sha256 and keeping
    nothing: the full-weight arm moves 3.44 GB per version, which 3 workers cannot buffer here."""
    pb, n = ref.piece_bytes, len(ref.pieces)
    per = -(-n // streams)

    async def one(first: int, last: int) -> int:
        start, end = first * pb, min(last * pb, ref.size)
        url = f"/v1/runs/{client.run}/objects/{ref.key}"
        moved, i, filled, digest = 0, first, 0, hashlib.sha256()
        async with client._http.stream("GET", url, headers={"Range": f"bytes={start}-{end - 1}"}) as response:
            async for chunk in response.aiter_raw():
                moved += len(chunk)
                view = memoryview(chunk)
                while view:
                    size = min(pb, ref.size - i * pb)
                    take = min(len(view), size - filled)
                    digest.update(view[:take])
                    filled, view = filled + take, view[take:]
                    if filled == size:
                        if digest.hexdigest() != ref.pieces[i]:
                            raise ValueError(f"piece {i} of {ref.key} fails its sha256")
                        i, filled, digest = i + 1, 0, hashlib.sha256()
        if i != last:
            raise ValueError(f"{ref.key}: pieces {first}-{last - 1} ended at {i}")
        return moved

    return sum(await asyncio.gather(*(one(f, min(f + per, n)) for f in range(0, n, per))))


async def run_worker(cfg: dict[str, Any]) -> dict[str, Any]:
    from shared.registry.client import RegistryClient

    batch, ms, gen = cfg["batch"], cfg["ms_per_step"], cfg["gen"]
    mode, overlap, bound, apply_s = (
        cfg["mode"],
        cfg["sync"] == "overlap",
        cfg["staleness_bound"],
        cfg["apply_s"],
    )
    client = RegistryClient(cfg["url"], RUN, token=TOKEN, streams=4, redis_url=cfg["redis_url"],
                            redis_prefix=cfg["redis_prefix"], backoff_s=0.1)
    while True:
        try:
            await client.ping()
            break
        except Exception:  # noqa: BLE001 - the registry is still starting
            await asyncio.sleep(0.3)
    v0 = await client.manifest(0)
    t0 = await barrier(cfg)
    end = t0 + cfg["window_s"]
    latest, version, seen = 0, 0, {0: 0.0}
    changed = asyncio.Event()
    ready: dict[str, Any] | None = None
    syncs: list[dict[str, Any]] = []
    batches: list[dict[str, Any]] = []
    applied: dict[int, float] = {0: 0.0}
    stalls: list[float] = []

    async def watch() -> None:
        nonlocal latest
        while time.time() < end:
            v = await client.wait_for_version(latest, timeout=max(0.1, end - time.time()), poll_s=1.0)
            if v is not None and v > latest:
                latest = v
                seen[v] = time.time() - t0
                changed.set()

    async def fetch(base: int, target: int) -> dict[str, Any]:
        start = time.time()
        if mode == "full":
            moved, kind, applies = await stream_verify(client, v0.snapshot, client.streams), "full", 1
        else:
            if mode == "chain":
                refs = [(await client.manifest(v)).patch for v in range(base + 1, target + 1)]
                kind = "chain"
            else:
                plan = await client.plan(base, target)
                refs, kind = [s.object for s in plan.steps], plan.kind
            before = client.counters.bytes
            views = await client.download(refs)
            moved, applies = client.counters.bytes - before, len(refs)
            for view in views:
                view.release()
        return {"from": base, "to": target, "kind": kind, "bytes": moved, "applies": applies,
                "started": round(start - t0, 3), "download_s": round(time.time() - start, 3)}

    async def follower() -> None:
        nonlocal ready
        base = 0
        while True:
            while latest <= base:
                changed.clear()
                await changed.wait()
            record = await fetch(base, latest)
            syncs.append(record)
            ready, base = record, record["to"]
            changed.set()

    async def apply(record: dict[str, Any]) -> None:
        nonlocal version
        await asyncio.sleep(apply_s * record["applies"])  # timed: the GPU's apply (APPLY_FILE)
        version = record["to"]
        applied[version] = time.time() - t0
        record["applied"] = round(applied[version], 3)

    tasks = [asyncio.create_task(watch())]
    if overlap:
        tasks.append(asyncio.create_task(follower()))
    await asyncio.sleep(max(0.0, t0 - time.time()))
    tokens = 0
    try:
        while (now := time.time()) < end:
            stall0 = now
            if overlap:
                while True:
                    if ready is not None and ready["to"] > version:
                        await apply(ready)
                    if latest - version <= bound or time.time() >= end:
                        break
                    changed.clear()
                    await asyncio.wait_for(changed.wait(), timeout=max(0.01, end - time.time()))
            elif latest > version:
                # A download that cannot end inside the window (full weights on a slow link)
                # stalls the worker to the end of it.
                record = await asyncio.wait_for(fetch(version, latest), timeout=max(0.01, end - time.time()))
                syncs.append(record)
                await apply(record)
            if time.time() > stall0 + 1e-3:
                stalls.append(round(time.time() - stall0, 3))
            start = time.time()
            if start >= end:
                break
            steps = min(gen, int((end - start) * 1000 / ms))
            known = latest
            await asyncio.sleep(steps * ms / 1000)  # timed decode (PROFILE_FILE)
            tokens += steps * batch
            batches.append({"start": round(start - t0, 3), "tokens": steps * batch, "version": version,
                            "latest": known, "staleness": known - version})
            if steps < gen:
                break
    except TimeoutError:
        pass
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await client.aclose()
    return {"worker": cfg["index"], "profile": cfg["profile"], "tokens": tokens,
            "tokens_per_s": tokens / cfg["window_s"], "batches": batches, "syncs": syncs,
            "seen": seen, "applied": applied, "stalls": stalls}


# --- publisher (runs in the registry's namespace) ---------------------------------------------


async def run_publisher(cfg: dict[str, Any]) -> dict[str, Any]:
    import httpx

    from shared.registry.client import RegistryClient

    client = RegistryClient(cfg["url"], RUN, token=TOKEN)
    while True:
        try:
            await client.ping()
            break
        except Exception:  # noqa: BLE001 - starting
            await asyncio.sleep(0.3)
    published = {}
    patches = {
        v: Path(cfg["chain"], "patches", f"{v}.patch").read_bytes() for v in range(1, cfg["versions"] + 1)
    }
    cfg["t0"] = await barrier(cfg)
    for v, data in patches.items():
        await asyncio.sleep(max(0.0, cfg["t0"] + v * cfg["step_s"] - time.time()))
        await client.publish_patch(v, data)
        published[v] = round(time.time() - cfg["t0"], 3)
    await asyncio.sleep(max(0.0, cfg["t0"] + cfg["window_s"] + 2 - time.time()))
    await client.aclose()
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"{cfg['url']}/metrics")).text
    served = sum(float(line.split()[-1]) for line in text.splitlines()
                 if line.startswith("sparsecast_registry_bytes_served_total"))
    return {"published": published, "bytes_served": int(served)}


# --- orchestration (root namespace) -----------------------------------------------------------


LINKS: dict[str, list[float | None]] = {
    "unthrottled": [None, None, None],
    "unthrottled-mixed": [None, None, None],
    "1gbit": [GBIT, GBIT, GBIT],
    "100mbit": [100 * MBIT] * 3,
    "mixed": [GBIT, GBIT, 100 * MBIT],
}
PROFILES = {"mixed": ["rkv", "dense", "rkv"], "unthrottled-mixed": ["rkv", "dense", "rkv"]}


def baseline_links(links: str) -> str:
    """The unthrottled run with the same workers."""
    return "unthrottled-mixed" if links == "mixed" else "unthrottled"


def claim_shares(
    results: list[dict[str, Any]], window: float, profiles: dict[str, Profile]
) -> list[dict[str, Any]]:
    """What the scheduler (shared.coord.claim_size) gives each worker from its measured decode
    speed and its share of the window stalled on weight sync, beside the share of tokens it made."""
    from shared.coord import CoordSettings, claim_size
    from shared.schemas import WorkerInfo

    fleet = [WorkerInfo(worker_id=f"w{r['worker']}", tokens_per_s=profiles[r["profile"]].tokens_per_s,
                        sync_stall=min(1.0, sum(r["stalls"]) / window)) for r in results]
    total = sum(r["tokens"] for r in results) or 1
    settings = CoordSettings(base_claim=8, max_claim=32)
    return [{"worker": w.worker_id, "sync_stall": round(w.sync_stall, 3),
             "claim": claim_size(w, fleet, 0, settings), "token_share": round(r["tokens"] / total, 3)}
            for w, r in zip(fleet, results, strict=True)]


def summarize(name: str, results: list[dict[str, Any]], pub: dict[str, Any], window: float,
              profiles: dict[str, Profile]) -> dict[str, Any]:
    tokens = sum(r["tokens"] for r in results)
    ideal = sum(profiles[r["profile"]].tokens_per_s for r in results) * window
    sync_s = [s["download_s"] for r in results for s in r["syncs"]]
    stale = [b["staleness"] for r in results for b in r["batches"]]
    lag_s = [r["applied"][str(v)] - float(t) for r in results for v, t in pub["published"].items()
             if str(v) in r["applied"]]
    kinds: dict[str, int] = {}
    for r in results:
        for s in r["syncs"]:
            kinds[s["kind"]] = kinds.get(s["kind"], 0) + 1

    def pct(xs: list[float], q: float) -> float | None:
        return round(statistics.quantiles(xs, n=100)[q - 1], 3) if len(xs) >= 2 else (xs[0] if xs else None)

    return {
        "name": name,
        "tokens": tokens,
        "tokens_per_s": round(tokens / window, 1),
        "claim_share": claim_shares(results, window, profiles),
        "vs_ideal": round(tokens / ideal, 4),
        "per_worker_tokens_per_s": [round(r["tokens_per_s"], 1) for r in results],
        "sync_s": {
            "n": len(sync_s),
            "p50": pct(sync_s, 50),
            "p90": pct(sync_s, 90),
            "max": max(sync_s, default=None),
        },
        "plan_kinds": kinds,
        "staleness": {
            "mean": round(statistics.mean(stale), 3) if stale else None,
            "max": max(stale, default=None),
            "batches": len(stale),
        },
        "version_to_applied_s": {
            "mean": round(statistics.mean(lag_s), 3) if lag_s else None,
            "max": round(max(lag_s), 3) if lag_s else None,
            "applied": len(lag_s),
            "of": len(pub["published"]) * len(results),
        },
        "stall_s_total": round(sum(sum(r["stalls"]) for r in results), 3),
        "published_at": pub["published"],
    }


def run_one(net: Net, stack: Stack, chain: Path, scratch: Path, name: str, mode: str, sync: str, links: str,
            args: argparse.Namespace, profiles: dict[str, Profile], index: int) -> dict[str, Any]:
    rates = LINKS[links]
    uplink, per_worker = every_pair_rtt(Link(None), [Link(r, None) for r in rates], args.rtt_ms)
    net.shape(uplink, per_worker)
    store = scratch / f"store-{index}"
    shutil.copytree(chain / "store", store, copy_function=os.link)
    prefix = f"wan{net.tag}x{index}"
    registry = stack.registry(store, prefix, scratch / f"registry-{index}.log")
    url = f"http://{Net.HUB_IP}:{REGISTRY_PORT}"
    step_s = args.gen * profiles["rkv"].ms_per_step / 1000
    window = step_s * (args.versions + 1)
    go = scratch / f"go-{index}"
    outs, procs = [], []
    pub_out = scratch / f"pub-{index}.json"
    procs.append(
        stack.python(
            net.hub,
            "publisher",
            {
                "url": url,
                "chain": str(chain),
                "versions": args.versions,
                "step_s": step_s,
                "go": str(go),
                "window_s": window,
                "out": str(pub_out),
            },
            scratch / f"pub-{index}.log",
        )
    )
    names = PROFILES.get(links, ["rkv"] * len(rates))
    for i, ns in enumerate(net.workers[: len(rates)]):
        out = scratch / f"w-{index}-{i}.json"
        outs.append(out)
        p = profiles[names[i]]
        cfg = {
            "index": i,
            "url": url,
            "redis_url": f"redis://{Net.HUB_IP}:{REDIS_PORT}",
            "redis_prefix": prefix,
            "go": str(go),
            "window_s": window,
            "batch": p.batch,
            "ms_per_step": p.ms_per_step,
            "gen": args.gen,
            "profile": names[i],
            "mode": mode,
            "sync": sync,
            "staleness_bound": args.staleness_bound,
            "apply_s": args.apply_s,
            "out": str(out),
        }
        procs.append(stack.python(ns, "worker", cfg, scratch / f"w-{index}-{i}.log"))
    tx0 = net.hub_tx_bytes()
    try:
        waiting = [Path(str(o) + ".ready") for o in [pub_out, *outs]]
        limit = time.time() + 120
        while not all(w.exists() for w in waiting):
            if time.time() > limit or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"{name}: a process did not start (logs in {scratch})")
            time.sleep(0.1)
        t0 = time.time() + 1.0
        go.with_suffix(".tmp").write_text(repr(t0))
        go.with_suffix(".tmp").rename(go)  # whole, or not there
        deadline = t0 + window + 60
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.time()))
    finally:
        for proc in procs:
            stack.stop(proc)
        stack.stop(registry)
        shutil.rmtree(store, ignore_errors=True)
    egress = net.hub_tx_bytes() - tx0
    results = [json.loads(o.read_text()) for o in outs]
    pub = json.loads(pub_out.read_text())
    row = summarize(name, results, pub, window, profiles)
    row.update({"mode": mode, "sync": sync, "links": links, "link_bps": rates, "uplink_bps": None,
                "rtt_ms": args.rtt_ms, "link_rtt_ms": uplink.rtt_ms, "versions": args.versions,
                "profiles": names,
                "window_s": round(window, 2), "step_s": round(step_s, 3),
                "registry_egress_bytes": egress, "registry_bytes_served": pub["bytes_served"],
                "load_avg_1m_at_end": round(os.getloadavg()[0], 2),
                "workers": results if args.keep_raw else None})
    print(json.dumps({k: v for k, v in row.items() if k != "workers"}), flush=True)
    return row


MATRIX = [  # (mode, sync, links): every arm also runs unthrottled, its baseline
    ("chain", "overlap", "1gbit"), ("chain", "stop", "1gbit"), ("full", "overlap", "1gbit"),
    ("full", "stop", "1gbit"),
    ("chain", "overlap", "100mbit"), ("chain", "stop", "100mbit"), ("merged", "overlap", "100mbit"),
    ("merged", "stop", "100mbit"), ("full", "overlap", "100mbit"), ("full", "stop", "100mbit"),
    ("chain", "overlap", "mixed"), ("chain", "stop", "mixed"),
]


def tune_tcp(net: Net, args: argparse.Namespace) -> dict[str, str]:
    """--tcp-buffer-mb / --no-idle-restart in the net's namespaces; the settings for the results."""
    return net.tune_tcp(args.tcp_buffer_mb << 20 if args.tcp_buffer_mb else None,
                        slow_start_after_idle=not args.no_idle_restart)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--publisher", help=argparse.SUPPRESS)
    parser.add_argument("--relay-worker", help=argparse.SUPPRESS)
    parser.add_argument("--chain", type=Path, help="folder of `python -m bench.wan_chain` (made if missing)")
    parser.add_argument("--shape", default="1.7b")
    parser.add_argument("--versions", type=int, default=4, help="versions published per run")
    parser.add_argument("--gen", type=int, default=1024, help="decode steps per batch (one trainer step)")
    parser.add_argument("--only", nargs="*", help="run only arms whose name contains one of these")
    parser.add_argument("--relay", action="store_true", help="the relay fan-out measurement only")
    parser.add_argument("--relay-link", choices=["1gbit", "100mbit"], default="1gbit",
                        help="relay: the rate of the registry uplink and of every worker's link")
    parser.add_argument("--relay-modes", nargs="*", choices=RELAY_MODES,
                        help="relay: run only these (default all but tree)")
    parser.add_argument("--slow-workers", type=int, default=0,
                        help="relay: this many workers (the 2nd on, in the order of first announcement) "
                             "serve peers at --slow-mbit")
    parser.add_argument("--slow-mbit", type=float, default=100.0,
                        help="relay: the uplink of the --slow-workers, Mbit/s")
    parser.add_argument("--profile-worker", type=int, help="relay: cProfile this worker in the relay run")
    parser.add_argument("--rtt-ms", type=float, default=0.0,
                        help="round trip between every pair of endpoints, half on each link (a delay line; "
                             "0: veth links, no delay)")
    parser.add_argument("--tcp-buffer-mb", type=int, default=0,
                        help="autotuning's maximum TCP buffer (tcp_wmem / tcp_rmem) in the hub's and the "
                             "workers' namespaces, MiB (0: the namespaces' defaults)")
    parser.add_argument("--no-idle-restart", action="store_true",
                        help="tcp_slow_start_after_idle=0 in those namespaces: kept connections keep their "
                             "congestion window between versions")
    default_bound = CoordSettings().staleness_bound
    parser.add_argument("--staleness-bound", type=int, default=default_bound,
                        help="versions a worker may generate behind the newest it knows (the system's "
                             "COORD__STALENESS_BOUND; default its default)")
    parser.add_argument("--keep-raw", action="store_true", help="keep every batch and sync in the JSON")
    parser.add_argument("--resume", action="store_true", help="keep the runs already in --out, run the rest")
    parser.add_argument("--out", type=Path,
                        help="default bench/results/wan-cpu[-rtt<R>ms][-tcp<N>mb][-noidle][-stale<B>].json")
    args = parser.parse_args()
    try:  # before any namespace is made
        worker_links(GBIT, args.slow_workers, args.slow_mbit * MBIT)
    except ValueError as exc:
        parser.error(str(exc))
    rtt_tag = f"-rtt{args.rtt_ms:g}ms" if args.rtt_ms else ""
    rtt_tag += (f"-tcp{args.tcp_buffer_mb}mb" if args.tcp_buffer_mb else "") + (
        "-noidle" if args.no_idle_restart else "")
    if args.staleness_bound != default_bound:
        rtt_tag += f"-stale{args.staleness_bound}"
    args.out = args.out or ROOT / f"bench/results/wan-cpu{rtt_tag}.json"
    for role in ("worker", "publisher", "relay_worker"):
        if (raw := getattr(args, role)) is not None:
            from bench.wan_relay import relay_worker

            cfg = json.loads(raw)
            job = {"worker": run_worker, "publisher": run_publisher, "relay_worker": relay_worker}[role]
            if role == "relay_worker":  # on uvloop, as a rollout service under uvicorn serves its peers
                import uvloop

                answer = uvloop.run(job(cfg))
            else:
                answer = asyncio.run(job(cfg))
            Path(cfg["out"]).write_text(json.dumps(answer))
            return
    if os.geteuid() != 0:
        sys.exit("bench.wan needs root (network namespaces and tc)")
    # A TERM (or HUP) unwinds like Ctrl-C, so the namespaces and processes are always removed.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: sys.exit(128 + signum))
    if args.relay:
        from bench.wan_relay import main as relay_main

        relay_main(args)
        return
    chain = args.chain or ROOT / "scratch" / f"wan-chain-{args.shape}"
    if not (chain / "chain.json").exists():
        from bench.wan_chain import prepare

        prepare(chain, args.shape, args.versions + 1, RUN)
    args.apply_s = apply_seconds()
    profiles = load_profiles()
    arms = [a for a in MATRIX if not args.only or any(o in "-".join(a) for o in args.only)]
    baselines = sorted({(m, s, baseline_links(links)) for m, s, links in arms})
    rows: list[dict[str, Any]] = []
    result: dict[str, Any] = {
        "bench": "wan", "command": " ".join(["python -m bench.wan", *sys.argv[1:]]),
        "host": f"{os.cpu_count()} CPU cores (links and transfers), no GPU",
        "generation": f"TIMED from {PROFILE_FILE} ({profiles['rkv'].source.rsplit('(', 1)[-1].rstrip(')')})",
        "profiles": {k: {**asdict(p), "tokens_per_s": round(p.tokens_per_s, 1)} for k, p in profiles.items()},
        "apply_s": round(args.apply_s, 4), "apply_source": f"{APPLY_FILE} ({apply_device()}), timed",
        "chain": json.loads((chain / "chain.json").read_text()), "gen": args.gen, "versions": args.versions,
        "staleness_bound": args.staleness_bound,
        "rtt_ms": args.rtt_ms, "rtt": "between every pair of endpoints, half on each link (bench/netns.py)",
        "runs": rows, "complete": False,
    }
    scratch = Path(tempfile.mkdtemp(prefix="wan-"))
    out: Path = args.out
    if args.resume and out.exists():
        kept = json.loads(out.read_text())
        if kept.get("rtt_ms", 0.0) != args.rtt_ms:
            sys.exit(f"--resume: {out} was measured at RTT {kept.get('rtt_ms', 0.0)} ms, not {args.rtt_ms}")
        rows.extend(kept["runs"])
    done = {r["name"] for r in rows}
    with Net(3) as net:
        result["tcp"] = tune_tcp(net, args)
        stack = Stack(net, scratch)
        try:
            for index, (mode, sync, links) in enumerate([*baselines, *arms]):
                if f"{mode}-{sync}-{links}" in done:
                    continue
                rows.append(run_one(net, stack, chain, scratch, f"{mode}-{sync}-{links}", mode, sync, links,
                                    args, profiles, index))
                finish(result, rows)
                out.write_text(json.dumps(result, indent=1))
        finally:
            stack.close()
    result["delay_line"] = net.mover_stats or None  # the mover's counters (late_ms_max: its worst lateness)
    result["complete"] = True
    finish(result, rows)
    out.write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    shutil.rmtree(scratch, ignore_errors=True)


def published_staleness(row: dict[str, Any], profiles: dict[str, Any]) -> dict[str, Any]:
    """Per batch, when its trajectories reach the trainer (the batch's end): versions the trainer
    has published by then minus the version the batch ran with. `staleness` counts only the
    versions the worker had heard of when the batch started."""
    times = sorted(float(t) for t in row["published_at"].values())
    lags, weights = [], []
    for w in row["workers"]:
        p = profiles[w["profile"]]
        for b in w["batches"]:
            end = b["start"] + b["tokens"] / p["batch"] * p["ms_per_step"] / 1000
            lags.append(sum(t <= end for t in times) - b["version"])
            weights.append(b["tokens"])
    total = sum(weights) or 1
    return {
        "token_weighted_mean": round(sum(lag * n for lag, n in zip(lags, weights, strict=True)) / total, 3),
        "max": max(lags, default=None),
        "histogram": {str(k): lags.count(k) for k in sorted(set(lags))},
    }


def unmeasurable(row: dict[str, Any], version_bytes: int) -> str | None:
    """Why a run's tokens say nothing about its transfer, or None. A run in which no sync ended
    inside the window (full weights: a 3.44 GB version on a slow link, or on this host's own disk
    and hashing) generated on v0 throughout, as fast as its schedule allowed: its ratio would
    measure the staleness limit, not the transfer."""
    if row["sync_s"]["n"]:
        return None
    rates = [x for x in row["link_bps"] if x]
    floor = f"{version_bytes * 8 / min(rates):.1f} s" if rates else "unthrottled"
    return (f"no sync ended inside the {row['window_s']} s window: a version is {version_bytes} bytes "
            f"({floor} at the slowest link) against a {row['step_s']} s step")


def finish(result: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """Ratios to the unthrottled run of the same arm, and the targets. A run with no sync inside
    its window (unmeasurable) gets no ratio, nor does a run whose baseline is one."""
    largest_patch = max(v["patch_bytes"] for v in result["chain"]["versions"])
    for r in rows:
        if r.get("workers"):
            r["staleness_at_trainer"] = published_staleness(r, result["profiles"])
        r["unmeasurable"] = unmeasurable(r, result["chain"]["dense_bytes"] if r["mode"] == "full"
                                         else largest_patch)
    base = {(r["mode"], r["sync"], r["links"]): r for r in rows
            if r["links"].startswith("unthrottled") and not r["unmeasurable"]}
    for r in rows:
        links = r["links"] if r["links"].startswith("unthrottled") else baseline_links(r["links"])
        b = None if r["unmeasurable"] else base.get((r["mode"], r["sync"], links))
        r["vs_unthrottled"] = round(r["tokens"] / b["tokens"], 4) if b and b["tokens"] else None
        # Against the unthrottled cluster itself (patches, overlapped): the contrast for full weights.
        p = None if r["unmeasurable"] else base.get(("chain", "overlap", links))
        r["vs_unthrottled_patch_overlap"] = round(r["tokens"] / p["tokens"], 4) if p and p["tokens"] else None
    def best(links: str) -> float | None:
        xs = [r["vs_unthrottled"] for r in rows
              if r["links"] == links and r["sync"] == "overlap" and r["mode"] in ("chain", "merged")
              and r["vs_unthrottled"] is not None]
        return max(xs) if xs else None
    result["targets"] = {
        "patches_overlap_1gbit_vs_unthrottled": {"value": best("1gbit"), "target": 0.95},
        "patches_overlap_100mbit_vs_unthrottled": {"value": best("100mbit"), "target": 0.9},
    }
    for t in result["targets"].values():
        t["met"] = t["value"] is not None and t["value"] >= t["target"]


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["runs"] if not r["links"].startswith("unthrottled")]
    if not rows:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    labels = [r["name"] + (" (unmeasurable)" if r.get("unmeasurable") else "") for r in rows]
    y = list(range(len(rows)))
    colors = [
        "tab:red" if r["mode"] == "full" else "tab:blue" if r["sync"] == "overlap" else "tab:gray"
        for r in rows
    ]
    ax1.barh([i - 0.2 for i in y], [r["vs_unthrottled"] or 0 for r in rows], height=0.4, color=colors,
             label="÷ unthrottled run of the same arm (this box)")
    ax1.barh([i + 0.2 for i in y], [0 if r.get("unmeasurable") else r["vs_ideal"] for r in rows], height=0.4,
             color=colors, alpha=0.45,
             label="÷ the profile's tokens/s (no sync cost at all)")
    ax1.set_yticks(y, labels)
    for x in (0.9, 0.95):
        ax1.axvline(x, color="k", ls=":", lw=0.8)
    ax1.set_xlabel("rollout tokens/s ratio")
    ax1.legend(fontsize=7, loc="lower left")
    ax1.invert_yaxis()
    # Every sync's download time when the raw records are kept, else the summary's quantiles.
    data = [[s["download_s"] for w in r["workers"] for s in w["syncs"]] if r.get("workers") else
            [s for s in (r["sync_s"]["p50"], r["sync_s"]["p90"], r["sync_s"]["max"]) if s is not None]
            for r in rows]
    ax2.boxplot([d or [0.0] for d in data], orientation="horizontal", tick_labels=labels)
    ax2.set_xscale("log")
    ax2.set_xlabel("sync (download) seconds per version, all workers")
    ax2.invert_yaxis()
    step = rows[0]["step_s"]
    rtt = result.get("rtt_ms", 0.0)
    fig.suptitle(f"1.7B shape, {result['versions']} versions, step {step:.2f} s, RTT {rtt:g} ms (every "
                 f"pair), link rates per arm; {result['generation']}; {result['host']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
