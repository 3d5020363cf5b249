"""free_port: a port no outgoing connection can take before the child binds it."""

from __future__ import annotations

import socket

from shared import ports
from shared.ports import free_port


def test_ports_come_from_below_the_ephemeral_range_and_never_twice() -> None:
    low = ports._ephemeral_low()
    picked = [free_port() for _ in range(200)]
    assert len(set(picked)) == len(picked)
    if low - 1 - ports._LOWEST_PORT > 1000:  # Linux defaults: 32768
        assert all(ports._LOWEST_PORT <= port < low for port in picked)


def test_a_port_is_bindable_and_a_bound_one_is_not_handed_out() -> None:
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
        sock.listen()
        assert not ports._bindable(port, "127.0.0.1")
    assert ports._bindable(port, "127.0.0.1")


def test_outgoing_connections_never_take_a_handed_out_port() -> None:
    """The CI failure: a client's source port was the port a worker was about to bind."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(64)
        clients = []
        try:
            reserved = {free_port() for _ in range(50)}
            for _ in range(50):
                client = socket.create_connection(server.getsockname())
                clients.append(client)
                assert client.getsockname()[1] not in reserved
        finally:
            for client in clients:
                client.close()
