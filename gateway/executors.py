"""The gateway's connections to its executors: one `ExecutorLink` each (a DEALER socket and the task that reads
it), with liveness and load. An executor is lost only when it is not alive (its connection drops, or nothing at
all came from it for the lease), never because a step is long: docs/architecture.md ("Executor health and
failover").
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec
import structlog
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from common.auth import ClientCurve
from common.tokens import pack_tokens
from executor import protocol as ep
from executor.params import SamplingParams

log = structlog.get_logger("gateway")

GAPS_KEPT = 64  # the recent gaps between an executor's messages that stretch its lease
LEASE_STRETCH = 4.0  # the lease covers this many of the longest recent gap
LEASE_MAX_FACTOR = 2.0  # and stays within this many times --executor-timeout
MEASURE_BUSY_S = 0.25  # seconds of steps a throughput measure spans at least


@dataclass(frozen=True)
class ExecutorLost:
    """Put on a request's stream when its executor went away: its deltas will never come."""

    endpoint: str
    reason: str
    request_id: str = ""  # whose stream it was put on (streams may share a queue: gateway.generation)


StreamItem = ep.Delta | ep.Rejected | ep.Embedded | ExecutorLost


class ExecutorUnavailable(ConnectionError):
    pass


@dataclass
class _Work:
    """What a request in flight still asks of its executor, in tokens: its prompt until the first delta, and
    what each choice may still generate."""

    prompt: int
    left: list[int]  # per choice

    def remaining(self) -> int:
        return self.prompt + sum(self.left)


class ExecutorLink:
    def __init__(
        self,
        endpoint: str,
        context: zmq.asyncio.Context,
        *,
        timeout_s: float = 5.0,
        poll_interval_s: float | None = None,
        compatible: Callable[[ep.Info], str | None] = lambda info: None,
        curve: ClientCurve | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.curve = curve  # the gateway's keys, for executors that serve CURVE
        self.compatible = compatible  # why this gateway cannot use an executor (another model), or None
        self.refused: str | None = None
        self.timeout_s = timeout_s
        self.poll_interval_s = poll_interval_s or min(0.5, timeout_s / 4)
        self._context = context
        self.info: ep.Info | None = None
        self.load: ep.LoadReport | None = None
        self.alive: ep.Alive | None = None  # the executor's last beacon (its step count, the step running)
        self.healthy = False
        self.connected = False
        self.last_heard = 0.0
        self._gaps: deque[float] = deque(maxlen=GAPS_KEPT)
        self.work: dict[str, _Work] = {}  # by request id, while in flight
        # A load report counts the work of every gateway as it was when it was asked for; this gateway's own part
        # of it is what `work` held then (replies come in the order of the asks), the rest is other gateways'.
        # (this gateway's queued tokens, its requests in flight) at each load ask, matched to the reports in order
        self._own_at_ask: deque[tuple[int, int]] = deque(maxlen=64)
        self._others_queued = 0
        self._in_flight_at_report = 0  # this gateway's requests in flight when the last report was asked for
        self.tokens_per_s: float | None = None  # measured: tokens the executor computes per second of steps
        self._mark: ep.LoadReport | None = None  # the load report the throughput is measured from
        self._long_step_logged: int | None = None  # the step count of the long step logged last
        self.streams: dict[str, asyncio.Queue[StreamItem]] = {}
        self._socket: zmq.asyncio.Socket | None = None  # polled by the task
        self._sync: zmq.Socket | None = None  # the same socket, for non-blocking sends and reads
        self._monitor: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------------------------------ state

    @property
    def pool_id(self) -> str | None:
        return self.info.pool_id if self.info else None

    @property
    def in_flight(self) -> int:
        return len(self.streams)

    def lease_s(self) -> float:
        """How long this executor may send nothing before it is taken for dead."""
        longest = max(self._gaps, default=0.0)
        return min(max(self.timeout_s, LEASE_STRETCH * longest), LEASE_MAX_FACTOR * self.timeout_s)

    def queued_tokens(self) -> int:
        """Tokens the requests in flight here may still need computed (prompts not started, choices' max_tokens
        left): an upper bound, as a choice may stop early. What the executor reports for all its gateways' requests,
        and this gateway's own, counted up to date: the other gateways' part of the last report, plus its own now
        (a report that still counts a request of this gateway's that has since finished must not shut the door)."""
        return self._others_queued + self._own_queued()

    def _own_queued(self) -> int:
        return sum(w.remaining() for w in self.work.values())

    def drain_s(self) -> float | None:
        """Seconds of work queued here at the measured throughput; None until a throughput is measured."""
        if not self.tokens_per_s:
            return None
        return self.queued_tokens() / self.tokens_per_s

    def queue_depth(self) -> int:
        """Requests this executor has to work through: the other gateways' part of its last report, plus this
        gateway's own counted now (a report taken while one of ours ran would otherwise make an idle executor look
        busy until the next one, and a run of requests in between all go elsewhere)."""
        reported = self.load.running + self.load.waiting if self.load else 0
        return max(0, reported - self._in_flight_at_report) + self.in_flight

    def describe(self) -> dict[str, object]:
        return {
            "endpoint": self.endpoint,
            "healthy": self.healthy,
            "refused": self.refused,
            "pool_id": self.pool_id,
            "in_flight": self.in_flight,
            "running": self.load.running if self.load else None,
            "waiting": self.load.waiting if self.load else None,
            "free_blocks": self.load.free_blocks if self.load else None,
            "num_blocks": self.load.num_blocks if self.load else None,
            "blockd_reachable": self.load.blockd_reachable if self.load else None,
            "step_s": self.alive.step_s if self.alive else None,
            "lease_s": round(self.lease_s(), 2),
            "queued_tokens": self.queued_tokens(),
            "tokens_per_s": round(self.tokens_per_s, 1) if self.tokens_per_s else None,
        }

    # ------------------------------------------------------------------------------------------ requests

    def submit(
        self,
        request_id: str,
        prompt: Sequence[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        queue: asyncio.Queue[StreamItem] | None = None,
    ) -> asyncio.Queue[StreamItem]:
        """Send a request; its deltas arrive on the returned queue (`queue`, if given: several requests may share
        one, their items told apart by request id). Raises ExecutorUnavailable."""
        message = ep.Submit(request_id=request_id, prompt=pack_tokens(prompt), params=params, cache_salt=cache_salt)
        queue = self.request(request_id, message, queue)
        self.work[request_id] = _Work(len(prompt), [params.max_tokens] * params.n)  # what the door weighs
        return queue

    def request(
        self, request_id: str, message: ep.Submit | ep.Embed, queue: asyncio.Queue[StreamItem] | None = None
    ) -> asyncio.Queue[StreamItem]:
        """Send a request message; what answers it arrives on the returned queue. Raises ExecutorUnavailable."""
        if not self.healthy or self._sync is None:
            raise ExecutorUnavailable(f"executor {self.endpoint} is out of rotation")
        queue = asyncio.Queue() if queue is None else queue
        self.streams[request_id] = queue
        frame = ep.encode(message)
        try:
            self._sync.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            del self.streams[request_id]
            raise ExecutorUnavailable(f"executor {self.endpoint} is not connected") from None
        return queue

    def abort(self, request_id: str, index: int | None = None) -> None:
        if index is None:
            self.streams.pop(request_id, None)
            self.work.pop(request_id, None)
        if self._sync is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._sync.send(ep.encode(ep.Abort(request_id=request_id, index=index)), zmq.NOBLOCK)

    def release(self, request_id: str) -> None:
        """The request is over (every choice finished): stop routing its deltas."""
        self.streams.pop(request_id, None)
        self.work.pop(request_id, None)

    # ------------------------------------------------------------------------------------------ the task

    def start(self) -> None:
        self._open()
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"executor-link {self.endpoint}")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._close_sockets()

    def _open(self) -> None:
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.IMMEDIATE, 1)  # never queue for an executor that is not connected
        socket.setsockopt(zmq.RECONNECT_IVL, 100)
        socket.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        if self.curve is not None:
            self.curve.apply(socket)
        self._monitor = socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        socket.connect(self.endpoint)
        self._socket = socket
        self._sync = zmq.Socket.shadow(socket.underlying)

    def _close_sockets(self) -> None:
        if self._socket is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._socket.disable_monitor()
            self._socket.close()  # LINGER: 0, or a second for the aborts `_lose` sent
            self._socket = None
            self._sync = None
        if self._monitor is not None:
            self._monitor.close(linger=0)
            self._monitor = None

    async def _run(self) -> None:
        next_poll = 0.0
        while True:
            now = time.monotonic()
            if now >= next_poll:
                self._ask_for_load()
                next_poll = now + self.poll_interval_s
            self._drain()  # what already came in counts before silence is judged (the loop may have been busy)
            lease = self.lease_s()
            if self.healthy and time.monotonic() - self.last_heard > lease:
                self._lose(f"silent for {lease:g} s")
                self._close_sockets()
                self._open()
            assert self._socket is not None and self._monitor is not None
            poller = zmq.asyncio.Poller()
            poller.register(self._socket, zmq.POLLIN)
            poller.register(self._monitor, zmq.POLLIN)
            events = dict(await poller.poll(max(1, int((next_poll - time.monotonic()) * 1000))))
            if self._monitor in events:
                self._on_monitor_event(await self._monitor.recv_multipart())
            if self._socket in events:
                self._drain()

    def _drain(self) -> None:
        """Handle what is waiting on the socket (up to 1000 frames), then look at the clock again."""
        assert self._sync is not None
        for _ in range(1000):
            try:
                frame = self._sync.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            self._on_frame(frame)

    def _ask_for_load(self) -> None:
        assert self._sync is not None
        messages = [ep.GetLoad()] if self.info is not None else [ep.GetInfo(), ep.GetLoad()]
        for message in messages:
            with contextlib.suppress(zmq.Again):
                self._sync.send(ep.encode(message), zmq.NOBLOCK)
                if type(message) is ep.GetLoad:
                    self._own_at_ask.append((self._own_queued(), self.in_flight))

    def _on_monitor_event(self, frames: list[bytes]) -> None:
        event = parse_monitor_message(frames)["event"]
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.connected = True
            self._ask_for_load()
        elif event == zmq.EVENT_DISCONNECTED:
            self.connected = False
            if self.healthy:
                self._lose("connection closed")

    def _on_frame(self, frame: bytes) -> None:
        try:
            message = ep.decode_outbound(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("bad_frame_from_executor", executor=self.endpoint, error=str(exc))
            return
        now = time.monotonic()
        if self.healthy:
            self._gaps.append(now - self.last_heard)
        self.last_heard = now
        kind = type(message)
        if kind is ep.Alive:
            self._on_alive(message)
        elif kind is ep.Delta or kind is ep.Rejected or kind is ep.Embedded:
            stream = self.streams.get(message.request_id)
            if stream is not None:
                stream.put_nowait(message)
            if kind is ep.Delta:
                self._count_work(message)
        elif kind is ep.LoadReport:
            self._measure(message)
            self.load = message
            own_then, in_flight_then = self._own_at_ask.popleft() if self._own_at_ask else (0, 0)
            self._others_queued = max(0, message.queued_tokens - own_then)
            self._in_flight_at_report = in_flight_then
        elif kind is ep.Info:
            if self.info is not None and self.info.pool_id != message.pool_id:
                log.info("executor_replaced", executor=self.endpoint, pool_id=message.pool_id)
            problem = self.compatible(message)
            if problem and problem != self.refused:
                log.error("executor_refused", executor=self.endpoint, pool_id=message.pool_id, reason=problem)
            self.refused = problem
            self.info = None if problem else message
        if not self.healthy and self.info is not None:
            self.healthy = True
            self._gaps.clear()
            log.info("executor_in_rotation", executor=self.endpoint, pool_id=self.info.pool_id)

    def _count_work(self, delta: ep.Delta) -> None:
        work = self.work.get(delta.request_id)
        if work is None or not 0 <= delta.index < len(work.left):
            return
        work.prompt = 0
        left = work.left[delta.index] - len(delta.token_ids)
        work.left[delta.index] = 0 if delta.finish_reason is not None else max(0, left)

    def _measure(self, now: ep.LoadReport) -> None:
        """The executor's throughput, from the counters of its load reports (tokens per busy second) over at
        least MEASURE_BUSY_S of steps, smoothed; a restarted executor's counters start again, and so does this."""
        mark = self._mark
        if mark is None or now.busy_s < mark.busy_s or now.pool_id != mark.pool_id:
            self._mark = now
            # A first estimate at once from the counters since the executor started, if it has worked.
            self.tokens_per_s = now.computed_tokens / now.busy_s if now.busy_s > 0 and now.computed_tokens else None
            return
        busy, tokens = now.busy_s - mark.busy_s, now.computed_tokens - mark.computed_tokens
        if busy < MEASURE_BUSY_S:
            return
        self._mark = now
        if tokens > 0:
            rate = tokens / busy
            self.tokens_per_s = rate if self.tokens_per_s is None else 0.7 * self.tokens_per_s + 0.3 * rate

    def _on_alive(self, alive: ep.Alive) -> None:
        """Progress, apart from liveness: a step that runs past the lease is logged once, and changes nothing."""
        self.alive = alive
        if alive.step_s > self.timeout_s and self._long_step_logged != alive.steps:
            self._long_step_logged = alive.steps
            log.warning(
                "executor_step_long",
                executor=self.endpoint,
                pool_id=alive.pool_id,
                step_s=alive.step_s,
                in_flight=len(self.streams),
                note="alive: kept in rotation with its streams",
            )

    def _lose(self, reason: str) -> None:
        """Out of rotation: every request in flight here hears that its deltas will not come, and is aborted at
        the executor (which may only be stopped, not dead), so a generation retried elsewhere does not also
        keep running here. The aborts go on the connection that submitted the requests (the executor takes an
        abort only from there), which lingers a second to deliver them once the socket is replaced."""
        if self._sync is not None:
            for request_id in self.streams:
                with contextlib.suppress(zmq.ZMQError):
                    self._sync.send(ep.encode(ep.Abort(request_id=request_id)), zmq.NOBLOCK)
            if self.streams and self._socket is not None:
                self._socket.setsockopt(zmq.LINGER, 1000)
        self.healthy = False
        self.alive = None
        self.info = None  # asked for again: a restarted executor may have a new pool or model
        self.load = None
        log.warning("executor_out_of_rotation", executor=self.endpoint, reason=reason, in_flight=len(self.streams))
        streams, self.streams = self.streams, {}
        self.work = {}
        self._own_at_ask.clear()
        self._others_queued = 0
        self._in_flight_at_report = 0
        for request_id, stream in streams.items():
            stream.put_nowait(ExecutorLost(self.endpoint, reason, request_id))
