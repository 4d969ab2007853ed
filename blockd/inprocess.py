"""blockd in the caller's process: a `BlockdClient` whose socket is a `BlockManager` right here.

The production `BlockdClient` with its ZeroMQ socket swapped for a loopback that decodes each request, applies
it and encodes the reply as the daemon does, so that `pagedkv bench throughput --blockd compare` can price
running blockd as its own service. It answers what a pool client sends and lookups; no leases expire and nothing
is persisted.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import zmq

from blockd import protocol as p
from blockd.client import BlockdClient
from blockd.errors import BlockdError, ErrorCode
from blockd.manager import BlockManager

ENDPOINT = "inprocess"


class _Loopback:
    """The part of a zmq DEALER socket `BlockdClient` uses; every frame sent is answered at once."""

    def __init__(self, answer: Any) -> None:
        self._answer = answer
        self._replies: deque[bytes] = deque()

    def send(self, frame: bytes, copy: bool = True) -> None:
        self._replies.append(self._answer(bytes(frame)))

    def poll(self, timeout: int | None = None, flags: int = zmq.POLLIN) -> int:
        return zmq.POLLIN if self._replies else 0

    def recv(self, copy: bool = True) -> bytes:
        return self._replies.popleft()

    def close(self, linger: int | None = None) -> None:
        self._replies.clear()


class InProcessBlockd(BlockdClient):
    """A `BlockdClient` answered by `manager` in this process (see the module docstring)."""

    def __init__(self, manager: BlockManager | None = None, *, timeout_s: float = 5.0) -> None:
        super().__init__(ENDPOINT, timeout_s=timeout_s)
        self.manager = manager or BlockManager()
        self._handlers: dict[type, Any] = {
            p.Step: lambda r: self.manager.step(
                r.pool_id, r.epoch, r.ops, r.tier_drops, r.shared_written, r.shared_drops
            ),
            p.Register: self.manager.register,
            p.Unregister: lambda r: p.ResetResult(self.manager.unregister(r.pool_id, r.epoch)),
            p.Heartbeat: self._heartbeat,
            p.Lookup: lambda r: self.manager.lookup(r.tokens, r.cache_salt),
        }

    def _connect(self) -> Any:
        if self._socket is None:
            self._socket = _Loopback(self.answer)  # type: ignore[assignment]
        return self._socket

    def answer(self, frame: bytes) -> bytes:
        """One request frame in, its reply frame out, as the daemon answers it."""
        request_id = 0
        try:
            request = p.decode_request(frame)
            request_id = request.id
            handler = self._handlers.get(type(request))
            if handler is None:
                op = type(request).__struct_config__.tag  # type: ignore[attr-defined]
                raise BlockdError(ErrorCode.UNKNOWN_OP, f"{op!r} is not answered by an in-process blockd")
            return p.encode_ok(request_id, handler(request))
        except p.RequestError as exc:
            return p.encode_error(exc.request_id, exc.code, exc.message)
        except BlockdError as exc:
            return p.encode_error(request_id, exc.code, exc.message)

    def _heartbeat(self, request: p.Heartbeat) -> p.HeartbeatResult:
        self.manager.heartbeat(request.pool_id, request.epoch, request.shared_written, request.shared_drops)
        return p.HeartbeatResult(self.manager.lease_timeout_s)
