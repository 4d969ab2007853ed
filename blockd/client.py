"""The client library of blockd, used by executors, gateways and blockd-cli.

`BlockdClient` is one connection with timeouts; `PoolClient` is an executor's side of its pool, mirroring its
sequences so that it can re-sync after a blockd restart or an expired lease (docs/architecture.md,
"Registration, leases and re-sync"). A client is not thread-safe: use one per thread.
"""

from __future__ import annotations

import itertools
import random
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import msgspec
import zmq

from blockd import protocol as p
from blockd.block_rule import dead_blocks, reserved_after, shared_blocks
from blockd.errors import BlockdError, ErrorCode
from blockd.hashing import epoch_fingerprint
from blockd.manager import DEFAULT_MAX_LOOKUP_TOKENS
from blockd.pool import HOLE, AdmitResult, AppendResult, TokenIds, group_table_ids
from common.auth import ClientCurve
from common.tokens import TOKEN_BYTES, as_packed, unpack_tokens

R = TypeVar("R")


class BlockdUnavailable(ConnectionError):
    """blockd did not answer in time."""


class BlockdClient:
    """A connection to blockd (one DEALER). Every call either returns its result, raises BlockdError, or raises
    BlockdUnavailable when no answer comes within the timeout (never a hang); a late answer to it is recognised
    by its id and discarded."""

    def __init__(
        self,
        endpoint: str,
        *,
        timeout_s: float = 5.0,
        context: zmq.Context | None = None,
        max_message_bytes: int = p.DEFAULT_MAX_MESSAGE_BYTES,
        curve: ClientCurve | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.curve = curve  # this client's keys, for a blockd that serves CURVE (common.auth)
        # blockd cuts off a peer that sends more than its limit (ZeroMQ MAXMSGSIZE) without a word: a request
        # over the limit is refused here instead, with too_large.
        self.max_message_bytes = max_message_bytes
        self._context = context or zmq.Context.instance()
        self._ids = itertools.count(random.randrange(1, 2**31))
        self._socket: zmq.Socket | None = None
        self._pending: int | None = None

    def _connect(self) -> zmq.Socket:
        if self._socket is None:
            socket = self._context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.RECONNECT_IVL, 50)
            socket.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
            if self.curve is not None:
                self.curve.apply(socket)
            socket.connect(self.endpoint)
            self._socket = socket
        return self._socket

    def reset(self) -> None:
        """Drop the connection (and anything queued on it); the next call connects afresh."""
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
        self._pending = None

    def close(self) -> None:
        self.reset()

    def __enter__(self) -> BlockdClient:
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()

    # ------------------------------------------------------------------------------ calls

    def send(self, request_type: type[p.Request], **fields: Any) -> int:
        """Send a request without waiting for its reply (see `receive`); returns its id."""
        if self._pending is not None:
            raise RuntimeError("a request is still waiting for its reply on this client")
        request_id = next(self._ids)
        frame = p.encode(request_type(v=p.PROTOCOL_VERSION, id=request_id, **fields))
        if len(frame) > self.max_message_bytes:
            raise BlockdError(
                ErrorCode.TOO_LARGE,
                f"a request of {len(frame)} bytes is over blockd's limit of {self.max_message_bytes} (not sent)",
            )
        self._connect().send(frame, copy=False)
        self._pending = request_id
        return request_id

    def receive(self, result_type: type[R], timeout_s: float | None = None) -> R:
        """Wait for the reply to the request in flight."""
        request_id = self._pending
        if request_id is None:
            raise RuntimeError("no request in flight")
        socket = self._connect()
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not socket.poll(int(remaining * 1000) + 1, zmq.POLLIN):
                if time.monotonic() < deadline:
                    continue
                self.reset()
                raise BlockdUnavailable(f"blockd at {self.endpoint} did not answer within {self.timeout_s:g} s")
            reply = p.decode_reply(socket.recv(copy=True))
            if reply.id != request_id:
                continue  # the late answer to a request that already timed out
            self._pending = None
            if not reply.ok:
                error = reply.error or p.ErrorInfo(ErrorCode.INTERNAL, "error reply without details")
                raise BlockdError(ErrorCode.of(error.code), error.message)
            return p.decode_result(reply.result, result_type)

    def call(self, request_type: type[p.Request], **fields: Any) -> Any:
        self.send(request_type, **fields)
        return self.receive(p.RESULT_TYPES[request_type])

    # ------------------------------------------------------------------------------ operator calls

    def stats(self, pool_id: str | None = None) -> p.StatsResult:
        return self.call(p.Stats, pool_id=pool_id)

    def pools(self) -> p.PoolsResult:
        return self.call(p.Pools)

    def sequence(self, seq_id: str, pool_id: str | None = None) -> p.SequenceInfo:
        return self.call(p.GetSequence, seq_id=seq_id, pool_id=pool_id)

    def check(self) -> list[str]:
        return self.call(p.Check).problems

    def reset_prefix_cache(self, pool_id: str) -> int:
        return self.call(p.ResetPrefixCache, pool_id=pool_id).dropped

    def lookup(
        self, tokens: Sequence[int], cache_salt: str | None = None, max_tokens: int = DEFAULT_MAX_LOOKUP_TOKENS
    ) -> dict[str, int]:
        """Prompt tokens each registered pool has cached for this prompt (the gateway routes on it). Only the
        first `max_tokens` are looked up (blockd refuses longer lookups: --max-lookup-tokens)."""
        return self.lookup_tiers(tokens, cache_salt, max_tokens).cached_tokens

    def lookup_tiers(
        self, tokens: Sequence[int], cache_salt: str | None = None, max_tokens: int = DEFAULT_MAX_LOOKUP_TOKENS
    ) -> p.LookupResult:
        """Per pool, the prompt tokens cached on the device and those each lower tier would load after them (the
        gateway routes on it). A reply that breaks the schema (a foreign or broken blockd) is `bad_message`."""
        packed = as_packed(tokens)[: max_tokens * TOKEN_BYTES]
        try:
            return self.call(p.Lookup, tokens=bytes(packed), cache_salt=cache_salt)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            self.reset()  # (the request may still count as in flight)
            raise BlockdError(ErrorCode.BAD_MESSAGE, f"blockd's lookup reply does not decode: {exc}") from None


class MirroredSequence(msgspec.Struct):
    tokens: bytearray  # packed token ids
    blocks: list[int]  # its block table; leading entries may be HOLE (handed back by a slide)
    num_computed_tokens: int
    cache_salt: str | None = None
    reserved: int = 0  # slots past the tokens held for a token not registered yet (blockd.block_rule)
    holes: int = 0  # leading entries of `blocks` that are HOLE
    group: int = 0  # the layer group whose table this is

    def token_ids(self) -> list[int]:
        return unpack_tokens(self.tokens)


class StepFailed(BlockdError):
    """A single-op convenience call whose op failed (out of blocks, unknown sequence, ...)."""


class PoolFenced(BlockdError):
    """blockd refused this pool's request: another executor holds the pool (stale_epoch, pool_held). Retrying
    cannot help; the executor must stop using the pool."""


class PoolClient:
    """An executor's pool at blockd: registration, heartbeats, steps, and re-sync after failures."""

    def __init__(
        self,
        client: BlockdClient,
        *,
        pool_id: str,
        num_blocks: int,
        block_size: int,
        model_id: str,
        epoch: int | None = None,
        retry_for_s: float = 30.0,
        sliding_window: int | None = None,
        groups: Sequence[bool] = (),
    ) -> None:
        self.client = client
        self.pool_id = pool_id
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.model_id = model_id
        self.sliding_window = sliding_window  # every layer's window: blocks past it go back (p.Slide)
        # Layer groups: whether each slides by the window (() is one group). Each sequence has a table per group,
        # mirrored under blockd's names (`<seq>`, `<seq>@g<i>`).
        self.groups: tuple[bool, ...] = tuple(groups) if len(groups) > 1 else ()
        self.num_groups = max(len(self.groups), 1)
        self.windows = [sliding_window if slides else None for slides in self.groups] or [sliding_window]
        # New at every process start, and not from `random`, which a caller may have seeded.
        self.epoch = epoch if epoch is not None else secrets.randbelow(2**62) + 1
        self.retry_for_s = retry_for_s
        self.seqs: dict[str, MirroredSequence] = {}
        self.generations: list[int] = [0] * num_blocks
        # Tables of `seqs` that hold each block: blockd's refcounts (I2), so the free count needs no question;
        # the only block accounting on the executor's side.
        self.refcount: list[int] = [0] * num_blocks
        self.blocks_in_use = 0  # blocks with a nonzero refcount
        self.lease_timeout_s: float | None = None
        self.resyncs = 0
        self._in_flight: list[p.StepOp] | None = None
        self._heartbeats: _Heartbeats | None = None
        self.needs_resync = False  # set by the heartbeat thread: blockd lost the pool (restarted, expired)
        self.fenced: str | None = None  # set when blockd says another executor holds the pool
        # The executor's lower KV tiers, reported on every (re-)registration (blockd.tiers): what they hold now.
        self.tiers: Callable[[], p.TierSpec] | None = None
        self.tier_drops: Callable[[], list[bytes]] | None = None  # what its disk lost since the last step
        # The shared tier's writes finished, and those failed or found bad, since the last step.
        self.shared_reports: Callable[[], tuple[list[bytes], list[bytes]]] | None = None

    @property
    def epoch_fingerprint(self) -> str:
        return epoch_fingerprint(self.epoch)

    @property
    def free_blocks(self) -> int:
        """Blocks no live sequence holds (cached or not): what blockd can grant, as of the last step."""
        return self.num_blocks - self.blocks_in_use

    def _hold(self, blocks: Sequence[int]) -> None:
        refcount = self.refcount
        for b in blocks:
            if b == HOLE:
                continue
            if refcount[b] == 0:
                self.blocks_in_use += 1
            refcount[b] += 1

    def _release(self, blocks: Sequence[int]) -> None:
        refcount = self.refcount
        for b in blocks:
            if b == HOLE:
                continue
            refcount[b] -= 1
            if refcount[b] == 0:
                self.blocks_in_use -= 1

    # ------------------------------------------------------------------------------ registration

    def register(self) -> p.RegisterResult:
        """(Re-)register the pool with every live sequence and block generation this executor holds."""
        result: p.RegisterResult = self._fenced_call(
            p.Register,
            pool_id=self.pool_id,
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            model_id=self.model_id,
            epoch=self.epoch,
            sliding_window=self.sliding_window,
            groups=list(self.groups) or None,
            sequences=[
                p.LiveSequence(
                    seq_id,
                    bytes(s.tokens),
                    s.blocks,
                    s.num_computed_tokens,
                    s.cache_salt,
                    s.reserved,
                    [self.seqs[t].blocks for t in self.table_ids(seq_id)[1:]],
                )
                for seq_id, s in self.seqs.items()
                if s.group == 0
            ],
            generations=self.generations,
            tiers=self.tiers() if self.tiers is not None else None,
        )
        if result.groups != self.num_groups:
            raise BlockdError(
                ErrorCode.INVALID_REQUEST,
                f"blockd at {self.client.endpoint} keeps {result.groups} layer group(s) for pool {self.pool_id!r}, "
                f"this executor has {self.num_groups}: that blockd is older than layer groups",
            )
        self.lease_timeout_s = result.lease_timeout_s
        self.needs_resync = False
        return result

    def _fenced_call(self, request_type: type[p.Request], **fields: Any) -> Any:
        """A call whose stale_epoch / pool_held answer becomes PoolFenced."""
        try:
            return self.client.call(request_type, **fields)
        except BlockdError as exc:
            raise self._fence(exc) from None

    def _fence(self, exc: BlockdError) -> BlockdError:
        if exc.code in (ErrorCode.STALE_EPOCH, ErrorCode.POOL_HELD):
            self.fenced = exc.message
            return PoolFenced(exc.code, exc.message)
        return exc

    def unregister(self) -> None:
        self.stop_heartbeats()
        self._fenced_call(p.Unregister, pool_id=self.pool_id, epoch=self.epoch)

    def heartbeat(self) -> None:
        """Renew the lease now; re-register first if blockd lost the pool."""
        self._with_resync(lambda: self._fenced_call(p.Heartbeat, pool_id=self.pool_id, epoch=self.epoch))

    def reset_prefix_cache(self) -> int:
        return self._fenced_call(p.ResetPrefixCache, pool_id=self.pool_id, epoch=self.epoch).dropped

    def start_heartbeats(self, interval_s: float | None = None) -> None:
        """Renew the lease every `interval_s` (default: a quarter of the lease) from a thread with its own
        socket, whatever the caller's thread is doing (a long forward pass, say). The thread never registers:
        when blockd has lost the pool it sets `needs_resync` for the owner's thread to act on."""
        if self._heartbeats is None:
            client = BlockdClient(
                self.client.endpoint,
                timeout_s=self.client.timeout_s,
                context=self.client._context,
                curve=self.client.curve,
            )
            self._heartbeats = _Heartbeats(self, client, interval_s)
            self._heartbeats.start()

    @property
    def heartbeats_running(self) -> bool:
        return self._heartbeats is not None and self._heartbeats.is_alive()

    def stop_heartbeats(self) -> None:
        if self._heartbeats is not None:
            self._heartbeats.stop()
            self._heartbeats = None

    def _with_resync(self, attempt: Any) -> Any:
        """Run `attempt`; if blockd lost this pool or did not answer, re-register and try again until retry_for_s."""
        deadline = time.monotonic() + self.retry_for_s
        while True:
            try:
                return attempt()
            except BlockdError as exc:
                if exc.code in (ErrorCode.STALE_EPOCH, ErrorCode.POOL_HELD):
                    raise self._fence(exc) from None
                if exc.code != ErrorCode.UNKNOWN_POOL or time.monotonic() > deadline:
                    raise
            except BlockdUnavailable:
                if time.monotonic() > deadline:
                    raise
            self._resync_until(deadline)

    def resync(self) -> None:
        """Re-register now, retrying for up to retry_for_s: after a step that failed for good, before sending it
        again, so that whatever part of it blockd may have applied is undone first."""
        self._resync_until(time.monotonic() + self.retry_for_s)

    def _resync_until(self, deadline: float) -> None:
        while True:
            try:
                self.register()
                self.resyncs += 1
                return
            except BlockdUnavailable:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    # ------------------------------------------------------------------------------ steps

    def step(self, ops: Sequence[p.StepOp]) -> list[p.StepOpResult]:
        """One round trip carrying every op of a scheduler step; results in op order, applied to the mirror."""
        self.submit_step(ops)
        return self.finish_step()

    @property
    def step_in_flight(self) -> bool:
        """A step was submitted and its results are not collected yet."""
        return self._in_flight is not None

    def submit_step(self, ops: Sequence[p.StepOp]) -> None:
        """Send a step's ops now; `finish_step` collects the results, so the round trip overlaps whatever the
        caller does meanwhile (the engine: the forward pass of the step before)."""
        if self._in_flight is not None:
            raise RuntimeError("a step is already in flight: finish_step() it first")
        ops = list(ops)
        drops = self.tier_drops() if self.tier_drops is not None else []
        written, lost = self.shared_reports() if self.shared_reports is not None else ([], [])
        # (A step resent after a re-sync carries none: the re-registration's report no longer names them.)
        self.client.send(
            p.Step,
            pool_id=self.pool_id,
            epoch=self.epoch,
            ops=ops,
            tier_drops=drops,
            shared_written=written,
            shared_drops=lost,
        )
        self._in_flight = ops  # only once sent: a send that raised leaves nothing in flight

    def finish_step(self) -> list[p.StepOpResult]:
        """The results of the step in flight, after a re-sync and a resend if blockd lost it."""
        if self._in_flight is None:
            raise RuntimeError("no step in flight")
        ops, self._in_flight = self._in_flight, None
        answered_in_flight = False

        def attempt() -> p.StepResult:
            nonlocal answered_in_flight
            if not answered_in_flight:
                answered_in_flight = True
                return self.client.receive(p.StepResult)
            return self.client.call(p.Step, pool_id=self.pool_id, epoch=self.epoch, ops=ops)

        result: p.StepResult = self._with_resync(attempt)
        for op, outcome in zip(ops, result.results, strict=True):
            if type(outcome) is not p.OpError:
                self._mirror(op, outcome)
        return result.results

    def table_ids(self, seq_id: str) -> list[str]:
        """The sequence's tables, one per layer group (blockd.pool.group_table_ids)."""
        return [seq_id] if self.num_groups == 1 else group_table_ids(seq_id, self.num_groups)

    def _mirror(self, op: p.StepOp, outcome: Any) -> None:
        if self.num_groups == 1:
            self._mirror_table(op, outcome, 0)
            return
        for g, table_id in enumerate(self.table_ids(op.parent_id if type(op) is p.Fork else op.seq_id)):
            if type(op) is p.Fork:
                table_op: p.StepOp = p.Fork(table_id, self.table_ids(op.child_id)[g])
            else:
                table_op = msgspec.structs.replace(op, seq_id=table_id)
            if type(op) is p.Admit and g:
                table = outcome.groups[g - 1]
                table_outcome = AdmitResult(table.blocks, table.generations, outcome.num_cached_tokens)
            elif type(op) is p.Append:
                table_outcome = outcome.of_group(g)
            else:
                table_outcome = outcome
            self._mirror_table(table_op, table_outcome, g)

    def _mirror_table(self, op: p.StepOp, outcome: Any, group: int) -> None:
        """Mirror one table's part of an op (`op` names the table)."""
        gens = self.generations
        if type(op) is p.Append:
            seq = self.seqs[op.seq_id]
            open_block = len(seq.tokens) // TOKEN_BYTES // self.block_size  # the one a copy replaces
            seq.tokens += op.tokens
            seq.reserved = reserved_after(seq.reserved, len(op.tokens) // TOKEN_BYTES, op.reserve)
            for (src, dst), gen in zip(outcome.copies, outcome.copy_generations, strict=False):
                seq.blocks[open_block] = dst
                gens[dst] = gen
                self._release((src,))
                self._hold((dst,))
            for b, gen in zip(outcome.blocks, outcome.generations, strict=False):
                gens[b] = gen
            seq.blocks.extend(outcome.blocks)
            self._hold(outcome.blocks)
        elif type(op) is p.Admit:
            holes = 0
            for b, gen in zip(outcome.blocks, outcome.generations, strict=False):
                if b == HOLE:  # (leading only)
                    holes += 1
                else:
                    gens[b] = gen
            registered = len(op.tokens) // TOKEN_BYTES
            if op.hold is not None:  # (blockd's rule: the cached prefix and `hold` tokens past it)
                registered = min(registered, outcome.num_cached_tokens + max(op.hold, 1))
            self.seqs[op.seq_id] = MirroredSequence(
                bytearray(op.tokens[: registered * TOKEN_BYTES]),
                list(outcome.blocks),
                # Committed: the device's prefix (blocks loaded from a lower tier are committed once they landed).
                outcome.num_cached_tokens - outcome.loaded_tokens,
                op.cache_salt,
                holes=holes,
                group=group,
            )
            self._hold(outcome.blocks)
        elif type(op) is p.Commit:
            seq = self.seqs[op.seq_id]
            seq.num_computed_tokens = max(seq.num_computed_tokens, op.num_computed_tokens)
        elif type(op) is p.Free:
            self._release(self.seqs.pop(op.seq_id).blocks)
        elif type(op) is p.Slide:
            seq = self.seqs[op.seq_id]
            seq.num_computed_tokens = max(seq.num_computed_tokens, op.num_computed_tokens)
            dead = dead_blocks(self.block_size, self.windows[group], op.num_computed_tokens)
            if dead > seq.holes:  # the blocks blockd released, by the same rule
                self._release(seq.blocks[seq.holes : dead])
                seq.blocks[seq.holes : dead] = [HOLE] * (dead - seq.holes)
                seq.holes = dead
        elif type(op) is p.Trim:
            seq = self.seqs[op.seq_id]
            seq.reserved = op.reserve
            count = outcome.released  # the blocks blockd released: the table's last (block_rule.trimmed_blocks)
            if count:
                self._release(seq.blocks[len(seq.blocks) - count :])
                del seq.blocks[len(seq.blocks) - count :]
        elif type(op) is p.Fork:
            parent = self.seqs[op.parent_id]
            shared = parent.blocks[: shared_blocks(self.block_size, len(parent.tokens) // TOKEN_BYTES)]
            self._hold(shared)
            self.seqs[op.child_id] = MirroredSequence(
                bytearray(parent.tokens),
                shared,
                parent.num_computed_tokens,
                parent.cache_salt,
                holes=parent.holes,
                group=group,
            )

    def _one(self, op: p.StepOp) -> Any:
        (outcome,) = self.step([op])
        if type(outcome) is p.OpError:
            raise StepFailed(ErrorCode.of(outcome.code), outcome.message, missing_blocks=outcome.missing_blocks)
        return outcome

    def admit(self, seq_id: str, tokens: TokenIds, cache_salt: str | None = None) -> AdmitResult:
        return self._one(p.Admit(seq_id, bytes(as_packed(tokens)), cache_salt))

    def append(self, seq_id: str, tokens: TokenIds, reserve: int = 0) -> AppendResult:
        return self._one(p.Append(seq_id, bytes(as_packed(tokens)), reserve))

    def commit(self, seq_id: str, num_computed_tokens: int) -> int:
        return self._one(p.Commit(seq_id, num_computed_tokens)).added

    def fork(self, parent_id: str, child_id: str) -> None:
        self._one(p.Fork(parent_id, child_id))

    def free(self, seq_id: str) -> int:
        return self._one(p.Free(seq_id)).freed

    def slide(self, seq_id: str, num_computed_tokens: int) -> int:
        return self._one(p.Slide(seq_id, num_computed_tokens)).released

    def trim(self, seq_id: str, reserve: int) -> int:
        return self._one(p.Trim(seq_id, reserve)).released


class _Heartbeats(threading.Thread):
    """Renews a pool's lease on a socket of its own (ZeroMQ sockets are not thread-safe)."""

    def __init__(self, pool: PoolClient, client: BlockdClient, interval_s: float | None) -> None:
        super().__init__(name=f"heartbeat-{pool.pool_id}", daemon=True)
        self.pool = pool
        self.client = client
        self.interval_s = interval_s
        self.sent = 0
        self.failed = 0
        self._halt = threading.Event()

    def _interval(self) -> float:
        if self.interval_s is not None:
            return self.interval_s
        return max((self.pool.lease_timeout_s or 10.0) / 4, 0.05)

    def run(self) -> None:
        pool = self.pool
        try:
            while not self._halt.wait(self._interval()):
                try:
                    written, lost = pool.shared_reports() if pool.shared_reports is not None else ([], [])
                    self.client.call(
                        p.Heartbeat, pool_id=pool.pool_id, epoch=pool.epoch, shared_written=written, shared_drops=lost
                    )
                    self.sent += 1
                except BlockdUnavailable:
                    self.failed += 1
                except BlockdError as exc:
                    self.failed += 1
                    if exc.code == ErrorCode.UNKNOWN_POOL:
                        pool.needs_resync = True
                    elif exc.code in (ErrorCode.STALE_EPOCH, ErrorCode.POOL_HELD):
                        pool.fenced = exc.message
                        return
        finally:
            self.client.close()

    def stop(self) -> None:
        self._halt.set()
        if self is not threading.current_thread():
            self.join(timeout=5)
