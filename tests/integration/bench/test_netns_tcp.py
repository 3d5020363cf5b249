"""bench/netns.py Net.tune_tcp: TCP settings of the bench's namespaces, the host's left alone.
Root only (ip netns)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from bench.netns import Net
from tests.integration.bench.test_delayline import netns_work

pytestmark = pytest.mark.skipif(not netns_work(), reason="needs root, ip netns, tc and /dev/net/tun")

NAMES = ("net.ipv4.tcp_wmem", "net.ipv4.tcp_rmem", "net.ipv4.tcp_slow_start_after_idle")


def host(name: str) -> str:
    return " ".join(Path(f"/proc/sys/{name.replace('.', '/')}").read_text().split())


def test_tune_tcp_sets_the_hub_and_workers_namespaces_only() -> None:
    before = {name: host(name) for name in NAMES}
    with Net(2) as net:
        written = net.tune_tcp(48 << 20, slow_start_after_idle=False)
        for ns in (net.hub, *net.workers):
            got = {name: " ".join(subprocess.run([*net.ns_prefix(ns), "sysctl", "-n", name], check=True,
                                                 capture_output=True, text=True).stdout.split())
                   for name in NAMES}
            assert got == {"net.ipv4.tcp_wmem": f"4096 16384 {48 << 20}",
                           "net.ipv4.tcp_rmem": f"4096 131072 {48 << 20}",
                           "net.ipv4.tcp_slow_start_after_idle": "0"}
            assert {k: v for k, v in written.items() if k in NAMES} == got
        # The congestion control in effect is reported (the host's: a namespace takes it at creation).
        assert written["net.ipv4.tcp_congestion_control"] == host("net.ipv4.tcp_congestion_control")
    assert {name: host(name) for name in NAMES} == before
