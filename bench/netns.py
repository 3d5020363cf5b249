"""Shaped links between network namespaces (root only; Linux ip-netns(8), tc-htb(8)).

    hub ── uplink ── router ── link i ── worker i   (one namespace each)

The hub holds the registry and Redis; the router forwards, so workers reach the hub and each
other. Every link is a veth pair shaped with htb on its sending side: the hub's side of the uplink
(registry egress, all workers together), the router's side of link i (what worker i downloads,
from the registry or from peers) and worker i's side (what it uploads to peers). A rate of None
leaves that side unshaped. Everything created here is deleted by close(), also on errors and
signals (the caller's `with`).

Delay (netem is not available everywhere): a link with `rtt_ms` (or `loss`) is a delay line
instead (bench/delayline.py: a TUN device on each side and a process that holds every packet for
rtt_ms / 2 each way); htb shapes its TUN devices' sending sides as it does a veth's. While a Net
has a delay line, every link of it uses the delay line's large MTU (a path through it must not
fall back to 1500-byte packets, which Python could not move at a gigabit).

Round trips add up along the path: a link's rtt_ms is the round trip across that link alone and
the router adds none, so worker i ↔ hub is link i + uplink and worker i ↔ worker j is link i +
link j (path_rtt_ms). Every pair gets the same round trip R only with R / 2 on every link, the
uplink included (every_pair_rtt): with three or more workers d_i + d_j = R / 2 for all pairs
forces every one-way delay d_i = R / 4.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from dataclasses import dataclass

from bench.delayline import MTU, Line, Mover, open_tun


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, check=check, capture_output=True, text=True)


@dataclass(frozen=True)
class Link:
    down_bps: float | None  # away from the hub: router → worker (on the uplink: hub → router)
    up_bps: float | None = None  # toward the hub: worker → router (what it serves to peers)
    rtt_ms: float = 0.0  # round trip across this link alone (half each way); 0 and no loss: a veth pair
    loss: float = 0.0  # fraction of packets dropped at random, each direction

    @property
    def delayed(self) -> bool:
        return self.rtt_ms > 0 or self.loss > 0


def path_rtt_ms(uplink: Link, links: list[Link], a: int | None, b: int | None) -> float:
    """Round trip between two endpoints, each a worker's index or None for the hub: the rtt_ms of
    the links between them (the router adds none; queueing behind a shaped rate comes on top)."""
    def leg(x: int | None) -> float:
        return uplink.rtt_ms if x is None else links[x].rtt_ms

    return 0.0 if a == b else leg(a) + leg(b)


def every_pair_rtt(uplink: Link, links: list[Link], rtt_ms: float) -> tuple[Link, list[Link]]:
    """The same links with rtt_ms / 2 on each, the uplink's included: then every pair of endpoints
    (worker ↔ worker, worker ↔ hub) is `rtt_ms` apart (module docstring)."""
    return (dataclasses.replace(uplink, rtt_ms=rtt_ms / 2),
            [dataclasses.replace(x, rtt_ms=rtt_ms / 2) for x in links])


UPLINK = -1  # key of the uplink among the links (worker i's is i)


class Net:
    HUB_IP = "10.200.0.1"

    def __init__(self, workers: int, tag: str | None = None) -> None:
        self.tag = tag or str(os.getpid() % 100000)
        self.hub, self.router = f"sch{self.tag}", f"scr{self.tag}"
        self.workers = [f"scw{self.tag}-{i}" for i in range(workers)]
        self._made: list[str] = []
        self._tuns: dict[int, tuple[int, int]] = {}  # link → its TUN devices' descriptors
        self._delays: dict[int, tuple[float, float]] = {}  # link → (rtt_ms, loss) the mover applies
        self._mover: Mover | None = None
        self.mover_stats: list[dict[str, int | float] | None] = []  # per mover stopped

    def worker_ip(self, i: int) -> str:
        return f"10.200.{i + 1}.2"

    def ns_prefix(self, ns: str) -> list[str]:
        return ["ip", "netns", "exec", ns]

    def __enter__(self) -> Net:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _ends(self, key: int) -> tuple[tuple[str, str, str], tuple[str, str, str]]:
        """(namespace, device, address) of the link's side nearer the hub, then of the other."""
        t = self.tag
        if key == UPLINK:
            return (self.hub, f"u{t}h", self.HUB_IP), (self.router, f"u{t}r", "10.200.0.2")
        return (self.router, f"l{t}r{key}", f"10.200.{key + 1}.1"), (self.workers[key], f"l{t}w{key}",
                                                                     self.worker_ip(key))

    def _link(self, key: int, delayed: bool) -> None:
        """Make link `key`: a veth pair, or two TUN devices for the mover; addresses, route."""
        (a_ns, a_if, a_ip), (b_ns, b_if, b_ip) = ends = self._ends(key)
        if delayed:
            fa = open_tun(a_if)
            try:
                fb = open_tun(b_if)
            except BaseException:
                os.close(fa)
                raise
            self._tuns[key] = (fa, fb)
        else:
            sh("ip", "link", "add", a_if, "type", "veth", "peer", "name", b_if)
        sh("ip", "link", "set", a_if, "netns", a_ns)
        sh("ip", "link", "set", b_if, "netns", b_ns)
        for ns, dev, ip in ends:
            sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
            if self._tuns:
                sh("ip", "-n", ns, "link", "set", dev, "mtu", str(MTU))
            sh("ip", "-n", ns, "link", "set", dev, "up")
        # The default route of the far side (the hub, a worker) goes through its link.
        far_ns, near_ip = (a_ns, b_ip) if key == UPLINK else (b_ns, a_ip)
        sh("ip", "-n", far_ns, "route", "replace", "default", "via", near_ip)

    def _unlink(self, key: int) -> None:
        (a_ns, a_if, _), _ = self._ends(key)
        if key in self._tuns:  # the mover is stopped: closing the last descriptors deletes both devices
            for fd in self._tuns.pop(key):
                os.close(fd)
        else:
            sh("ip", "-n", a_ns, "link", "del", a_if)

    def _build(self) -> None:
        for ns in (self.hub, self.router, *self.workers):
            sh("ip", "netns", "add", ns)
            self._made.append(ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        for key in (UPLINK, *range(len(self.workers))):
            self._link(key, delayed=False)
        sh(*self.ns_prefix(self.router), "sysctl", "-qw", "net.ipv4.ip_forward=1")

    def tune_tcp(self, buffer_max: int | None = None, slow_start_after_idle: bool = True) -> dict[str, str]:
        """TCP settings of the hub's and the workers' namespaces (each namespace has its own; the
        host's stay as they are): `buffer_max` bytes as the last field of net.ipv4.tcp_wmem and
        tcp_rmem, how far autotuning grows a socket's buffers (one stream carries at most its
        window per RTT; None: the namespace's default), and net.ipv4.tcp_slow_start_after_idle
        (False: a connection idle between versions keeps its congestion window). Returns the
        settings as written and the congestion control in effect (new namespaces take the host's:
        bbr on some kernels, cubic on most distributions'; a namespace may not change it), for the
        results."""
        settings = {"net.ipv4.tcp_slow_start_after_idle": "1" if slow_start_after_idle else "0"}
        if buffer_max is not None:
            settings["net.ipv4.tcp_wmem"] = f"4096 16384 {buffer_max}"
            settings["net.ipv4.tcp_rmem"] = f"4096 131072 {buffer_max}"
        for ns in (self.hub, *self.workers):
            for name, value in settings.items():
                sh(*self.ns_prefix(ns), "sysctl", "-qw", f"{name}={value}")
        in_effect = sh(*self.ns_prefix(self.hub), "sysctl", "-n", "net.ipv4.tcp_congestion_control").stdout
        return settings | {"net.ipv4.tcp_congestion_control": in_effect.strip()}

    def _rate(self, ns: str, dev: str, bps: float | None) -> None:
        sh("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root", check=False)
        if bps is None:
            return
        rate = f"{int(bps / 1e3)}kbit"
        # burst sized for ~1 ms at the rate (>= 15 kB, the recipe's): htb's own default is too
        # small for gigabit rates and undershoots them.
        burst = f"{max(15_000, int(bps / 8 / 1000))}b"
        sh(
            "ip",
            "netns",
            "exec",
            ns,
            "tc",
            "qdisc",
            "add",
            "dev",
            dev,
            "root",
            "handle",
            "1:",
            "htb",
            "default",
            "10",
        )
        sh("ip", "netns", "exec", ns, "tc", "class", "add", "dev", dev, "parent", "1:", "classid", "1:10",
           "htb", "rate", rate, "ceil", rate, "burst", burst, "cburst", burst)

    def _delay(self, want: dict[int, Link]) -> None:
        """Give every link its delay: links that change kind are made again, and the mover restarted
        with the new delays (packets it held are dropped: shape between runs, not during one)."""
        delays = {k: (x.rtt_ms, x.loss) for k, x in want.items() if x.delayed}
        if delays == self._delays:
            return
        self._stop_mover()
        had_tuns = bool(self._tuns)
        for key, x in want.items():
            if x.delayed != (key in self._tuns):
                self._unlink(key)
                self._link(key, x.delayed)
        if bool(self._tuns) != had_tuns:  # every link at the delay line's MTU, or all back to veth's
            mtu = str(MTU) if self._tuns else "1500"
            for key in want:
                if key not in self._tuns:
                    for ns, dev, _ in self._ends(key):
                        sh("ip", "-n", ns, "link", "set", dev, "mtu", mtu)
        if delays:
            self._mover = Mover([Line(*self._tuns[k], delay_s=rtt / 2000, loss=loss)
                                 for k, (rtt, loss) in delays.items()])
        self._delays = delays

    def shape(self, uplink: float | None | Link, links: list[Link]) -> None:
        """Rates (and delays) of the uplink and of every worker's link. A plain rate for the uplink
        shapes its hub side only (registry egress), as Link(rate) does."""
        up = uplink if isinstance(uplink, Link) else Link(uplink)
        want = {UPLINK: up, **dict(enumerate(links))}
        if len(links) != len(self.workers):
            raise ValueError(f"{len(links)} links for {len(self.workers)} workers")
        self._delay(want)
        for key, x in want.items():
            (a_ns, a_if, _), (b_ns, b_if, _) = self._ends(key)
            self._rate(a_ns, a_if, x.down_bps)
            self._rate(b_ns, b_if, x.up_bps)

    def hub_tx_bytes(self) -> int:
        """Bytes the hub has sent over its uplink (registry egress, headers included)."""
        out = sh("ip", "-n", self.hub, "-s", "-j", "link", "show", "dev", f"u{self.tag}h").stdout
        return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])

    def _stop_mover(self) -> None:
        if self._mover is not None:
            self._mover.close()
            self.mover_stats.append(self._mover.stats)
            self._mover = None
            self._delays = {}

    def close(self) -> None:
        # The mover first, then the TUN devices (closing their descriptors deletes them); deleting
        # a namespace deletes its veth ends and their qdiscs.
        try:
            self._stop_mover()
        finally:
            for fds in self._tuns.values():
                for fd in fds:
                    os.close(fd)
            self._tuns.clear()
            for ns in reversed(self._made):
                sh("ip", "netns", "pids", ns, check=False)
                sh("ip", "netns", "del", ns, check=False)
            self._made.clear()
