"""Socket windows of relay connections (shared.relay): set only where they widen what the kernel's
autotuning reaches, capped by what it allows, and inherited by a peer server's connections, as is
the peer listener's congestion control."""

from __future__ import annotations

import socket

import pytest

from shared import relay
from shared.relay import PEER_CONGESTION, KernelLimits, apply_congestion, peer_listener, socket_buffers

MB = 1 << 20


def test_buffers_are_set_only_where_they_widen_autotuning() -> None:
    defaults = KernelLimits(wmem_max=212992, rmem_max=212992, tcp_wmem_max=4 * MB, tcp_rmem_max=6 * MB)
    assert socket_buffers(32 * MB, defaults) == {}  # 208 KiB would shrink the window: leave it alone
    raised = KernelLimits(wmem_max=64 * MB, rmem_max=16 * MB, tcp_wmem_max=4 * MB, tcp_rmem_max=6 * MB)
    assert socket_buffers(32 * MB, raised) == {socket.SO_SNDBUF: 32 * MB, socket.SO_RCVBUF: 16 * MB}
    autotuned = KernelLimits(wmem_max=64 * MB, rmem_max=64 * MB, tcp_wmem_max=4 * MB, tcp_rmem_max=32 * MB)
    assert socket_buffers(32 * MB, autotuned) == {socket.SO_SNDBUF: 32 * MB}  # receive side reaches 32 MB
    assert socket_buffers(0, raised) == {}


def test_a_peer_listener_hands_its_buffers_to_the_connections_it_accepts(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    real = relay.kernel_limits()
    # Autotuning "stops at 0" here, so the option is set (as far as the kernel allows: its maximum).
    monkeypatch.setattr(relay, "kernel_limits", lambda: KernelLimits(real.wmem_max, real.rmem_max, 0, 0))
    want = 1 * MB
    chosen = socket_buffers(want)
    assert chosen == {socket.SO_SNDBUF: min(want, real.wmem_max), socket.SO_RCVBUF: min(want, real.rmem_max)}
    listener = peer_listener("127.0.0.1", 0, want)
    with listener, socket.create_connection(listener.getsockname(), timeout=5):
        listener.setblocking(True)
        accepted, _ = listener.accept()
        with accepted:
            for option, size in chosen.items():  # the kernel reports twice what was set
                assert accepted.getsockopt(socket.SOL_SOCKET, option) >= size


def _available_congestion() -> list[str]:
    try:
        with open("/proc/sys/net/ipv4/tcp_available_congestion_control") as file:
            return file.read().split()
    except OSError:
        return []


def _congestion(sock: socket.socket) -> str:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).split(b"\0")[0].decode()


@pytest.mark.skipif(PEER_CONGESTION not in _available_congestion(),
                    reason=f"the kernel has no {PEER_CONGESTION} congestion control")
def test_a_peer_listener_hands_its_congestion_control_to_the_connections_it_accepts() -> None:
    listener = peer_listener("127.0.0.1", 0)
    with listener, socket.create_connection(listener.getsockname(), timeout=5):
        listener.setblocking(True)
        accepted, _ = listener.accept()  # the sending side of a hop
        with accepted:
            assert _congestion(accepted) == PEER_CONGESTION


def test_a_congestion_control_the_kernel_lacks_leaves_the_default(caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as sock:
        before = _congestion(sock)
        assert not apply_congestion(sock, "no-such-cc")
        assert _congestion(sock) == before
        assert "keep the host's congestion control" in caplog.text
        assert not apply_congestion(sock, "")  # "": the host's default, nothing set
