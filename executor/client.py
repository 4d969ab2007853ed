"""A blocking client of the executor protocol: one DEALER connection to one executor, for scripts, tests and
`pagedkv serve`'s readiness probe. (The gateway has its own, asyncio one: `gateway/executors.py`.)

Requests are pipelined: `submit` returns at once and the executor's deltas for every request arrive through
`receive`. `generate` is the blocking convenience for one request.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

import zmq

from common.auth import ClientCurve
from common.tokens import pack_tokens
from executor import protocol as ep
from executor.params import SamplingParams

DEFAULT_PARAMS = SamplingParams()  # frozen, so one shared default is safe


class ExecutorUnavailable(ConnectionError):
    """The executor did not answer in time."""


class ExecutorRejected(ValueError):
    def __init__(self, rejected: ep.Rejected) -> None:
        super().__init__(f"{rejected.code}: {rejected.message}")
        self.code = rejected.code
        self.message = rejected.message


class ExecutorClient:
    def __init__(
        self,
        endpoint: str,
        *,
        timeout_s: float = 10.0,
        context: zmq.Context | None = None,
        curve: ClientCurve | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.socket = (context or zmq.Context.instance()).socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        if curve is not None:  # an executor that serves CURVE (common.auth): a gateway's or operator's keys
            curve.apply(self.socket)
        self.socket.connect(endpoint)
        self._ids = itertools.count()
        self._backlog: list[ep.Outbound] = []  # messages that arrived while waiting for something else
        self.last_alive: ep.Alive | None = None  # the executor's latest liveness beacon

    def close(self) -> None:
        self.socket.close(linger=0)

    def __enter__(self) -> ExecutorClient:
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()

    def send_raw(self, frame: bytes) -> None:
        self.socket.send(frame)

    def submit(
        self,
        request_id: str,
        prompt: Sequence[int],
        params: SamplingParams = DEFAULT_PARAMS,
        cache_salt: str | None = None,
    ) -> None:
        self.socket.send(
            ep.encode(
                ep.Submit(request_id=request_id, prompt=pack_tokens(prompt), params=params, cache_salt=cache_salt)
            )
        )

    def abort(self, request_id: str, index: int | None = None) -> None:
        self.socket.send(ep.encode(ep.Abort(request_id=request_id, index=index)))

    def receive(self, timeout_s: float | None = None) -> ep.Outbound:
        """The next message from the executor (its liveness beacons aside: the latest is `last_alive`), or
        ExecutorUnavailable after the timeout."""
        if self._backlog:
            return self._backlog.pop(0)
        wait = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + wait
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self.socket.poll(int(remaining * 1000) + 1):
                raise ExecutorUnavailable(f"executor at {self.endpoint} sent nothing within {wait:g} s")
            message = ep.decode_outbound(self.socket.recv())
            if type(message) is ep.Alive:
                self.last_alive = message
                continue
            return message

    def _query(self, message: ep.Message, reply_type: type) -> Any:
        self.socket.send(ep.encode(message))
        deadline = time.monotonic() + self.timeout_s
        held: list[ep.Outbound] = []
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self.socket.poll(int(remaining * 1000) + 1):
                    raise ExecutorUnavailable(f"executor at {self.endpoint} did not answer within {self.timeout_s:g} s")
                reply = ep.decode_outbound(self.socket.recv())
                if type(reply) is reply_type:
                    return reply
                if type(reply) is ep.Alive:
                    self.last_alive = reply
                    continue
                held.append(reply)  # a delta of a request in flight: keep it for receive()
        finally:
            self._backlog.extend(held)

    def load(self) -> ep.LoadReport:
        return self._query(ep.GetLoad(), ep.LoadReport)

    def info(self) -> ep.Info:
        return self._query(ep.GetInfo(), ep.Info)

    def generate(
        self,
        prompt: Sequence[int],
        params: SamplingParams = DEFAULT_PARAMS,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> list[list[ep.Delta]]:
        """Submit one request and wait for all its choices to finish; the deltas of each choice, in order."""
        request_id = request_id or f"generate-{next(self._ids)}-{time.monotonic_ns()}"
        self.submit(request_id, prompt, params, cache_salt)
        choices: list[list[ep.Delta]] = [[] for _ in range(params.n)]
        finished = 0
        while finished < params.n:
            message = self.receive()
            if getattr(message, "request_id", None) != request_id:
                continue
            if type(message) is ep.Rejected:
                raise ExecutorRejected(message)
            choices[message.index].append(message)
            finished += message.finish_reason is not None
        return choices


def tokens_of(deltas: list[ep.Delta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]
