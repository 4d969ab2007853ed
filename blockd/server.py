"""The blockd daemon: a ZeroMQ ROUTER answering block-manager requests, one at a time, on one thread. Its
entry point (`blockd`: the options, the daemon assembled from them) is blockd/main.py.

One thread owns all state, so no request ever waits on a lock; every input is bounded before work is done on it
(docs/architecture.md, "Protocol" and "The daemon").
"""

from __future__ import annotations

import sys
import time
from typing import Any

import structlog
import zmq

from blockd import protocol as p
from blockd.errors import BlockdError, ErrorCode
from blockd.hashing import epoch_fingerprint
from blockd.kv_events import KvEventPublisher
from blockd.manager import BlockManager, totals
from blockd.metrics import BlockdMetrics
from blockd.persistence import NoPersistence, RedisPersistence
from common import __version__
from common.auth import Principal, Role, ServerAuth

_TICK_S = 0.02


#: What each role may ask blockd (with keys; without them every peer may ask everything).
OPERATOR_REQUESTS = (p.Stats, p.Pools, p.GetSequence, p.Check, p.ResetPrefixCache)
EXECUTOR_REQUESTS = (p.Register, p.Heartbeat, p.Step, p.Unregister, p.ResetPrefixCache)
GATEWAY_REQUESTS = (p.Lookup,)


def authorize(principal: Principal | None, request: p.Request) -> None:
    """BlockdError(forbidden) unless the sender's role allows this request (executors: on their own pool only)."""
    kind = type(request)
    if principal is None:
        allowed, why = False, "this key is not known"
    elif principal.role is Role.OPERATOR:
        allowed, why = kind in OPERATOR_REQUESTS, "an operator key may not"
    elif principal.role is Role.GATEWAY:
        allowed, why = kind in GATEWAY_REQUESTS, "a gateway key may only look up prefixes; it may not"
    else:
        pool_id: str | None = getattr(request, "pool_id", None)
        allowed = kind in EXECUTOR_REQUESTS and pool_id is not None and principal.may_act_on(pool_id)
        if kind is p.ResetPrefixCache and getattr(request, "epoch", None) is None:
            allowed = False  # an executor resets only its own pool, proven by its epoch
        why = (
            f"executor key {principal.name!r} may act only on pool {principal.pool!r}; it may not"
            if principal.pool is not None and kind in EXECUTOR_REQUESTS
            else f"executor key {principal.name!r} may not"
        )
    if not allowed:
        tag = kind.__struct_config__.tag  # type: ignore[attr-defined]
        target = getattr(request, "pool_id", None)
        raise BlockdError(ErrorCode.FORBIDDEN, f"{why} {tag}" + (f" pool {target!r}" if target else ""))


class BlockdServer:
    """Decodes requests, applies them to the BlockManager, encodes replies; ticks leases and persistence."""

    def __init__(
        self,
        manager: BlockManager,
        persistence: RedisPersistence | NoPersistence,
        *,
        metrics: BlockdMetrics | None = None,
        max_message_bytes: int = p.DEFAULT_MAX_MESSAGE_BYTES,
        log: Any = None,
        kv_events: KvEventPublisher | None = None,
        auth: ServerAuth | None = None,
    ) -> None:
        self.manager = manager
        self.kv_events = kv_events
        self.auth = auth  # None: no keys (loopback or --insecure): every peer may do everything
        self.persistence = persistence
        self.metrics = metrics
        self.max_message_bytes = max_message_bytes
        self.log = log or structlog.get_logger(service="blockd")
        self.started = time.monotonic()
        self.running = True
        self._next_lease_check = 0.0
        self._next_metrics = 0.0
        self._handlers = {
            p.Step: self._step,
            p.Heartbeat: self._heartbeat,
            p.Register: self._register,
            p.Unregister: self._unregister,
            p.Lookup: self._lookup,
            p.Stats: self._stats,
            p.Pools: self._pools,
            p.GetSequence: self._sequence,
            p.Check: self._check,
            p.ResetPrefixCache: self._reset,
        }

    # ------------------------------------------------------------------------------ request handling

    def handle(self, frame: bytes, principal: Principal | None = None) -> bytes:
        """Answer one request frame (from `principal`, when keys are in use). Never raises: every failure becomes
        an error reply."""
        started = time.perf_counter()
        request_id = 0
        op = "invalid"
        try:
            request = p.decode_request(frame, self.max_message_bytes)
            request_id = request.id
            op = type(request).__struct_config__.tag  # type: ignore[attr-defined]
            if self.auth is not None:
                authorize(principal, request)
            reply = p.encode_ok(request_id, self._handlers[type(request)](request))
            outcome = "ok"
        except p.RequestError as exc:
            reply, outcome = p.encode_error(exc.request_id, exc.code, exc.message), exc.code
        except BlockdError as exc:
            reply, outcome = p.encode_error(request_id, exc.code, exc.message), exc.code
        except Exception as exc:  # a bug must not take the daemon down with every pool's state
            self.log.exception("request failed", op=op)
            reply, outcome = p.encode_error(request_id, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"), "internal"
        if self.metrics is not None:
            self.metrics.requests.labels(op, outcome).inc()
            self.metrics.request_seconds.labels(op).observe(time.perf_counter() - started)
        return reply

    def _step(self, req: p.Step) -> p.StepResult:
        return self.manager.step(req.pool_id, req.epoch, req.ops, req.tier_drops, req.shared_written, req.shared_drops)

    def _heartbeat(self, req: p.Heartbeat) -> p.HeartbeatResult:
        self.manager.heartbeat(req.pool_id, req.epoch, req.shared_written, req.shared_drops)
        return p.HeartbeatResult(self.manager.lease_timeout_s)

    def _register(self, req: p.Register) -> p.RegisterResult:
        try:
            result = self.manager.register(req)
        except BlockdError as exc:
            if exc.code == ErrorCode.POOL_HELD:
                self.log.warning("register refused: pool held", pool=req.pool_id, reason=exc.message)
            raise
        self.log.info(
            "pool registered",
            pool=req.pool_id,
            epoch=epoch_fingerprint(req.epoch),
            blocks=req.num_blocks,
            block_size=req.block_size,
            model=req.model_id,
            resynced=result.resynced,
            sequences=result.restored_sequences,
            index_entries=result.restored_index_entries,
            dropped_entries=result.dropped_index_entries,
        )
        return result

    def _unregister(self, req: p.Unregister) -> p.ResetResult:
        dropped = self.manager.unregister(req.pool_id, req.epoch)
        self.log.info("pool unregistered", pool=req.pool_id, index_entries_dropped=dropped)
        return p.ResetResult(dropped)

    def _lookup(self, req: p.Lookup) -> p.LookupResult:
        return self.manager.lookup(req.tokens, req.cache_salt)

    def _stats(self, req: p.Stats) -> p.StatsResult:
        pool_stats = self.manager.pool_stats(req.pool_id)
        return p.StatsResult(
            version=__version__,
            uptime_s=round(time.monotonic() - self.started, 3),
            pools=pool_stats,
            totals=totals(pool_stats),
            persistence=self.persistence.stats(time.monotonic()),
            dormant_pools=sorted(self.manager.dormant),
        )

    def _pools(self, req: p.Pools) -> p.PoolsResult:
        return p.PoolsResult(self.manager.pool_infos(), self.manager.lease_timeout_s)

    def _sequence(self, req: p.GetSequence) -> p.SequenceInfo:
        return self.manager.sequence(req.seq_id, req.pool_id)

    def _check(self, req: p.Check) -> p.CheckResult:
        return p.CheckResult(self.manager.check())

    def _reset(self, req: p.ResetPrefixCache) -> p.ResetResult:
        dropped = self.manager.reset_prefix_cache(req.pool_id, req.epoch)
        self.log.info("prefix cache reset", pool=req.pool_id, entries=dropped)
        return p.ResetResult(dropped)

    # ------------------------------------------------------------------------------ housekeeping

    def tick(self, now: float) -> None:
        if now >= self._next_lease_check:
            self._next_lease_check = now + min(1.0, self.manager.lease_timeout_s / 4)
            for pool_id in self.manager.expire():
                self.log.warning("lease expired: pool dropped", pool=pool_id)
                if self.metrics is not None:
                    self.metrics.expired_pools.inc()
        self.persistence.tick(self.manager, now)
        if self.kv_events is not None:
            self.kv_events.flush()
        if self.metrics is not None and now >= self._next_metrics:
            self._next_metrics = now + 1.0
            self.metrics.update(self.manager.pools, self.persistence.stats(now))

    def serve(self, socket: zmq.Socket) -> None:
        """Answer requests until stop() is called."""
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        while self.running:
            if poller.poll(int(_TICK_S * 1000)):
                # Drain what is queued before housekeeping, so bursts are answered back to back.
                for _ in range(256):
                    try:
                        frames = socket.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    if len(frames) != 2:
                        reply = p.encode_error(0, ErrorCode.BAD_MESSAGE, f"expected one frame, got {len(frames) - 1}")
                    else:
                        principal = self.auth.principal(frames[1]) if self.auth is not None else None
                        reply = self.handle(frames[1].bytes, principal)
                    socket.send_multipart([frames[0].bytes, reply])
            self.tick(time.monotonic())

    def stop(self, *_: Any) -> None:
        self.running = False


if __name__ == "__main__":  # pragma: no cover
    sys.exit("blockd.server is the daemon's code: run it with `blockd` (python -m blockd.main)")
