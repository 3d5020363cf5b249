"""A loopback TCP port for a child process to bind, chosen so nothing else takes it meanwhile.

`bind(0)` hands out a port from the kernel's ephemeral range and forgets it once the socket is
closed; the same range is where every outgoing connection (an httpx request, a Redis client
reconnecting) takes its source port. So between "pick a port" and "the child binds it" any
connection on the machine may take it, and the child dies with EADDRINUSE (seen in CI: a rollout
worker of the chaos soak). Ports below the ephemeral range are never assigned implicitly, only
to explicit binds; this process remembers what it handed out, so two picks never collide either.
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

_EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST_PORT = 10000  # below are well-known and registered services' habits
_handed_out: set[int] = set()
_lock = threading.Lock()


def _ephemeral_low() -> int:
    try:
        return int(_EPHEMERAL_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; elsewhere the bind(0) fallback below is used


def _bindable(port: int, host: str) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port on `host` that is free now and that neither the kernel nor this process will give to
    anyone else; the caller hands it to the process that binds it."""
    high = _ephemeral_low() - 1
    with _lock:
        if high - _LOWEST_PORT > 1000:
            for _ in range(200):
                port = random.randint(_LOWEST_PORT, high)
                if port not in _handed_out and _bindable(port, host):
                    _handed_out.add(port)
                    return port
        with socket.socket() as sock:  # no room below the ephemeral range: the kernel's choice
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        _handed_out.add(port)
        return port
