"""Relay fan-out on shaped links: `python -m bench.wan --relay [--relay-link 100mbit]` (root).

8 workers, each on a link of `--relay-link` (1 Gbit/s or 100 Mbit/s, both ways), behind one
registry uplink of the same rate (bench/netns.py), `--rtt-ms R` apart (every pair, worker ↔ worker
and worker ↔ registry: R / 2 on each link, a delay line; default 0, no delay). The publisher PUTs
one patch of the 1.7B-shape chain (bench/wan_chain.py) per round, once every worker holds the
previous one; each worker downloads it as soon as Redis announces it, every piece verified by
sha256: `direct` from the registry, or `relay` (shared.relay: peers first, the registry for the
rest). Measured per version: registry egress (uplink counter and the registry's bytes served) in
patches, the time until all 8 hold it, and the CPU the workers spent (per process, and the host's
busy cores: on a small host eight workers hashing and serving may be CPU-bound rather than
link-bound). In `relay` the workers first warm up (shared.relay.Relay.warm_up, as rollout services
started from their own weights do: the first pieces of the v0 snapshot through the pipeline);
`relay-cold` is the same without it, what the first version costs on new connections. A last run,
`relay-kill`, kills the worker that fetches from the registry (the head of the pipeline every other
worker relays from) a quarter of the way into the first version. `tree` is `relay` with the
registry's `PEER_TREE=measured` (services/registry/peers.py: a tree chosen by the paths workers
measure; run only when asked for, `--relay-modes ... tree`).
Heterogeneous links: `--slow-workers N --slow-mbit R` gives N workers an uplink (what they serve
to peers) of R Mbit/s, the 2nd to the (N+1)th in the order of first announcement (the workers then
warm up one after another in index order, so that order is their index; in `relay-cold` it is the
order of arrival); the JSON's `slow_workers` says which.
Workers download and verify only: applying a patch is GPU work, not measured here.
`--profile-worker I` writes a cProfile of worker I's relay run (its top functions go into the
JSON). The plot beside the JSON (`python -m bench.wan_relay JSON...` draws it again): seconds until
all 8 hold each version per mode, and relayed ÷ direct against the 0.5 target.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import io
import json
import os
import pstats
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.netns import Link, Net, every_pair_rtt
from bench.wan_stack import GBIT, MBIT, PEER_PORT, REDIS_PORT, REGISTRY_PORT, ROOT, RUN, TOKEN, Stack, barrier
from shared.gcheap import freeze_startup_heap
from shared.relay import PEER_CONGESTION

WORKERS = 8
RATES = {"1gbit": GBIT, "100mbit": 100 * MBIT}


def worker_links(rate: float, slow: int = 0, slow_bps: float = 100 * MBIT) -> tuple[list[Link], list[int]]:
    """Every worker's link at `rate` both ways, except that `slow` of them serve at `slow_bps`
    (their uplink): the 2nd to the (slow+1)th, early in the order, where a chain puts every later
    worker behind them. The head (1st) and the last stay fast, so a slow hop sits mid-pipeline.
    Returns the links and the slow workers' indices."""
    if not 0 <= slow <= WORKERS - 2:
        raise ValueError(f"--slow-workers must be 0 to {WORKERS - 2}, not {slow}")
    if slow and slow_bps <= 0:
        raise ValueError(f"--slow-mbit must be positive, not {slow_bps / MBIT:g}")
    chosen = list(range(1, 1 + slow))
    return [Link(rate, slow_bps if i in chosen else rate) for i in range(WORKERS)], chosen


def cpu_s() -> float:
    """CPU seconds of this process so far (all threads: the hashing ones too)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def proc_cpu_s(pid: int) -> float:
    """CPU seconds of another process (user + system, from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def host_busy() -> tuple[float, float]:
    """(busy, total) jiffies of the whole host from /proc/stat (idle and iowait are not busy)."""
    fields = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(fields) - fields[3] - fields[4], sum(fields)


async def relay_worker(cfg: dict[str, Any]) -> dict[str, Any]:
    if not cfg.get("profile"):
        return await _relay_worker(cfg)
    profiler = cProfile.Profile(time.thread_time)  # CPU of the event loop's thread, not wall time
    profiler.enable()
    try:
        return await _relay_worker(cfg)
    finally:
        profiler.disable()
        profiler.dump_stats(str(Path(cfg["out"]).with_suffix(".prof")))


async def _relay_worker(cfg: dict[str, Any]) -> dict[str, Any]:
    import uvicorn

    from shared.registry.client import RegistryClient
    from shared.registry.transport import KEEP_ALIVE_S
    from shared.relay import Holdings, Relay, peer_listener, relay_app, snapshot_in

    client = RegistryClient(cfg["url"], RUN, token=TOKEN, streams=4, redis_url=cfg["redis_url"],
                            redis_prefix=cfg["redis_prefix"], backoff_s=0.1)
    server, relay = None, None
    if cfg["relay"]:
        holdings = Holdings(keep=2)  # this version's patch and the last: ~150 MB per worker here
        # Kept-alive connections between versions, and socket buffers wider than autotuning's
        # where net.core.wmem_max / rmem_max allow (shared.relay.socket_buffers).
        config = uvicorn.Config(relay_app(holdings), log_level="warning",
                                timeout_keep_alive=KEEP_ALIVE_S)
        server = uvicorn.Server(config)
        serving = asyncio.create_task(server.serve(sockets=[peer_listener(cfg["ip"], PEER_PORT)]))
        relay = Relay(f"w{cfg['index']}", f"http://{cfg['ip']}:{PEER_PORT}", holdings)
        client.downloader.relay = relay
    while True:
        try:
            await client.ping()
            break
        except Exception:  # noqa: BLE001 - starting
            await asyncio.sleep(0.3)
    warm_up: dict[str, Any] | None = None
    if relay is not None and cfg["warm_up"]:  # as a rollout service started from its own weights
        while cfg.get("warm_after") and not Path(cfg["warm_after"]).exists():  # one after another
            await asyncio.sleep(0.05)
        started = time.time()
        warmed = await relay.warm_up(client.downloader, plan := await client.plan(None))
        key = snapshot.key if (snapshot := snapshot_in(plan)) is not None else None
        warm_up = {"warmed": warmed, "seconds": round(time.time() - started, 3), "key": key,
                   "peers": relay.stats.peers.get(key)}
        Path(cfg["out"] + ".warm").touch()
    freeze_startup_heap()  # as the rollout service does once started (shared.gcheap)
    gc.callbacks.append(full_passes := _FullPasses())
    await barrier(cfg)
    version, rounds = 0, []
    status = Path(cfg["out"] + ".status")
    while version < cfg["versions"]:
        target = await client.wait_for_version(version, timeout=300, poll_s=1.0)
        if target is None:
            break
        started = time.time()
        status.write_text(json.dumps({"version": target, "started": started}))
        cpu0, served0 = cpu_s(), relay.holdings.served_bytes if relay else 0
        plan = await client.plan(version, target)
        stats0 = dict(vars(relay.stats)) if relay else {}
        fetching = asyncio.create_task(client.download([s.object for s in plan.steps]))
        key = plan.steps[-1].object.key
        while relay and not fetching.done() and key not in relay.stats.peers:
            await asyncio.sleep(0.002)
        if relay:  # whom the registry listed: no peer is the pipeline's head (bench: kill_root)
            status.write_text(json.dumps({"version": target, "started": started,
                                          "peers": relay.stats.peers.get(key)}))
        views = await fetching
        for view in views:
            view.release()
        row = {"version": target, "started": started, "finished": time.time(), "bytes": plan.total_bytes}
        if relay:
            stats = relay.stats
            row.update(peer_pieces=stats.peer_pieces - stats0["peer_pieces"],
                       registry_pieces=stats.registry_pieces - stats0["registry_pieces"],
                       dropped=dict(stats.dropped), served_pieces=relay.holdings.served_pieces,
                       peers=stats.peers.get(key),
                       # what it reports of its sources next (the measured tree's input)
                       paths={k: v.model_dump() for k, v in relay.paths.items()})
        # CPU until this worker holds v; what it serves after that is counted in the next round.
        row.update(cpu_s=round(cpu_s() - cpu0, 3),
                   served_bytes=(relay.holdings.served_bytes - served0) if relay else 0)
        rounds.append(row)
        status.write_text(json.dumps({"version": target, "started": started, "done": row["finished"]}))
        version = target
    done = Path(cfg["go"] + ".done")
    while not done.exists():  # keep serving until every worker holds the last version
        await asyncio.sleep(0.1)
    if server is not None:
        server.should_exit = True
        await serving
        await relay.aclose()
    await client.aclose()
    gc.callbacks.remove(full_passes)
    return {"worker": cfg["index"], "rounds": rounds, "gc_full_passes": full_passes.passes,
            "warm_up": warm_up}


class _FullPasses:
    """gc callback: [wall time at start, seconds] of each full (generation-2) collection, which stalls
    every stream the process forwards (shared.gcheap)."""

    def __init__(self) -> None:
        self.passes: list[list[float]] = []
        self._began = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._began = time.time()
        elif info["generation"] == 2:
            self.passes.append([self._began, round(time.time() - self._began, 4)])


def hub_counters(net: Net) -> int:
    return net.hub_tx_bytes()


def served(net: Net) -> int:
    out = subprocess.run([*net.ns_prefix(net.hub), sys.executable, "-c",
                          f"import httpx; print(httpx.get('http://{Net.HUB_IP}:{REGISTRY_PORT}/metrics').text)"],
                         capture_output=True, text=True, check=True).stdout
    return int(sum(float(line.split()[-1]) for line in out.splitlines()
                   if line.startswith("sparsecast_registry_bytes_served_total")))


def publish(net: Net, chain: Path, v: int) -> float:
    code = (
        f"import httpx,sys; r=httpx.put('http://{Net.HUB_IP}:{REGISTRY_PORT}/v1/runs/{RUN}/patches/{v}',"
        f" content=open(sys.argv[1],'rb').read(), headers={{'Authorization':'Bearer {TOKEN}'}}, timeout=120);"
        " r.raise_for_status(); import time; print(time.time())"
    )
    # The time the registry answered the PUT (the version is out), not when this process ends.
    out = subprocess.run(
        [*net.ns_prefix(net.hub), sys.executable, "-c", code, str(chain / "patches" / f"{v}.patch")],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return float(out.split()[-1])


def run_mode(net: Net, stack: Stack, chain: Path, scratch: Path, name: str, versions: int, rate: float,
             profile_worker: int | None = None, in_order: bool = False) -> dict[str, Any]:
    """One run on a fresh registry store: `direct`, `relay` (workers warm up before the first
    version, as rollout services started from their own weights: shared.relay.Relay.warm_up),
    `relay-cold` (relay without it), `relay-kill` (relay, and the pipeline's head is killed a
    quarter of the way into version 1), or `tree` (relay, the registry choosing a tree by measured
    paths). `in_order`: workers warm up one after another, in index order."""
    relay, kill = name != "direct", name == "relay-kill"
    store = scratch / f"store-{name}"
    shutil.copytree(chain / "store", store, copy_function=os.link)
    prefix = f"wanrelay{net.tag}{name}"
    registry = stack.registry(store, prefix, scratch / f"registry-{name}.log",
                              {"SPARSECAST_PEER_TREE": "measured" if name == "tree" else "chain"})
    url = f"http://{Net.HUB_IP}:{REGISTRY_PORT}"
    go = scratch / f"go-{name}"
    outs, procs = [], []
    for i, ns in enumerate(net.workers):
        out = scratch / f"r-{name}-{i}.json"
        outs.append(out)
        cfg = {
            "index": i,
            "url": url,
            "redis_url": f"redis://{Net.HUB_IP}:{REDIS_PORT}",
            "redis_prefix": prefix,
            "relay": relay,
            "warm_up": relay and name != "relay-cold",
            "warm_after": str(outs[i - 1]) + ".warm" if in_order and i else None,
            "ip": net.worker_ip(i),
            "versions": versions,
            "go": str(go),
            "out": str(out),
            "profile": name == "relay" and i == profile_worker,
        }
        procs.append(stack.python(ns, "relay_worker", cfg, scratch / f"r-{name}-{i}.log"))
    rows = []
    tx_start = hub_counters(net)
    try:
        limit = time.time() + 180
        while not all(Path(str(o) + ".ready").exists() for o in outs):
            if time.time() > limit or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"relay {name}: a worker did not start (logs in {scratch})")
            time.sleep(0.2)
        warm_up_egress = hub_counters(net) - tx_start  # the registry's bytes before version 1
        go.write_text(repr(time.time()))
        time.sleep(1.0)
        for v in range(1, versions + 1):
            patch = (chain / "patches" / f"{v}.patch").stat().st_size
            tx0, served0, busy0, reg0 = hub_counters(net), served(net), host_busy(), proc_cpu_s(registry.pid)
            at = publish(net, chain, v)
            killed = None
            if kill and v == 1:  # a quarter of the patch's time on the uplink: mid-transfer
                killed = kill_root(outs, procs, v, delay_s=0.25 * patch * 8 / rate)
            alive = [i for i in range(len(outs)) if i != killed]
            deadline = time.time() + 300
            while not all(status_done(outs[i], v) for i in alive):
                if time.time() > deadline or any(procs[i].poll() is not None for i in alive):
                    raise RuntimeError(f"relay {name}: version {v} not everywhere (logs in {scratch})")
                time.sleep(0.02)
            finished = max(status_done(outs[i], v) or 0.0 for i in alive)
            busy1, reg1 = host_busy(), proc_cpu_s(registry.pid)
            cores = (busy1[0] - busy0[0]) / (busy1[1] - busy0[1]) * (os.cpu_count() or 1)
            time.sleep(0.5)  # late counters (retransmits, acks of the last bytes)
            egress, sent = hub_counters(net) - tx0, served(net) - served0
            row = {"version": v, "patch_bytes": patch, "all_hold_s": round(finished - at, 3),
                   "ideal_s": round(patch * 8 / rate * (1 if relay else WORKERS), 3),
                   "registry_egress_bytes": egress, "registry_bytes_served": sent,
                   "egress_in_patches": round(egress / patch, 3), "killed_worker": killed,
                   # Cores busy on the whole host (every process, other users' too) until all hold v.
                   "host_busy_cores": round(cores, 2), "registry_cpu_s": round(reg1 - reg0, 2),
                   "load_avg_1m": round(os.getloadavg()[0], 2)}
            print(json.dumps({"mode": name, **row}), flush=True)
            rows.append(row)
            time.sleep(1.0)
        go.with_name(go.name + ".done").touch()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                stack.stop(proc)
    finally:
        for proc in procs:
            stack.stop(proc)
        stack.stop(registry)
        shutil.rmtree(store, ignore_errors=True)
    workers = [json.loads(o.read_text()) for o in outs if o.exists()]
    result: dict[str, Any] = {"mode": name, "versions": rows, "workers": workers,
                              "registry_egress_before_v1_bytes": warm_up_egress}
    prof = outs[profile_worker].with_suffix(".prof") if profile_worker is not None else None
    if prof is not None and prof.exists():
        text = io.StringIO()
        pstats.Stats(str(prof), stream=text).sort_stats("tottime").print_stats(20)
        result["profile_worker"] = {"worker": profile_worker, "top_tottime": text.getvalue().splitlines()}
    return result


def status_done(out: Path, v: int) -> float | None:
    try:
        status = json.loads(Path(str(out) + ".status").read_text())
    except (OSError, ValueError):
        return None
    return status.get("done") if status.get("version") == v else None


def kill_root(outs: list[Path], procs: list[subprocess.Popen[bytes]], v: int, delay_s: float) -> int | None:
    """Kill the head of version v's pipeline (the worker the registry listed no peer for: it
    fetches from the registry, every other worker relays from it), delay_s after it started."""
    deadline = time.time() + 30
    while time.time() < deadline:
        for i, out in enumerate(outs):
            try:
                status = json.loads(Path(str(out) + ".status").read_text())
            except (OSError, ValueError):
                continue
            if status.get("version") == v and status.get("peers") == []:
                time.sleep(max(0.0, status["started"] + delay_s - time.time()))
                procs[i].send_signal(signal.SIGKILL)
                return i
        time.sleep(0.005)
    return None


DEFAULT_MODES = ("direct", "relay", "relay-cold", "relay-kill")
MODES = (*DEFAULT_MODES, "tree")


def cpu_per_byte(mode: dict[str, Any]) -> dict[str, Any]:
    """CPU of the registry and of the workers (per byte received) over every round but the first
    (which also pays for starting up: imports, first pages of the receive buffers)."""
    rows = [r for w in mode["workers"] for r in w["rounds"] if r["version"] > 1]
    received = sum(r["bytes"] for r in rows)
    versions = [r for r in mode["versions"] if r["version"] > 1]
    return {"registry_cpu_s": round(sum(r["registry_cpu_s"] for r in versions), 2),
            "registry_bytes_served": sum(r["registry_bytes_served"] for r in versions),
            "worker_cpu_s": round(sum(r["cpu_s"] for r in rows), 2), "bytes_received": received,
            "bytes_served": sum(r["served_bytes"] for r in rows),
            "cpu_ns_per_byte_received": round(sum(r["cpu_s"] for r in rows) / received * 1e9, 2)
            if received else None}


def main(args: argparse.Namespace) -> None:
    chain = args.chain or ROOT / "scratch" / f"wan-chain-{args.shape}"
    if not (chain / "chain.json").exists():
        from bench.wan_chain import prepare

        prepare(chain, args.shape, args.versions, RUN)
    info = json.loads((chain / "chain.json").read_text())
    versions = min(args.versions, len(info["versions"]))
    rate = RATES[args.relay_link]
    links, slow = worker_links(rate, args.slow_workers, args.slow_mbit * MBIT)
    scratch = Path(tempfile.mkdtemp(prefix="wan-relay-"))
    result: dict[str, Any] = {
        "bench": "wan-relay", "command": " ".join(["python -m bench.wan", *sys.argv[1:]]),
        "host": f"{os.cpu_count()} CPU cores, no GPU (download and verify only)",
        "load_avg_at_start": [round(x, 2) for x in os.getloadavg()], "workers": WORKERS,
        "uplink_bps": rate, "worker_link_bps": rate, "rtt_ms": args.rtt_ms, "link_rtt_ms": args.rtt_ms / 2,
        # Workers (by index: their place in the order of first announcement) serving at a lower rate.
        "slow_workers": {"workers": slow, "up_bps": args.slow_mbit * MBIT if slow else None},
        "versions": versions, "chain": info, "modes": [],
    }
    modes = args.relay_modes or DEFAULT_MODES
    with Net(WORKERS) as net:
        uplink, links = every_pair_rtt(Link(rate), links, args.rtt_ms)
        net.shape(uplink, links)
        result["tcp"] = net.tune_tcp(args.tcp_buffer_mb << 20 if args.tcp_buffer_mb else None,
                                     slow_start_after_idle=not args.no_idle_restart)
        result["tcp"]["peer_listener_congestion_control"] = PEER_CONGESTION or "the namespace's"
        stack = Stack(net, scratch)
        try:
            for name in modes:
                result["modes"].append(run_mode(net, stack, chain, scratch, name, 1 if name == "relay-kill"
                                                else versions, rate, args.profile_worker, bool(slow)))
        finally:
            stack.close()
    result["delay_line"] = net.mover_stats or None
    result["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    by = {m["mode"]: m for m in result["modes"]}
    result["cpu"] = {name: cpu_per_byte(m) for name, m in by.items() if name != "relay-kill"}
    targets: dict[str, Any] = {}
    if "relay" in by:
        worst = max(r["egress_in_patches"] for r in by["relay"]["versions"])
        targets["relay_egress_per_version_in_patches"] = {"value": worst, "target": 2.0, "met": worst <= 2.0}
        # Issue 30's, at 100 ms RTT: at most 1.2 patches a version.
        targets["relay_egress_le_1_2_patches"] = {"value": worst, "met": worst <= 1.2}
    if "relay" in by and "direct" in by:
        pairs = [[r["all_hold_s"], d["all_hold_s"]] for r, d in zip(by["relay"]["versions"],
                                                                    by["direct"]["versions"], strict=True)]
        # Every version: all 8 hold it relayed no later than direct.
        targets["relay_vs_direct_all_hold_s_per_version"] = {"value": pairs,
                                                              "met": all(r <= d for r, d in pairs)}
        # Issue 30's, at 100 ms RTT: every version relayed in at most half direct's time (the first
        # version runs on new connections: its ratio is reported beside the others').
        ratios = [round(r / d, 3) for r, d in pairs]
        targets["relay_le_half_direct"] = {"ratios": ratios, "met": all(x <= 0.5 for x in ratios),
                                           "met_after_first": all(x <= 0.5 for x in ratios[1:])}
    if "relay-cold" in by and "direct" in by:  # the same without the warm-up: what it buys at v1
        ratios = [round(r["all_hold_s"] / d["all_hold_s"], 3) for r, d in
                  zip(by["relay-cold"]["versions"], by["direct"]["versions"], strict=True)]
        targets["relay_cold_le_half_direct"] = {"ratios": ratios, "met": all(x <= 0.5 for x in ratios)}
    if "tree" in by and "relay" in by:  # the measured tree against the chain, version by version
        pairs = [[t["all_hold_s"], r["all_hold_s"]] for t, r in zip(by["tree"]["versions"],
                                                                    by["relay"]["versions"], strict=True)]
        targets["tree_vs_chain_all_hold_s_per_version"] = {"value": pairs,
                                                           "ratios": [round(t / r, 3) for t, r in pairs]}
    if "relay-kill" in by and "relay" in by:
        kill, steady = by["relay-kill"]["versions"][0], by["relay"]["versions"][0]
        # The version reached every live worker (a stuck one raises above); its cost in time and egress:
        targets["kill_head_version_1"] = {"all_hold_s": [kill["all_hold_s"], steady["all_hold_s"]],
                                          "egress_in_patches": [kill["egress_in_patches"],
                                                                steady["egress_in_patches"]],
                                          "met": kill["egress_in_patches"] <= 2.0}
    result["targets"] = targets
    out = args.out.with_name(args.out.stem + "-relay" + ("" if args.relay_link == "1gbit" else
                                                         f"-{args.relay_link}")
                             + (f"-slow{len(slow)}x{args.slow_mbit:g}mbit" if slow else "") + ".json")
    out.write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    shutil.rmtree(scratch, ignore_errors=True)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = {m["mode"]: m for m in result["modes"] if m["mode"] != "relay-kill"}
    if not by:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    for name, mode in by.items():
        versions = [v["version"] for v in mode["versions"]]
        ax1.plot(versions, [v["all_hold_s"] for v in mode["versions"]], marker="o", label=name)
    ax1.set_xlabel("version")
    ax1.set_ylabel("seconds until all 8 hold it")
    ax1.set_ylim(bottom=0)
    ax1.legend(fontsize=8)
    if "relay" in by and "direct" in by:
        pairs = list(zip(by["relay"]["versions"], by["direct"]["versions"], strict=True))
        ax2.bar([r["version"] for r, _ in pairs], [r["all_hold_s"] / d["all_hold_s"] for r, d in pairs])
        ax2.axhline(0.5, color="k", ls=":", lw=0.8, label="target: ≤ 0.5")
        ax2.set_xlabel("version")
        ax2.set_ylabel("relayed ÷ direct")
        ax2.legend(fontsize=8)
    tcp = result.get("tcp") or {}
    fig.suptitle(f"{result['workers']} workers, links {result['worker_link_bps'] / 1e9:g} Gbit/s, RTT "
                 f"{result.get('rtt_ms', 0):g} ms between every pair, {result['versions']} versions of the "
                 f"{result['chain']['shape']} chain, one version published once all hold the last; "
                 f"{tcp.get('net.ipv4.tcp_congestion_control', '?')} (peers: "
                 f"{tcp.get('peer_listener_congestion_control', 'the same')}); {result['host']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    for name in sys.argv[1:]:
        plot(json.loads(Path(name).read_text()), Path(name).with_suffix(".png"))
