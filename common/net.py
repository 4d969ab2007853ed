"""Ports on this machine: free ones to hand out, and whether one is taken."""

from __future__ import annotations

import socket
from collections.abc import Collection


class PortInUse(RuntimeError):
    """Something already listens on the port asked for."""


def free_port(host: str = "127.0.0.1") -> int:
    """One port that was free a moment ago."""
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1", avoid: Collection[int] = ()) -> list[int]:
    """`count` distinct ports that were free a moment ago (all bound at once, so no two are the same), none of
    them in `avoid`: ports promised to a server not listening yet, which the kernel may hand out meanwhile."""
    sockets = [socket.socket() for _ in range(count + len(avoid))]
    try:
        for s in sockets:
            s.bind((host, 0))
        return [port for s in sockets if (port := s.getsockname()[1]) not in avoid][:count]
    finally:
        for s in sockets:
            s.close()


def check_port_free(host: str, port: int) -> None:
    """PortInUse if something listens on host:port. SO_REUSEADDR as servers set it, so TIME_WAIT is no hit."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise PortInUse(
                f"cannot listen on {host}:{port}: {exc.strerror or exc} (is another server running "
                "there? choose another --port, or 0 for any free one)"
            ) from None
