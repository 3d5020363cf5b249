"""Round-trip delay without netem: a userspace delay line over TUN devices (Linux tuntap).

A delayed link of bench/netns.py is two TUN devices, one in each namespace, instead of a veth pair.
What one side's kernel sends out of its TUN device (after that device's htb qdisc, so shaping
still applies on the sending side) is read by a mover process, held for the link's one-way delay
and written into the other side's TUN device, which hands it to that side's kernel as received.
The delay is fixed, so each direction is a FIFO (a deque of (due time, packet), due on the
monotonic clock): packets keep their order. A fraction `loss` of them may be dropped at random.

Each device is created in the root namespace (open /dev/net/tun, ioctl TUNSETIFF with
IFF_TUN | IFF_NO_PI) and then moved into its namespace with `ip link set ... netns`; the file
descriptor keeps working after the move, so nothing here enters a namespace. A TUN device lives
as long as a descriptor to it is open: closing them (the mover and the Net that made them) removes
the devices. One mover process serves every line of a Net (stdlib only, started with -I); it dies
with its parent (PR_SET_PDEATHSIG) and on SIGTERM, and reports what it moved on exit.

Limits: a CPU-bound Python loop, one packet per read/write. The devices use a large MTU (MTU,
set on both ends and on every other link of the Net: a path must not fall back to 1500-byte
packets) so that a gigabit is a few thousand packets a second; the ceiling measured is in
docs/results.md ("Delay in the harness"). Delay is accurate to about a millisecond (epoll's
timeout resolution and the scheduler); there is no jitter, reordering or duplication.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import select
import signal
import struct
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass

TUNSETIFF = 0x400454CA  # _IOW('T', 202, int)
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
MTU = 65000  # on both ends of every link of a Net that has a delay line (<= 65535, veth's and tun's maximum)
READ_BYTES = 65536
BATCH = 64  # packets read from one device per wakeup before the others get a turn


def open_tun(name: str) -> int:
    """Create TUN device `name` in this process's namespace; its descriptor (close it to delete it)."""
    if len(name.encode()) > 15:
        raise ValueError(f"interface name {name!r} is longer than 15 bytes")
    fd = os.open("/dev/net/tun", os.O_RDWR)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", name.encode(), IFF_TUN | IFF_NO_PI))
    except BaseException:
        os.close(fd)
        raise
    return fd


@dataclass(frozen=True)
class Line:
    a: int  # descriptor of one side's TUN device
    b: int  # the other side's
    delay_s: float  # one way, each direction
    loss: float = 0.0  # fraction of packets dropped, each direction


class Mover:
    """The process that moves the packets of `lines` (their descriptors stay open here too)."""

    def __init__(self, lines: list[Line], seed: int | None = None) -> None:
        for line in lines:
            if line.delay_s < 0 or not 0 <= line.loss < 1:
                raise ValueError(f"bad delay line {line}")
        cfg = {"lines": [[x.a, x.b, x.delay_s, x.loss] for x in lines], "seed": seed}
        fds = [fd for x in lines for fd in (x.a, x.b)]
        self.stats: dict[str, int | float] | None = None
        self.cpu_s: float | None = None  # the mover's CPU seconds (user + system), once stopped
        argv = [sys.executable, "-I", os.path.abspath(__file__), "--serve", json.dumps(cfg)]
        self.proc = subprocess.Popen(argv, pass_fds=fds, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 30)
        if not ready or self.proc.stdout.readline().strip() != "ready":
            self.close()
            raise RuntimeError("the delay line's mover did not start")

    def close(self) -> None:
        """Stop the mover; its counters (packets, bytes, lost, write_errors, late_ms_max: its worst
        lateness) land in self.stats."""
        if self.proc.returncode is not None:
            return
        try:
            with open(f"/proc/{self.proc.pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            self.cpu_s = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            pass
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            out, _ = self.proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        try:
            self.stats = json.loads(out.strip().splitlines()[-1])
        except (ValueError, IndexError):
            self.stats = None


def serve(lines: list[list[float]], seed: int | None = None) -> dict[str, int | float]:
    """The mover's loop: read what each device sends, write it into its peer once due."""
    rng = random.Random(seed)
    poller = select.epoll()
    flows: dict[int, tuple[int, deque[tuple[float, bytes]], float, float]] = {}
    for a, b, delay, loss in lines:
        for src, dst in ((int(a), int(b)), (int(b), int(a))):
            os.set_blocking(src, False)
            flows[src] = (dst, deque(), delay, loss)
            poller.register(src, select.EPOLLIN)
    queues = [(dst, q) for dst, q, _, _ in flows.values()]
    stats: dict[str, int | float] = {"packets": 0, "bytes": 0, "lost": 0, "write_errors": 0}
    late_max = 0.0
    try:
        while True:
            now = time.monotonic()
            wait = -1.0
            for dst, q in queues:
                while q and q[0][0] <= now:
                    due, packet = q.popleft()
                    late_max = max(late_max, now - due)
                    try:
                        os.write(dst, packet)
                    except OSError:
                        stats["write_errors"] += 1
                if q:
                    left = q[0][0] - now
                    wait = left if wait < 0 else min(wait, left)
            for fd, _ in poller.poll(wait):
                dst, q, delay, loss = flows[fd]
                due = time.monotonic() + delay
                for _ in range(BATCH):
                    try:
                        packet = os.read(fd, READ_BYTES)
                    except BlockingIOError:
                        break
                    except OSError:  # the device went away (its namespace deleted): stop serving it
                        poller.unregister(fd)
                        break
                    stats["packets"] += 1
                    stats["bytes"] += len(packet)
                    if loss and rng.random() < loss:
                        stats["lost"] += 1
                        continue
                    q.append((due, packet))
    except SystemExit:
        pass
    stats["late_ms_max"] = round(late_max * 1000, 3)
    return stats


def _die_with_parent() -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def mover_main(raw: str) -> None:
    cfg = json.loads(raw)
    parent = os.getppid()
    _die_with_parent()
    if os.getppid() != parent:  # the parent died before the prctl
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the Net that started it stops it (Ctrl-C reaches both)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print("ready", flush=True)
    stats = serve(cfg["lines"], cfg.get("seed"))
    print(json.dumps(stats), flush=True)


# --- the line's ceiling: `python -m bench.delayline` (root) ---------------------------------------

SINK = """
import json, socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
s.bind((sys.argv[1], 9098)); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); buf, n, t0 = bytearray(1 << 20), 0, time.monotonic()
while got := c.recv_into(buf):
    n += got
print(json.dumps({"bytes": n, "s": time.monotonic() - t0}), flush=True)
"""

SOURCE = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
s.connect((sys.argv[1], 9098)); block, end = bytes(1 << 20), time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    s.sendall(block)
s.close()
"""


def ceiling(seconds: float, rtt_ms: float, veth: bool) -> dict[str, object]:
    """One TCP stream for `seconds` between two namespaces over one unshaped link: a delay line
    holding rtt_ms / 2 each way, or (veth) a veth pair at the same MTU for comparison."""
    tag = str(os.getpid() % 100000)
    a_ns, b_ns, a_if, b_if = f"scda{tag}", f"scdb{tag}", f"dl{tag}a", f"dl{tag}b"
    made: list[str] = []
    fds: list[int] = []
    mover: Mover | None = None

    def sh(*args: str) -> None:
        subprocess.run(args, check=True, capture_output=True)

    try:
        for ns in (a_ns, b_ns):
            sh("ip", "netns", "add", ns)
            made.append(ns)
        if veth:
            sh("ip", "link", "add", a_if, "type", "veth", "peer", "name", b_if)
        else:
            fds += [open_tun(a_if), open_tun(b_if)]
        for ns, dev, ip in ((a_ns, a_if, "10.201.0.1"), (b_ns, b_if, "10.201.0.2")):
            sh("ip", "link", "set", dev, "netns", ns)
            sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "mtu", str(MTU), "up")
        if not veth:
            mover = Mover([Line(fds[0], fds[1], rtt_ms / 2000)])
        py = [sys.executable, "-I", "-c"]
        sink = subprocess.Popen(["ip", "netns", "exec", b_ns, *py, SINK, "10.201.0.2"],
                                stdout=subprocess.PIPE, text=True)
        assert sink.stdout is not None and sink.stdout.readline().strip() == "ready"
        cpu0 = os.times()
        subprocess.run(["ip", "netns", "exec", a_ns, *py, SOURCE, "10.201.0.2", str(seconds)], check=True,
                       timeout=seconds + 60)
        got = json.loads(sink.communicate(timeout=60)[0])
        dropped = 0  # packets the devices dropped on the way out (a full queue: the mover lagging)
        for ns, dev in ((a_ns, a_if), (b_ns, b_if)):
            out = subprocess.run(["ip", "-n", ns, "-s", "-j", "link", "show", "dev", dev], check=True,
                                 capture_output=True, text=True).stdout
            dropped += int(json.loads(out)[0]["stats64"]["tx"]["dropped"])
        if mover is not None:
            mover.close()
        cpu1 = os.times()
        return {"link": "veth" if veth else "delay line", "rtt_ms": rtt_ms, "mtu": MTU,
                "gbit_per_s": round(got["bytes"] * 8 / got["s"] / 1e9, 3), "bytes": got["bytes"],
                "seconds": round(got["s"], 2), "tx_dropped": dropped,
                "children_cpu_s": round(cpu1.children_user + cpu1.children_system
                                        - cpu0.children_user - cpu0.children_system, 2),
                "mover": mover.stats if mover else None, "mover_cpu_s": mover.cpu_s if mover else None,
                "cores": os.cpu_count(),
                "load_avg_1m": round(os.getloadavg()[0], 2)}
    finally:
        if mover is not None:
            mover.close()
        for fd in fds:
            os.close(fd)
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Throughput ceiling of the delay line (root)")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rtt-ms", type=float, default=0.0)
    parser.add_argument("--veth", action="store_true", help="a veth pair at the same MTU instead")
    args = parser.parse_args()
    if args.serve is not None:
        mover_main(args.serve)
        return
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    print(json.dumps(ceiling(args.seconds, args.rtt_ms, args.veth)))


if __name__ == "__main__":
    main()
