"""Socket windows of relay connections (shared.relay): set only where they widen what the kernel's
autotuning reaches, capped by what it allows, and inherited by a peer server's connections."""

from __future__ import annotations

import socket

import pytest

from shared import relay
from shared.relay import KernelLimits, peer_listener, socket_buffers

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
