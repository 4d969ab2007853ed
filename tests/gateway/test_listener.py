"""The gateway's listening socket: the connections it accepts write without waiting for the client's ACK."""

from __future__ import annotations

import socket

from gateway.server import listening_socket


def test_accepted_connections_have_tcp_nodelay() -> None:
    """Without it a kept-alive client's every request waited 40 ms (Nagle's algorithm against delayed ACKs)."""
    with listening_socket("127.0.0.1", 0) as listener:
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)):
            accepted, _ = listener.accept()
            with accepted:
                assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
