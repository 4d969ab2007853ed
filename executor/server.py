"""`pagedkv-executor`: one process per device, serving gateways over ZeroMQ and driving the engine.

The loop is single-threaded: take in every message waiting on the socket (submits, aborts, queries), run one
engine step if there is work, send its deltas to the gateways that asked. The pool's lease at blockd is renewed by
a heartbeat thread of the pool client (its own socket), so a forward pass longer than the lease loses nothing.
A bad message is answered with `Rejected` and changes nothing else.

Bounds, checked before any work: a message over --max-message-bytes is cut off by ZeroMQ (MAXMSGSIZE) unread;
a submit past --max-queued-requests is rejected with `queue_full`; a prompt's length is checked (packed size,
context length) before it is unpacked; an `Abort` is taken only from the connection that submitted the request
(`not_owner` otherwise).

Fencing: if blockd refuses this executor's pool (`pool_held` at start: another live executor registered the same
--pool-id; `stale_epoch` later: another executor took the pool over while this one was silent past its lease),
the executor ends every request with finish_reason "error" and exits (78 at start, 75 later): the pool is not
its own, and using it would mix another GPU's KV into its outputs.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from pathlib import Path

import click
import msgspec
import structlog
import torch
import zmq

from blockd.client import BlockdUnavailable, PoolClient, PoolFenced
from blockd.protocol import DEFAULT_ENDPOINT as DEFAULT_BLOCKD
from common.auth import KeysError, KeySet, Principal, Role, ServerAuth, unkeyed_refusal
from common.clicks import insecure_option, keys_option
from common.limits import SUPPORTED_BLOCK_SIZES
from common.logs import configure_logging
from common.tokens import TOKEN_BYTES, unpack_tokens
from common.units import parse_size
from executor import protocol as ep
from executor.checkpoint import CheckpointError, UnsupportedModel
from executor.engine import Engine, EngineLimits, RequestRejected
from executor.kv_budget import KvBudget, parse_kv_budget, resolve_num_blocks
from executor.runner import DTYPES, load_model
from executor.sequence import Status

log = structlog.get_logger("executor")

DEFAULT_MAX_MESSAGE_BYTES = 8 * 1024 * 1024
DEFAULT_MAX_QUEUED_REQUESTS = 1024
EX_FENCED = 75  # the pool was taken over by another executor while this one ran
EX_POOL_HELD = 78  # at start: another live executor holds this --pool-id


class Fenced(RuntimeError):
    """blockd says the pool is another executor's now."""


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
    ) -> None:
        self.engine = engine
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

    def serve(self) -> None:
        """Serve until stopped; raises Fenced (after ending every request) if the pool is not ours any more."""
        try:
            self._loop()
        except (Fenced, PoolFenced) as exc:
            reason = self.engine.pool.fenced or str(exc)
            log.error("pool_fenced", pool_id=self.engine.pool.pool_id, reason=reason)
            self._fail_all()
            self.engine.pool.stop_heartbeats()
            self.socket.close(linger=0)
            raise Fenced(reason) from None
        self._shutdown()

    def _loop(self) -> None:
        engine = self.engine
        pool = engine.pool
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        heartbeat_s = max((pool.lease_timeout_s or 10.0) / 4, 0.2)
        while not self.stopping:
            if pool.fenced:
                raise Fenced(pool.fenced)
            busy = engine.has_work()
            events = dict(poller.poll(0 if busy else 50))
            if events:
                self._drain()
            if engine.has_work():
                try:
                    self._send(engine.step())
                except BlockdUnavailable:
                    continue  # the step stays pending; keep answering gateways meanwhile
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
                seq = next((q for q in request.sequences if q.index == index), None)
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
            if self.auth is not None and not self._allowed(identity, frame, self.auth.principal(frames[1])):
                continue
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
        if type(message) is ep.Submit:
            try:
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
            self._reply(identity, self.engine.load())
        elif type(message) is ep.GetInfo:
            self._reply(identity, self.info)

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
        engine.pool.stop_heartbeats()
        self.socket.close(linger=0)


def _peek_request_id(frame: bytes) -> str:
    try:
        value = msgspec.msgpack.decode(frame)
    except msgspec.DecodeError:
        return ""
    request_id = value.get("request_id") if isinstance(value, dict) else None
    return request_id if isinstance(request_id, str) else ""


def _device(spec: str) -> torch.device:
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise click.BadParameter(f"{spec!r} is not a device: use cpu, cuda or cuda:N", param_hint="--device") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise click.BadParameter("CUDA was asked for but no CUDA device is available", param_hint="--device")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise click.BadParameter(
                f"{spec}: this machine has {torch.cuda.device_count()} CUDA devices", param_hint="--device"
            )
    elif device.type != "cpu":
        raise click.BadParameter(f"{spec!r}: use cpu, cuda or cuda:N", param_hint="--device")
    return device


def _default_pool_id(bind: str, device: torch.device) -> str:
    return f"{socket.gethostname()}-{device}-{bind.rsplit(':', 1)[-1]}".replace("/", "-")


@click.command(
    context_settings={
        "show_default": True,
        "help_option_names": ["-h", "--help"],
        "auto_envvar_prefix": "PAGEDKV_EXECUTOR",
    }
)
@click.option(
    "--model",
    "model_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    envvar="PAGEDKV_EXECUTOR_MODEL",
    help="Checkpoint directory (config.json + safetensors + tokenizer). Default: the generated "
    "default model (see `pagedkv make-model`), created on first use.",
)
@click.option("--device", "device_spec", default="cpu", envvar="PAGEDKV_EXECUTOR_DEVICE", help="cpu, cuda or cuda:N.")
@click.option(
    "--blockd",
    "blockd_endpoint",
    default=DEFAULT_BLOCKD,
    envvar="PAGEDKV_EXECUTOR_BLOCKD",
    help="blockd's ZeroMQ endpoint.",
)
@click.option("--bind", default=ep.DEFAULT_BIND, help="Where gateways reach this executor (ZeroMQ ROUTER).")
@click.option("--pool-id", default=None, help="This executor's pool name at blockd. Default: host-device-port.")
@click.option(
    "--block-size",
    type=click.Choice([str(b) for b in SUPPORTED_BLOCK_SIZES]),
    default="16",
    help="Tokens per KV block.",
)
@click.option(
    "--num-blocks",
    type=click.IntRange(min=1),
    default=None,
    help="KV cache size in blocks (overrides --kv-cache-memory).",
)
@click.option(
    "--kv-cache-memory",
    default=None,
    help="KV cache size: bytes like 2GiB, or on CUDA a fraction of the free device memory after "
    "loading the model, like 0.9. Default: 256MiB on CPU, 0.9 on CUDA.",
)
@click.option("--max-num-seqs", type=click.IntRange(min=1), default=128, help="Most sequences in one step.")
@click.option(
    "--max-num-batched-tokens",
    type=click.IntRange(min=1),
    default=2048,
    help="Token budget of one step (decode tokens plus prefill chunks).",
)
@click.option(
    "--dtype",
    type=click.Choice(["auto", *DTYPES]),
    default="auto",
    help="Weights and KV dtype. auto: the checkpoint's (float32 for bfloat16 checkpoints on CPU).",
)
@click.option(
    "--kernels",
    type=click.Choice(["auto", "triton", "torch", "reference"]),
    default="auto",
    help="Attention kernels: auto = Triton on CUDA, the CPU backend on CPU (native C++ kernels, built on first use, "
    "else torch; PAGEDKV_CPU_KERNELS); reference = the tests' oracle.",
)
@click.option("--seed", type=int, default=None, help="Seed of the sampler for requests without their own.")
@click.option(
    "--adapt-threads/--fixed-threads",
    default=True,
    show_default=True,
    help="On the CPU, shrink torch's thread team while other processes keep cores busy (an OpenMP team is as "
    "fast as its slowest thread), and grow it back when they stop; --fixed-threads keeps torch's own count.",
)
@click.option(
    "--pin-threads/--no-pin-threads",
    default=False,
    show_default=True,
    help="On the CPU, keep each of torch's worker threads on one core (the engine's own thread stays free). Off by "
    "default: on the 2-core VM it measured no faster alone, and a pinned worker cannot move off a core another "
    "pinned process (a vLLM beside it) is using.",
)
@click.option(
    "--blockd-wait",
    type=click.FloatRange(min=0),
    default=60.0,
    help="Seconds to wait for blockd at startup before giving up (exit 69).",
)
@click.option(
    "--pool-wait",
    type=click.FloatRange(min=0),
    default=15.0,
    help="Seconds to wait at startup while another live executor holds --pool-id (a predecessor's lease may "
    "still run) before giving up (exit 78).",
)
@click.option(
    "--max-message-bytes",
    default="8MiB",
    help="Largest message a gateway may send; ZeroMQ cuts off a peer that sends more.",
)
@click.option(
    "--max-queued-requests",
    type=click.IntRange(min=1),
    default=DEFAULT_MAX_QUEUED_REQUESTS,
    help="Requests held at once (running or waiting); more are rejected with queue_full.",
)
@keys_option(
    "Key directory (`pagedkv keys generate DIR`): serve gateways over CURVE only, and reach blockd with this "
    "pool's executor key (pool-POOL, else executor).",
)
@insecure_option("Allow --bind beyond loopback without --keys (anyone who reaches the port may submit).")
@click.option("--log-level", default="info", type=click.Choice(["debug", "info", "warning", "error"]))
def main(
    model_dir,
    device_spec,
    blockd_endpoint,
    bind,
    pool_id,
    block_size,
    num_blocks,
    kv_cache_memory,
    max_num_seqs,
    max_num_batched_tokens,
    dtype,
    kernels,
    seed,
    adapt_threads,
    pin_threads,
    blockd_wait,
    pool_wait,
    max_message_bytes,
    max_queued_requests,
    keys_dir,
    insecure,
    log_level,
) -> None:
    """Run one executor: load the model, hold the KV cache, serve gateways, keep blockd in step.

    Every option can also be set by an environment variable: PAGEDKV_EXECUTOR_ and the option's name in
    capitals with underscores (PAGEDKV_EXECUTOR_MODEL, PAGEDKV_EXECUTOR_KV_CACHE_MEMORY, ...)."""
    configure_logging("executor", log_level)
    refusal = unkeyed_refusal("the executor", bind, keys_dir, insecure)
    if refusal:
        raise click.UsageError(refusal)
    device = _device(device_spec)
    if max_num_batched_tokens < max_num_seqs:
        raise click.BadParameter("must be at least --max-num-seqs", param_hint="--max-num-batched-tokens")
    budget: KvBudget = parse_kv_budget(kv_cache_memory, device)
    try:
        message_limit = parse_size(max_message_bytes)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--max-message-bytes") from None
    if model_dir is None:
        from common.default_model import ensure_default_model

        model_dir = ensure_default_model()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    log.info("loading_model", model=str(model_dir), device=str(device))
    try:
        loaded = load_model(model_dir, device, None if dtype == "auto" else DTYPES[dtype])
    except (CheckpointError, UnsupportedModel) as exc:
        raise click.ClickException(str(exc)) from None
    block_size_int = int(block_size)
    blocks = resolve_num_blocks(num_blocks, budget, loaded.config, block_size_int, loaded.dtype, device)
    pool_id = pool_id or _default_pool_id(bind, device)
    keys = curve = None
    if keys_dir is not None:
        try:
            keys = KeySet(keys_dir)
            curve = keys.executor_client(pool_id)
        except KeysError as exc:
            raise click.ClickException(str(exc)) from None
    # A short retry window: while blockd is away the loop goes back to answering gateways between attempts.
    engine = Engine.assemble(
        loaded,
        blockd_endpoint,
        pool_id=pool_id,
        num_blocks=blocks,
        block_size=block_size_int,
        limits=EngineLimits(max_num_seqs, max_num_batched_tokens),
        backend=kernels,
        seed=seed,
        retry_for_s=2.0,
        curve=curve,
        adapt_threads=adapt_threads,
        pin_threads=pin_threads,
    )
    runner = engine.runner
    _register(engine.pool, blockd_endpoint, blockd_wait, pool_wait)
    engine.pool.start_heartbeats()
    info = ep.Info(
        pool_id=pool_id,
        model_id=loaded.config.model_id,
        model_dir=str(Path(model_dir).resolve()),
        max_model_len=loaded.config.max_model_len,
        vocab_size=loaded.config.vocab_size,
        block_size=block_size_int,
        num_blocks=blocks,
        device=str(device),
        eos_token_ids=list(loaded.config.eos_token_ids),
    )
    auth = None
    if keys is not None:
        try:
            auth = ServerAuth(zmq.Context.instance(), keys, (Role.GATEWAY, Role.OPERATOR))
        except KeysError as exc:
            raise click.ClickException(str(exc)) from None
    server = ExecutorServer(
        engine, bind, info, max_message_bytes=message_limit, max_queued_requests=max_queued_requests, auth=auth
    )
    log.info(
        "executor_ready",
        model=str(model_dir),
        architecture=loaded.config.architecture,
        model_id=loaded.config.model_id,
        parameters=sum(p.numel() for p in loaded.model.parameters()),
        max_model_len=loaded.config.max_model_len,
        dtype=str(loaded.dtype).removeprefix("torch."),
        device=str(device),
        load_s=round(loaded.load_s, 2),
        kv_blocks=blocks,
        kv_tokens=blocks * block_size_int,
        kv_bytes=runner.kv_cache_bytes,
        kernels=kernels,
        bind=bind,
        pool_id=pool_id,
        epoch=engine.pool.epoch_fingerprint,
        blockd=blockd_endpoint,
        auth="curve" if auth is not None else "none",
        pid=os.getpid(),
    )

    def stop(*_: object) -> None:
        server.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        server.serve()
    except Fenced as exc:
        click.echo(f"error: pool {pool_id} is not this executor's any more: {exc}", err=True)
        sys.exit(EX_FENCED)
    log.info("executor_stopped", pool_id=pool_id)


def _register(pool: PoolClient, endpoint: str, wait_s: float, pool_wait_s: float) -> None:
    """blockd may still be starting (compose, `pagedkv serve`): wait for it, saying so. If another live executor
    holds the pool, wait up to pool_wait_s (a predecessor's lease may be running out), then exit 78."""
    deadline = time.monotonic() + wait_s
    held_until = time.monotonic() + pool_wait_s
    while True:
        try:
            pool.register()
            return
        except PoolFenced as exc:
            if time.monotonic() >= held_until:
                log.error("pool_held", pool_id=pool.pool_id, reason=exc.message)
                click.echo(f"error: {exc.message}", err=True)
                sys.exit(EX_POOL_HELD)
            log.info("waiting_for_pool", pool_id=pool.pool_id, reason=exc.message)
            time.sleep(min(0.5, max(held_until - time.monotonic(), 0.0)))
            pool.fenced = None
        except BlockdUnavailable:
            if time.monotonic() > deadline:
                log.error("blockd_unreachable", blockd=endpoint, waited_s=wait_s)
                sys.exit(69)
            log.info("waiting_for_blockd", blockd=endpoint)


if __name__ == "__main__":
    main()
