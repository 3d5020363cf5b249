"""Shaped links between network namespaces (root only; ../shared/REFERENCE.md §8).

    hub ── uplink ── router ── link i ── worker i   (one namespace each)

The hub holds the registry and Redis; the router forwards, so workers reach the hub and each
other. Every link is a veth pair shaped with htb on its sending side: the hub's side of the uplink
(registry egress, all workers together), the router's side of link i (what worker i downloads,
from the registry or from peers) and worker i's side (what it uploads to peers). A rate of None
leaves that side unshaped. Everything created here is deleted by close(), also on errors and
signals (the caller's `with`).
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, check=check, capture_output=True, text=True)


@dataclass
class Link:
    down_bps: float | None  # router → worker
    up_bps: float | None = None  # worker → router (what it serves to peers)


class Net:
    HUB_IP = "10.200.0.1"

    def __init__(self, workers: int, tag: str | None = None) -> None:
        self.tag = tag or str(os.getpid() % 100000)
        self.hub, self.router = f"sch{self.tag}", f"scr{self.tag}"
        self.workers = [f"scw{self.tag}-{i}" for i in range(workers)]
        self._made: list[str] = []

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

    def _pair(self, a_ns: str, a_if: str, a_ip: str, b_ns: str, b_if: str, b_ip: str) -> None:
        sh("ip", "link", "add", a_if, "type", "veth", "peer", "name", b_if)
        sh("ip", "link", "set", a_if, "netns", a_ns)
        sh("ip", "link", "set", b_if, "netns", b_ns)
        for ns, dev, ip in ((a_ns, a_if, a_ip), (b_ns, b_if, b_ip)):
            sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")

    def _build(self) -> None:
        for ns in (self.hub, self.router, *self.workers):
            sh("ip", "netns", "add", ns)
            self._made.append(ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        t = self.tag
        self._pair(self.hub, f"u{t}h", self.HUB_IP, self.router, f"u{t}r", "10.200.0.2")
        sh("ip", "-n", self.hub, "route", "add", "default", "via", "10.200.0.2")
        for i, ns in enumerate(self.workers):
            self._pair(self.router, f"l{t}r{i}", f"10.200.{i + 1}.1", ns, f"l{t}w{i}", self.worker_ip(i))
            sh("ip", "-n", ns, "route", "add", "default", "via", f"10.200.{i + 1}.1")
        sh(*self.ns_prefix(self.router), "sysctl", "-qw", "net.ipv4.ip_forward=1")

    def _rate(self, ns: str, dev: str, bps: float | None) -> None:
        sh("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root", check=False)
        if bps is None:
            return
        rate = f"{int(bps / 1e3)}kbit"
        # burst sized for ~1 ms at the rate (>= 15 kB, the recipe's): htb's own default is too
        # small for gigabit rates and undershoots them.
        burst = f"{max(15_000, int(bps / 8 / 1000))}b"
        sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10")
        sh("ip", "netns", "exec", ns, "tc", "class", "add", "dev", dev, "parent", "1:", "classid", "1:10",
           "htb", "rate", rate, "ceil", rate, "burst", burst, "cburst", burst)

    def shape(self, uplink_bps: float | None, links: list[Link]) -> None:
        t = self.tag
        self._rate(self.hub, f"u{t}h", uplink_bps)
        for i, (ns, link) in enumerate(zip(self.workers, links, strict=True)):
            self._rate(self.router, f"l{t}r{i}", link.down_bps)
            self._rate(ns, f"l{t}w{i}", link.up_bps)

    def hub_tx_bytes(self) -> int:
        """Bytes the hub has sent over its uplink (registry egress, headers included)."""
        out = sh("ip", "-n", self.hub, "-s", "-j", "link", "show", "dev", f"u{self.tag}h").stdout
        return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])

    def close(self) -> None:
        # Deleting a namespace deletes its veth ends and their qdiscs.
        for ns in reversed(self._made):
            sh("ip", "netns", "pids", ns, check=False)
            sh("ip", "netns", "del", ns, check=False)
        self._made.clear()
