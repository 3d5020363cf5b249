"""The delay line's mover (bench/delayline.py) on datagram socket pairs instead of TUN devices (no
root needed: a read returns one packet either way), and the RTT arithmetic of bench/netns.py."""

from __future__ import annotations

import socket
import struct
import time

from bench.delayline import Line, Mover
from bench.netns import Link, every_pair_rtt, path_rtt_ms


def pairs() -> tuple[socket.socket, socket.socket, socket.socket, socket.socket]:
    """(what side a's kernel would send into, the mover's end a, its end b, what side b receives)"""
    a_out, a_line = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    b_line, b_in = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    return a_out, a_line, b_line, b_in


def test_packets_come_out_late_by_the_delay_and_in_order() -> None:
    a_out, a_line, b_line, b_in = pairs()
    mover = Mover([Line(a_line.fileno(), b_line.fileno(), delay_s=0.03)])
    try:
        for i in range(40):
            a_out.send(struct.pack("!Id", i, time.monotonic()) + bytes(1000))
        b_in.settimeout(10)
        got = [(b_in.recv(2048), time.monotonic()) for _ in range(40)]
    finally:
        mover.close()
    heads = [struct.unpack("!Id", packet[:12]) for packet, _ in got]
    assert [i for i, _ in heads] == list(range(40))
    assert all(arrived - sent >= 0.03 for (_, sent), (_, arrived) in zip(heads, got, strict=True))
    assert mover.stats is not None and mover.stats["packets"] == 40 and mover.stats["bytes"] == 40 * 1012
    assert mover.stats["write_errors"] == 0
    assert mover.proc.poll() is not None


def test_both_directions_and_loss() -> None:
    a_out, a_line, b_line, b_in = pairs()
    mover = Mover([Line(a_line.fileno(), b_line.fileno(), delay_s=0.0, loss=0.5)], seed=1)
    try:
        for i in range(200):
            b_in.send(struct.pack("!I", i))  # b → a this time
        time.sleep(0.5)
        a_out.setblocking(False)
        got = []
        while True:
            try:
                got.append(struct.unpack("!I", a_out.recv(64))[0])
            except BlockingIOError:
                break
    finally:
        mover.close()
    assert got == sorted(got) and 70 <= len(got) <= 130
    assert mover.stats is not None and mover.stats["lost"] == 200 - len(got)
    assert mover.stats["write_errors"] == 0


def test_round_trips_add_up_along_the_path() -> None:
    uplink, links = Link(None, rtt_ms=10), [Link(None, rtt_ms=30), Link(None, rtt_ms=50)]
    assert path_rtt_ms(uplink, links, 0, None) == 40  # worker 0 ↔ hub: link 0 + uplink
    assert path_rtt_ms(uplink, links, 0, 1) == 80  # worker ↔ worker: both links
    assert path_rtt_ms(uplink, links, 1, 1) == 0
    uplink, links = every_pair_rtt(Link(1e9), [Link(1e8, 1e8)] * 3, 100)
    assert uplink.down_bps == 1e9 and links[0].up_bps == 1e8
    ends = (None, 0, 1, 2)
    assert {path_rtt_ms(uplink, links, a, b) for a in ends for b in ends if a != b} == {100}
