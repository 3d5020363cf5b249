"""The delay line of bench/netns.py (bench/delayline.py) between real network namespaces: round
trip, rate with delay, and nothing left behind. Root only (ip netns, tc, /dev/net/tun)."""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.netns import Link, Net, every_pair_rtt, path_rtt_ms


@functools.cache
def netns_work() -> bool:
    if os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc") and Path("/dev/net/tun").exists()):
        return False
    name = f"scprobe{os.getpid() % 100000}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode == 0
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return made


pytestmark = pytest.mark.skipif(not netns_work(), reason="needs root, ip netns, tc and /dev/net/tun")

PORT = 9099

SERVER = """
import socket, sys, time, json
mode, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
s.bind((host, port)); s.listen(1)
print("ready", flush=True)
c, _ = s.accept()
t0, n = time.monotonic(), 0
while data := c.recv(1 << 20):
    n += len(data)
    if mode == "echo":
        c.sendall(data)
print(json.dumps({"bytes": n, "s": time.monotonic() - t0}), flush=True)
"""

CLIENT = """
import socket, sys, time, json
mode, host, port, size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
t = time.monotonic(); s.connect((host, port)); connect = time.monotonic() - t
echo = []
if mode == "echo":
    for _ in range(size):
        t = time.monotonic(); s.sendall(b"x"); s.recv(1); echo.append(time.monotonic() - t)
else:
    s.sendall(bytes(size))
s.close()
print(json.dumps({"connect_s": connect, "echo_s": echo}), flush=True)
"""


def talk(net: Net, server_ns: str, server_ip: str, client_ns: str, mode: str, size: int) -> tuple[dict, dict]:
    """A server in one namespace, a client in another; what each reports."""
    py = [sys.executable, "-I", "-c"]
    server = subprocess.Popen([*net.ns_prefix(server_ns), *py, SERVER, mode, server_ip, str(PORT)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        argv = [*net.ns_prefix(client_ns), *py, CLIENT, mode, server_ip, str(PORT), str(size)]
        client = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=True)
        out, _ = server.communicate(timeout=30)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    return json.loads(client.stdout), json.loads(out)


def test_round_trip_is_the_configured_rtt_between_every_pair() -> None:
    uplink, links = every_pair_rtt(Link(None), [Link(None), Link(None)], 40.0)
    assert path_rtt_ms(uplink, links, 0, 1) == path_rtt_ms(uplink, links, 0, None) == 40.0
    with Net(2) as net:
        net.shape(uplink, links)
        for server_ns, server_ip in ((net.hub, Net.HUB_IP), (net.workers[1], net.worker_ip(1))):
            client, server = talk(net, server_ns, server_ip, net.workers[0], "echo", 9)
            assert server["bytes"] == 9
            # The least of ten round trips, as ping's min: waiting for a core (a loaded host, nice)
            # only adds to a sample, while the line's own delay is in every one.
            rtts = sorted([client["connect_s"], *client["echo_s"]])
            assert 40 * 0.8 - 2 <= rtts[0] * 1000 <= 40 * 1.2 + 2, rtts


def test_rate_and_delay_together() -> None:
    rate, size = 50e6, 5_000_000
    with Net(1) as net:
        net.shape(None, [Link(rate, rate, rtt_ms=20.0)])
        _, server = talk(net, net.workers[0], net.worker_ip(0), net.hub, "sink", size)
    assert server["bytes"] == size
    floor = size * 8 / rate
    assert server["s"] >= floor, server
    goodput = size * 8 / server["s"]
    assert goodput >= 0.75 * rate, f"{goodput / 1e6:.1f} Mbit/s"


def tun_fds() -> int:
    fds = os.listdir("/proc/self/fd")
    return sum(os.path.realpath(f"/proc/self/fd/{fd}") == "/dev/net/tun" for fd in fds)


def test_close_leaves_no_namespaces_or_devices() -> None:
    fds = tun_fds()
    with Net(2) as net:
        net.shape(Link(None, rtt_ms=10.0), [Link(None, rtt_ms=10.0), Link(1e8)])
        # Back to veth for one link and delayed again: devices are made and removed as links change.
        net.shape(None, [Link(None, rtt_ms=4.0), Link(None, rtt_ms=6.0)])
        mover = net._mover
        assert mover is not None and tun_fds() == fds + 4
        names = [f"u{net.tag}h", f"u{net.tag}r", *(f"l{net.tag}{s}{i}" for i in range(2) for s in "rw")]
    assert mover.proc.poll() is not None
    assert tun_fds() == fds
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert not [ns for ns in (net.hub, net.router, *net.workers) if ns in listed.split()]
    devices = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True, check=True).stdout
    assert not [n for n in names if n in devices]
    assert len(net.mover_stats) == 2 and all(s is not None for s in net.mover_stats)
