"""The executor's serving loop: one process per device, serving gateways over ZeroMQ and driving the engine. Its
entry point (`pagedkv-executor`: the options, the model loaded, the pool registered) is executor/main.py.

One thread takes in every message waiting on the socket, runs one engine step if there is work and sends its
deltas; the bounds, the liveness beacon and fencing are in docs/architecture.md ("executor").
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from dataclasses import dataclass

import msgspec
import structlog
import zmq

from blockd.client import BlockdUnavailable, PoolFenced
from common.auth import Principal, Role, ServerAuth
from common.tokens import TOKEN_BYTES, unpack_tokens
from executor import protocol as ep
from executor.embedding import EmbedJob, start_embedding
from executor.engine import Engine, RequestRejected
from executor.liveness import LivenessBeacon
from executor.pooling import Embedder
from executor.sequence import Status

log = structlog.get_logger("executor")

DEFAULT_MAX_MESSAGE_BYTES = 8 * 1024 * 1024
DEFAULT_MAX_QUEUED_REQUESTS = 1024
PEER_TTL_S = 30.0  # a gateway not heard from for this long (while the loop reads) gets no more beacons


@dataclass(frozen=True)
class StepStall:
    """Fault injection, for tests only (--fault-stall-step): step number `step` is made `seconds` longer, in pure
    Python (holding the GIL but for the interpreter's switch interval, the worst case for the beacon)."""

    step: int
    seconds: float

    def spin(self) -> None:
        log.warning("fault_step_stalled", step=self.step, seconds=self.seconds)
        end = time.monotonic() + self.seconds
        while time.monotonic() < end:
            pass


@dataclass
class EmbedFault:
    """Fault injection, for tests only (--fault-embed-error): embedding pass number `passes` (counted from 1)
    raises, as an out-of-memory error would."""

    passes: int
    seen: int = 0

    def due(self) -> bool:
        self.seen += 1
        return self.seen == self.passes


class Fenced(RuntimeError):
    """blockd says the pool is another executor's now: using it would mix another executor's KV into this one's
    outputs, so every request ends with finish_reason "error" and the process exits."""


class ExecutorServer:
    def __init__(
        self,
        engine: Engine,
        bind: str,
        info: ep.Info,
        *,
        context: zmq.Context | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS,
        auth: ServerAuth | None = None,
        stall: StepStall | None = None,
        alive_interval_s: float = ep.ALIVE_INTERVAL_S,
        embedder: Embedder | None = None,
        embed_fault: EmbedFault | None = None,
    ) -> None:
        self.engine = engine
        self.stall = stall
        self.embed_fault = embed_fault
        self.embedder = embedder  # --task embed: Embed requests are served, Submit ones refused
        self.embeds: deque[tuple[bytes, EmbedJob]] = deque()  # (the gateway connection, its job), first come first
        self.auth = auth  # None: no keys (loopback or --insecure): every peer may do everything
        self.info = info
        self.max_queued_requests = max_queued_requests
        self.context = context or zmq.Context.instance()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)  # a peer that sends more is cut off unread
        self.socket.setsockopt(zmq.RCVHWM, max(1000, 4 * max_queued_requests))  # then a peer waits in TCP buffers
        if auth is not None:
            auth.secure(self.socket)
        self.socket.bind(bind)
        self.owners: dict[str, bytes] = {}  # request id -> the gateway connection it came from
        self.stopping = False
        self.last_blockd_contact = time.monotonic()
        # The socket is shared with the beacon thread: every use is under this lock (never held during a step).
        self.lock = threading.RLock()
        self.peers: dict[bytes, float] = {}  # gateway connection -> when it was last heard from
        self.step_started: float | None = None  # while a step runs
        self.beacon = LivenessBeacon(self._beat, self._alive, alive_interval_s)

    def serve(self) -> None:
        """Serve until stopped; raises Fenced (after ending every request) if the pool is not ours any more."""
        self.beacon.start()
        try:
            self._loop()
        except (Fenced, PoolFenced) as exc:
            reason = self.engine.pool.fenced or str(exc)
            log.error("pool_fenced", pool_id=self.engine.pool.pool_id, reason=reason)
            self.beacon.stop()
            with self.lock:
                self._fail_all()
            self.engine.pool.stop_heartbeats()
            self.socket.close(linger=0)
            raise Fenced(reason) from None
        self._shutdown()

    def _alive(self) -> ep.Alive:
        started = self.step_started
        return ep.Alive(
            pool_id=self.engine.pool.pool_id,
            steps=self.engine.steps,
            step_s=0.0 if started is None else round(time.monotonic() - started, 3),
        )

    def _beat(self, alive: ep.Alive) -> None:
        frame = ep.encode(alive)
        with self.lock:
            for identity in list(self.peers):
                self.socket.send_multipart([identity, frame], zmq.NOBLOCK)  # a ROUTER drops, never blocks

    def _forget_quiet_peers(self) -> None:
        """Called just after a read, so a live gateway (it asks for load several times a second) is fresh."""
        horizon = time.monotonic() - PEER_TTL_S
        for identity in [i for i, seen in self.peers.items() if seen < horizon]:
            del self.peers[identity]

    def _loop(self) -> None:
        engine = self.engine
        pool = engine.pool
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        heartbeat_s = max((pool.lease_timeout_s or 10.0) / 4, 0.2)
        while not self.stopping:
            if pool.fenced:
                raise Fenced(pool.fenced)
            busy = engine.has_work() or bool(self.embeds)
            with self.lock:
                events = dict(poller.poll(0 if busy else 50))
                if events:
                    self._drain()
                    self._forget_quiet_peers()
            if self.embeds:
                self._embed_pass()  # outside the lock: a forward pass, like a step
            if engine.has_work():
                self.step_started = time.monotonic()
                try:
                    deltas = engine.step()
                    if self.stall is not None and engine.steps == self.stall.step:
                        self.stall.spin()
                        self.stall = None
                except BlockdUnavailable:
                    continue  # the step stays pending; keep answering gateways meanwhile
                finally:
                    self.step_started = None
                self._send(deltas)
                self.last_blockd_contact = time.monotonic()
            elif pool.needs_resync or (
                not pool.heartbeats_running and time.monotonic() - self.last_blockd_contact > heartbeat_s
            ):
                try:
                    pool.heartbeat()  # re-registers first if blockd lost the pool
                    self.last_blockd_contact = time.monotonic()
                except BlockdUnavailable:
                    log.warning("blockd_unreachable", during="heartbeat")

    def _fail_all(self) -> None:
        """End every request in flight with finish_reason "error" (the pool is gone: nothing can continue)."""
        for request_id, request in list(self.engine.requests.items()):
            identity = self.owners.pop(request_id, None)
            if identity is None:
                continue
            for index in range(request.params.n):
                # (a beam search's sequences are its beams, no choices: each of its n choices ends here)
                choices = request.sequences if request.beam is None else []
                seq = next((q for q in choices if q.index == index), None)
                if seq is not None and seq.status is Status.FINISHED:
                    continue
                delta = ep.Delta(
                    request_id=request_id,
                    index=index,
                    token_ids=[],
                    finish_reason="error",
                    prompt_tokens=len(request.prompt),
                    completion_tokens=seq.num_generated if seq is not None else 0,
                    cached_tokens=request.num_cached_tokens,
                )
                self.socket.send_multipart([identity, ep.encode(delta)])
        self.engine.requests.clear()

    def _drain(self) -> None:
        while True:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(frames) != 2:
                continue  # not two frames: not one of ours
            identity, frame = frames[0].bytes, frames[1].bytes
            if self.auth is not None:
                principal = self.auth.principal(frames[1])
                if not self._allowed(identity, frame, principal):
                    continue
                if principal is not None and principal.role is Role.GATEWAY:
                    self.peers[identity] = time.monotonic()  # beacons go to gateways, not to operators' tools
            else:
                self.peers[identity] = time.monotonic()
            self._handle(identity, frame)

    def _allowed(self, identity: bytes, frame: bytes, principal: Principal | None) -> bool:
        """With keys: gateways may submit, abort and ask; operators may only ask (load, info). Anything else is
        answered `forbidden` and changes nothing."""
        if principal is not None and principal.role is Role.GATEWAY:
            return True
        try:
            message = ep.decode_inbound(frame)
        except (msgspec.DecodeError, msgspec.ValidationError):
            message = None
        if principal is not None and principal.role is Role.OPERATOR and type(message) in (ep.GetLoad, ep.GetInfo):
            return True
        who = f"{principal.role} key {principal.name!r}" if principal is not None else "an unknown key"
        self._reply(
            identity,
            ep.Rejected(
                request_id=getattr(message, "request_id", "") or _peek_request_id(frame),
                code="forbidden",
                message=f"{who} may not send {type(message).__name__ if message else 'this'} to an executor",
            ),
        )
        return False

    def _reply(self, identity: bytes, message: ep.Message) -> None:
        with self.lock:
            self.socket.send_multipart([identity, ep.encode(message)])

    def _handle(self, identity: bytes, frame: bytes) -> None:
        try:
            message = ep.decode_inbound(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            request_id = _peek_request_id(frame)
            self._reply(identity, ep.Rejected(request_id=request_id, code="invalid_request", message=str(exc)))
            return
        if message.v != ep.PROTOCOL_VERSION:
            self._reply(
                identity,
                ep.Rejected(
                    request_id=getattr(message, "request_id", ""),
                    code="unsupported_version",
                    message=f"protocol version {message.v} is not {ep.PROTOCOL_VERSION}",
                ),
            )
            return
        if type(message) is ep.Embed:
            self._queue_embedding(identity, message)
        elif type(message) is ep.Submit:
            try:
                if self.embedder is not None:
                    raise RequestRejected(ep.RejectCode.WRONG_TASK, "this executor serves embeddings (--task embed)")
                self._check_submit(message)
                self.engine.add_request(
                    message.request_id, unpack_tokens(message.prompt), message.params, message.cache_salt
                )
            except RequestRejected as exc:
                self._reply(identity, ep.Rejected(request_id=message.request_id, code=exc.code, message=exc.message))
                return
            self.owners[message.request_id] = identity
        elif type(message) is ep.Abort:
            owner = self.owners.get(message.request_id)
            if owner is None:
                return  # unknown or finished already: nothing to stop
            if owner != identity:
                self._reply(
                    identity,
                    ep.Rejected(
                        request_id=message.request_id,
                        code="not_owner",
                        message="a request can be aborted only on the connection that submitted it",
                    ),
                )
                return
            self._send(self.engine.abort(message.request_id, message.index))
        elif type(message) is ep.GetLoad:
            load = msgspec.structs.replace(self.engine.load(), queued_tokens=self._queued_tokens())
            if self.embeds:  # an embedding executor's load: the request in its pass, those queued behind it
                load = msgspec.structs.replace(load, running=1, waiting=len(self.embeds) - 1)
            self._reply(identity, load)
        elif type(message) is ep.GetInfo:
            self._reply(identity, self.info)

    def _queued_tokens(self) -> int:
        """What the requests here may still need computed, in tokens: an upper bound (a choice may stop before its
        max_tokens), which gateways turn into a wait at this executor's measured throughput (gateway/admission.py)."""
        total = 0
        for request in self.engine.requests.values():
            params, started = request.params, request.sequences
            total += max(0, len(request.prompt) - max((s.num_computed for s in started), default=0))
            total += sum(
                max(0, params.max_tokens - s.num_generated) for s in started if s.status is not Status.FINISHED
            )
            # Choices not forked yet; a beam search's beams not forked yet, as its width says.
            total += max(0, max(params.n, params.beam_width) - len(started)) * params.max_tokens
        return total

    def _queue_embedding(self, identity: bytes, message: ep.Embed) -> None:
        if len(self.embeds) >= self.max_queued_requests:
            rejected = ep.Rejected(
                request_id=message.request_id,
                code=ep.RejectCode.QUEUE_FULL,
                message=f"this executor holds {self.max_queued_requests} embedding requests already "
                "(--max-queued-requests): try again later or another executor",
            )
            self._reply(identity, rejected)
            return
        job = start_embedding(self.embedder, message, self.engine.config)
        if type(job) is ep.Rejected:
            self._reply(identity, job)
        else:
            self.embeds.append((identity, job))

    def _embed_pass(self) -> None:
        """One forward pass of the oldest embedding request; its answer once its last pass is done."""
        identity, job = self.embeds[0]
        try:
            if self.embed_fault is not None and self.embed_fault.due():
                raise RuntimeError("fault injection (--fault-embed-error): this embedding pass fails")
            answer = job.step()
        except Exception as exc:  # a failed pass (out of memory, a kernel's error) fails its request alone
            log.exception("embedding_failed", request_id=job.request_id)
            self.embeds.popleft()
            message = f"the embedding pass failed: {type(exc).__name__}: {exc}"
            self._reply(
                identity, ep.Rejected(request_id=job.request_id, code=ep.RejectCode.EMBEDDING_FAILED, message=message)
            )
            return
        if answer is not None:
            self.embeds.popleft()
            self._reply(identity, answer)

    def _check_submit(self, message: ep.Submit) -> None:
        """What can be refused before the prompt is unpacked: the queue is full, or the prompt is malformed or
        too long (its packed length says how many tokens it holds)."""
        if len(self.engine.requests) >= self.max_queued_requests:
            raise RequestRejected(
                "queue_full",
                f"this executor holds {self.max_queued_requests} requests already (--max-queued-requests): "
                "try again later or another executor",
            )
        if len(message.prompt) % TOKEN_BYTES:
            raise RequestRejected("invalid_request", "prompt must be packed uint32 token ids")
        n = len(message.prompt) // TOKEN_BYTES
        limit = self.engine.config.max_model_len
        if n >= limit:
            raise RequestRejected(
                "context_length_exceeded",
                f"the prompt has {n} tokens; this model's context is {limit} tokens, including at least one to "
                "generate",
            )

    def _send(self, deltas: list[ep.Delta | ep.Rejected]) -> None:
        """Deltas to the gateways that asked (and `Rejected` for a request refused after its submit: a
        structured-output grammar that did not compile)."""
        with self.lock:
            for delta in deltas:
                identity = self.owners.get(delta.request_id)
                if identity is not None:
                    self.socket.send_multipart([identity, ep.encode(delta)])
        # Only after the whole batch: a request's choices can all finish in one step.
        for request_id in {d.request_id for d in deltas if type(d) is ep.Rejected or d.finish_reason is not None}:
            if request_id not in self.engine.requests:
                self.owners.pop(request_id, None)

    def _shutdown(self) -> None:
        """Abort what is in flight (gateways hear why), return every block to blockd, unregister."""
        engine = self.engine
        for request_id in list(engine.requests):
            self._send(engine.abort(request_id))
        try:
            while engine.has_work():
                self._send(engine.step())  # aborts that waited for a pending step report here
            engine.pool.unregister()
        except BlockdUnavailable:
            log.warning("blockd_unreachable", during="shutdown")
        except PoolFenced as exc:
            log.warning("pool_fenced", during="shutdown", reason=exc.message)
        self.beacon.stop()
        engine.pool.stop_heartbeats()
        self.socket.close(linger=0)


def _peek_request_id(frame: bytes) -> str:
    try:
        value = msgspec.msgpack.decode(frame)
    except msgspec.DecodeError:
        return ""
    request_id = value.get("request_id") if isinstance(value, dict) else None
    return request_id if isinstance(request_id, str) else ""


if __name__ == "__main__":  # pragma: no cover
    sys.exit("executor.server is the executor's serving loop: run it with `pagedkv-executor` (python -m executor.main)")
