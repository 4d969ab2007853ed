"""The gateway's serving: the OpenAI-compatible HTTP app (gateway.routes) on uvicorn, on a listening socket of its
own. Its entry point (`pagedkv-gateway`: the options, which become a `GatewayConfig`) is gateway/main.py. The app is
imported only when it runs, so `--help` stays fast."""

from __future__ import annotations

import socket
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.state import GatewayConfig


def listening_socket(host: str, port: int) -> socket.socket:
    """The gateway's listening TCP socket, with TCP_NODELAY, which the connections it accepts inherit.

    asyncio sets TCP_NODELAY only on sockets whose proto is IPPROTO_TCP, and `socket.create_server`'s is 0: without
    it here, a response's second write (the body after the headers, every streamed chunk after the first) waited
    for the client's delayed ACK, 40 ms a request on a kept-alive connection (a third of the time to first token
    at 16 concurrent clients)."""
    listener = socket.create_server((host, port), reuse_port=False)
    listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return listener


def run_gateway(config: GatewayConfig, *, host: str, port: int, log_level: str = "info") -> None:
    """Serve until SIGINT or SIGTERM (requests in flight get a few seconds to finish)."""
    import structlog
    import uvicorn

    from gateway.routes import create_app

    app = create_app(config)
    listener = listening_socket(host, port)  # bound here, so port 0 can be reported
    bound_port = listener.getsockname()[1]
    structlog.get_logger("gateway").info(
        "gateway_listening", url=f"http://{host}:{bound_port}", model=app.state.gateway.model_name
    )
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            log_level="warning" if log_level == "info" else log_level,
            access_log=False,
            timeout_graceful_shutdown=5,
        )
    )
    server.run(sockets=[listener])


if __name__ == "__main__":  # pragma: no cover
    sys.exit("gateway.server is the gateway's serving: run it with `pagedkv-gateway` (python -m gateway.main)")
