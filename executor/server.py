"""`pagedkv-executor`: one process per device, serving gateways over ZeroMQ and driving the engine.

The loop is single-threaded: take in every message waiting on the socket (submits, aborts, queries), run one
engine step if there is work, send its deltas to the gateways that asked, heartbeat blockd when idle. A bad
message is answered with `Rejected` and changes nothing else.
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

from blockd.client import BlockdUnavailable, PoolClient
from blockd.protocol import DEFAULT_ENDPOINT as DEFAULT_BLOCKD
from common.logs import configure_logging
from common.tokens import unpack_tokens
from executor import protocol as ep
from executor.checkpoint import CheckpointError, UnsupportedModel
from executor.engine import Engine, EngineLimits, RequestRejected
from executor.kv_budget import KvBudget, parse_kv_budget, resolve_num_blocks
from executor.runner import DTYPES, load_model

log = structlog.get_logger("executor")


class ExecutorServer:
    def __init__(self, engine: Engine, bind: str, info: ep.Info, *, context: zmq.Context | None = None) -> None:
        self.engine = engine
        self.info = info
        self.context = context or zmq.Context.instance()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.socket.bind(bind)
        self.owners: dict[str, bytes] = {}  # request id -> the gateway connection it came from
        self.stopping = False
        self.last_blockd_contact = time.monotonic()

    def serve(self) -> None:
        engine = self.engine
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        heartbeat_s = max((engine.pool.lease_timeout_s or 10.0) / 4, 0.2)
        while not self.stopping:
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
            elif time.monotonic() - self.last_blockd_contact > heartbeat_s:
                try:
                    engine.pool.heartbeat()
                    self.last_blockd_contact = time.monotonic()
                except BlockdUnavailable:
                    log.warning("blockd_unreachable", during="heartbeat")
        self._shutdown()

    def _drain(self) -> None:
        while True:
            try:
                identity, frame = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except ValueError:
                continue  # not two frames: not one of ours
            self._handle(identity, frame)

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
                if len(message.prompt) % 4:
                    raise RequestRejected("invalid_request", "prompt must be packed uint32 token ids")
                self.engine.add_request(
                    message.request_id, unpack_tokens(message.prompt), message.params, message.cache_salt
                )
            except RequestRejected as exc:
                self._reply(identity, ep.Rejected(request_id=message.request_id, code=exc.code, message=exc.message))
                return
            self.owners[message.request_id] = identity
        elif type(message) is ep.Abort:
            self._send(self.engine.abort(message.request_id, message.index))
        elif type(message) is ep.GetLoad:
            self._reply(identity, self.engine.load())
        elif type(message) is ep.GetInfo:
            self._reply(identity, self.info)

    def _send(self, deltas: list[ep.Delta]) -> None:
        for delta in deltas:
            identity = self.owners.get(delta.request_id)
            if identity is not None:
                self.socket.send_multipart([identity, ep.encode(delta)])
        # Only after the whole batch: a request's choices can all finish in one step.
        for request_id in {d.request_id for d in deltas if d.finish_reason is not None}:
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
@click.option("--block-size", type=click.Choice(["8", "16", "32", "64"]), default="16", help="Tokens per KV block.")
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
    help="Attention kernels: auto = Triton on CUDA, batched torch on CPU; reference = the tests' oracle.",
)
@click.option("--seed", type=int, default=None, help="Seed of the sampler for requests without their own.")
@click.option(
    "--blockd-wait",
    type=click.FloatRange(min=0),
    default=60.0,
    help="Seconds to wait for blockd at startup before giving up (exit 69).",
)
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
    blockd_wait,
    log_level,
) -> None:
    """Run one executor: load the model, hold the KV cache, serve gateways, keep blockd in step.

    Every option can also be set by an environment variable: PAGEDKV_EXECUTOR_ and the option's name in
    capitals with underscores (PAGEDKV_EXECUTOR_MODEL, PAGEDKV_EXECUTOR_KV_CACHE_MEMORY, ...)."""
    configure_logging("executor", log_level)
    device = _device(device_spec)
    if max_num_batched_tokens < max_num_seqs:
        raise click.BadParameter("must be at least --max-num-seqs", param_hint="--max-num-batched-tokens")
    budget: KvBudget = parse_kv_budget(kv_cache_memory, device)
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
    )
    runner = engine.runner
    _register(engine.pool, blockd_endpoint, blockd_wait)
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
    server = ExecutorServer(engine, bind, info)
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
        blockd=blockd_endpoint,
        pid=os.getpid(),
    )

    def stop(*_: object) -> None:
        server.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    server.serve()
    log.info("executor_stopped", pool_id=pool_id)


def _register(pool: PoolClient, endpoint: str, wait_s: float) -> None:
    """blockd may still be starting (compose, `pagedkv serve`): wait for it, saying so."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            pool.register()
            return
        except BlockdUnavailable:
            if time.monotonic() > deadline:
                log.error("blockd_unreachable", blockd=endpoint, waited_s=wait_s)
                sys.exit(69)
            log.info("waiting_for_blockd", blockd=endpoint)


if __name__ == "__main__":
    main()
