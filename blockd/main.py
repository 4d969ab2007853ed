"""`blockd`, the block-manager daemon's entry point: its options, checked, and the daemon assembled from them
(the bound socket, the persistence store, the manager restored from it). What it serves is blockd/server.py."""

from __future__ import annotations

import gc
import os
import signal
import sys
import time
from pathlib import Path

import click
import zmq

from blockd import protocol as p
from blockd.embedded_redis import EmbeddedRedis
from blockd.hashing import secret_key
from blockd.kv_events import KvEventPublisher
from blockd.manager import (
    DEFAULT_MAX_BLOCKS_PER_POOL,
    DEFAULT_MAX_LOOKUP_TOKENS,
    DEFAULT_MAX_POOLS,
    BlockManager,
    Limits,
)
from blockd.metrics import BlockdMetrics
from blockd.persistence import DEFAULT_QUEUE_LIMIT, NoPersistence, RedisKeys, RedisPersistence
from blockd.server import BlockdServer
from common.auth import KeysError, KeySet, Role, ServerAuth, unkeyed_refusal
from common.clicks import insecure_option, keys_option
from common.limits import SUPPORTED_BLOCK_SIZES
from common.logs import configure_logging
from common.units import parse_size


def default_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "pagedkv" / "blockd"


def _first_line(path: Path) -> str:
    lines = path.read_text().splitlines()
    return lines[0].strip() if lines else ""


def _give_up(context: zmq.Context, auth: ServerAuth | None) -> None:
    if auth is not None:
        auth.stop()
    context.destroy(linger=0)


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--endpoint", envvar="BLOCKD_ENDPOINT", default=p.DEFAULT_ENDPOINT, help="ZeroMQ endpoint to bind.")
@click.option(
    "--redis-url",
    envvar="REDIS_URL",
    default=None,
    help="Redis to persist the prefix index in. Default: an embedded redis-server in --state-dir.",
)
@click.option(
    "--redis-password-file",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    envvar="REDIS_PASSWORD_FILE",
    default=None,
    help="Read Redis's password from this file (its first line), for a --redis-url without one (e.g. a compose or "
    "Kubernetes secret). Env: REDIS_PASSWORD_FILE.",
)
@click.option("--persistence/--no-persistence", default=True, help="Persist the prefix index to Redis at all.")
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=default_state_dir(),
    envvar="BLOCKD_STATE_DIR",
    help="Where the embedded Redis keeps its data (used without --redis-url).",
)
@click.option("--flush-interval", type=float, default=0.1, help="Seconds between write-behind batches to Redis.")
@click.option(
    "--lease-timeout",
    type=float,
    default=10.0,
    envvar="BLOCKD_LEASE_TIMEOUT",
    help="Seconds of silence after which an executor's pool is dropped.",
)
@click.option(
    "--metrics-port",
    type=int,
    default=0,
    envvar="BLOCKD_METRICS_PORT",
    help="Serve Prometheus metrics on this port (0: off).",
)
@click.option("--metrics-host", default="127.0.0.1", help="Address the metrics endpoint listens on.")
@click.option(
    "--max-message-bytes",
    default="64MiB",
    help="Largest request accepted. ZeroMQ cuts off a peer that sends more (MAXMSGSIZE); blockd's clients refuse "
    "to send it (too_large).",
)
@click.option(
    "--receive-queue",
    type=click.IntRange(min=1),
    default=1000,
    help="Requests queued per peer before ZeroMQ stops reading from it (RCVHWM).",
)
@click.option(
    "--max-pools",
    type=click.IntRange(min=1, max=p.MAX_LOOKUP_POOLS),  # a lookup's answer names every pool: clients bound it
    default=DEFAULT_MAX_POOLS,
    help="Most pools (new ones: too_many_pools).",
)
@click.option(
    "--max-blocks-per-pool",
    type=click.IntRange(min=1),
    default=DEFAULT_MAX_BLOCKS_PER_POOL,
    help="Most blocks one pool may register (more: pool_too_large).",
)
@click.option(
    "--block-sizes",
    default=",".join(map(str, SUPPORTED_BLOCK_SIZES)),
    help="Block sizes a pool may register with (others: unsupported_block_size); by default those the attention "
    "kernels support.",
)
@click.option(
    "--max-lookup-tokens",
    type=click.IntRange(min=1),
    default=DEFAULT_MAX_LOOKUP_TOKENS,
    help="Most tokens one lookup may carry (more: too_many_tokens).",
)
@click.option("--deployment", default="pagedkv", help="Namespace of the block hashes (the chain's root).")
@click.option(
    "--deployment-secret",
    envvar="PAGEDKV_DEPLOYMENT_SECRET",
    default=None,
    show_default=False,
    help="Key every block hash with this secret (keyed BLAKE2b), so the hashes in Redis reveal nothing about the "
    "prompts without it. Changing it makes the persisted prefixes unreachable (they age out). Env: "
    "PAGEDKV_DEPLOYMENT_SECRET.",
)
@click.option(
    "--deployment-secret-file",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    envvar="PAGEDKV_DEPLOYMENT_SECRET_FILE",
    default=None,
    help="Read --deployment-secret from this file (its first line).",
)
@click.option(
    "--redis-prefix",
    default=None,
    help="Prefix of every Redis key blockd writes ('<prefix>:blockd:v1:...'), so deployments can share a Redis. "
    "Default: the --deployment name.",
)
@click.option(
    "--persistence-queue",
    type=click.IntRange(min=1),
    default=DEFAULT_QUEUE_LIMIT,
    help="Batches waiting for the Redis writer; past it, index changes are dropped (never requests) until the "
    "writer catches up and re-writes the whole index.",
)
@click.option(
    "--kv-events-endpoint",
    envvar="BLOCKD_KV_EVENTS_ENDPOINT",
    default=None,
    help="Publish KV cache events in vLLM's format on this ZeroMQ PUB endpoint, e.g. tcp://*:5570 (bound if it "
    "has * or ::, connected to otherwise, as vLLM does). Default: off.",
)
@click.option(
    "--kv-events-replay-endpoint",
    envvar="BLOCKD_KV_EVENTS_REPLAY_ENDPOINT",
    default=None,
    help="ROUTER endpoint answering replay requests for missed KV event batches, e.g. tcp://*:5571.",
)
@keys_option(
    "Key directory (`pagedkv keys generate DIR`): serve CURVE only, to executor, gateway and operator keys, "
    "each kept to its role.",
)
@insecure_option("Allow listening beyond loopback without --keys (anyone who reaches the port may do anything).")
@click.option("--log-level", default="info", type=click.Choice(["debug", "info", "warning", "error"]))
def main(
    endpoint: str,
    redis_url: str | None,
    redis_password_file: Path | None,
    persistence: bool,
    state_dir: Path,
    flush_interval: float,
    lease_timeout: float,
    metrics_port: int,
    metrics_host: str,
    max_message_bytes: str,
    receive_queue: int,
    max_pools: int,
    max_blocks_per_pool: int,
    block_sizes: str,
    max_lookup_tokens: int,
    deployment: str,
    deployment_secret: str | None,
    deployment_secret_file: Path | None,
    redis_prefix: str | None,
    persistence_queue: int,
    kv_events_endpoint: str | None,
    kv_events_replay_endpoint: str | None,
    keys_dir: Path | None,
    insecure: bool,
    log_level: str,
) -> None:
    """blockd: the block-manager daemon of pagedkv.

    It owns every KV block of every registered executor (allocation, refcounts, copy-on-write, the prefix index
    and LRU eviction) and answers executors, gateways and blockd-cli over ZeroMQ. The prefix index is written
    behind to Redis and reloaded at start, so a restarted blockd keeps the cached prefixes.
    """
    if lease_timeout <= 0 or flush_interval <= 0:
        raise click.BadParameter("--lease-timeout and --flush-interval must be positive")
    if kv_events_replay_endpoint is not None and kv_events_endpoint is None:
        raise click.BadParameter("needs --kv-events-endpoint", param_hint="--kv-events-replay-endpoint")
    log = configure_logging("blockd", log_level)
    try:
        limit = parse_size(max_message_bytes)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--max-message-bytes") from None
    try:
        sizes = tuple(sorted({int(x) for x in block_sizes.split(",") if x.strip()}))
    except ValueError:
        raise click.BadParameter(
            f"{block_sizes!r}: give block sizes like 8,16,32", param_hint="--block-sizes"
        ) from None
    if not sizes or min(sizes) < 1:
        raise click.BadParameter("give at least one positive block size", param_hint="--block-sizes")
    limits = Limits(
        max_pools=max_pools,
        max_blocks_per_pool=max_blocks_per_pool,
        block_sizes=sizes,
        max_lookup_tokens=max_lookup_tokens,
    )
    refusal = unkeyed_refusal("blockd", endpoint, keys_dir, insecure)
    if refusal:
        raise click.UsageError(refusal)
    # Bind first: a second blockd on the same endpoint fails here, before it touches anyone's Redis.
    context = zmq.Context()
    auth: ServerAuth | None = None
    if keys_dir is not None:
        try:
            auth = ServerAuth(context, KeySet(keys_dir), (Role.EXECUTOR, Role.GATEWAY, Role.OPERATOR))
        except KeysError as exc:
            _give_up(context, auth)
            raise click.ClickException(str(exc)) from None
    socket = context.socket(zmq.ROUTER)
    if auth is not None:
        auth.secure(socket)
    socket.setsockopt(zmq.LINGER, 1000)
    socket.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a client that reconnects under its old identity takes it over
    socket.setsockopt(zmq.MAXMSGSIZE, limit)  # a peer that sends more is cut off before it is read
    socket.setsockopt(zmq.RCVHWM, receive_queue)  # a flooding peer waits in its own TCP buffers, not in ours
    socket.setsockopt(zmq.SNDHWM, receive_queue)  # replies to a peer that does not read are dropped past it
    try:
        socket.bind(endpoint)
    except zmq.ZMQError as exc:
        _give_up(context, auth)
        raise click.ClickException(f"cannot bind {endpoint}: {exc}") from None
    embedded: EmbeddedRedis | None = None
    store: RedisPersistence | NoPersistence
    if not persistence:
        store = NoPersistence()
    else:
        if redis_url is None:
            embedded = EmbeddedRedis(state_dir)
            try:
                redis_url = embedded.start()
            except (RuntimeError, FileNotFoundError) as exc:
                _give_up(context, auth)
                raise click.ClickException(str(exc)) from None
            log.info("embedded redis started", url=redis_url, state_dir=str(state_dir))
        store = RedisPersistence(
            redis_url,
            password=_first_line(redis_password_file) if redis_password_file is not None else None,
            flush_interval_s=flush_interval,
            keys=RedisKeys(redis_prefix or deployment),
            queue_limit=persistence_queue,
        )
    if deployment_secret_file is not None:
        deployment_secret = _first_line(deployment_secret_file)
    kv_events = None
    if kv_events_endpoint is not None:
        try:
            kv_events = KvEventPublisher(store, kv_events_endpoint, kv_events_replay_endpoint)
        except zmq.ZMQError as exc:
            context.destroy(linger=0)
            raise click.ClickException(f"cannot open the KV events endpoints: {exc}") from None
    events = store if kv_events is None else kv_events  # the publisher hears pool changes and passes them on
    manager = BlockManager(
        lease_timeout_s=lease_timeout,
        deployment=deployment,
        events=events,
        limits=limits,
        hash_key=secret_key(deployment_secret),
    )
    specs, records = store.load()
    manager.restore(specs, records)
    store.start()
    # What exists now lives as long as the daemon: keep the cyclic GC from rescanning it, and let the young
    # generation grow, so collections stay short and rare on the request path.
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 50, 100)
    # The Redis writer thread must not hold the GIL for long while a request waits for it.
    sys.setswitchinterval(0.0005)

    metrics = BlockdMetrics() if metrics_port else None
    if metrics is not None:
        metrics.serve(metrics_port, metrics_host)
    server = BlockdServer(
        manager, store, metrics=metrics, max_message_bytes=limit, log=log, kv_events=kv_events, auth=auth
    )

    signal.signal(signal.SIGTERM, server.stop)
    signal.signal(signal.SIGINT, server.stop)
    log.info(
        "blockd ready",
        endpoint=endpoint,
        persistence=store.stats(time.monotonic()).state,
        dormant_pools=len(manager.dormant),
        persisted_blocks=sum(len(r) for r in records.values()),
        lease_timeout_s=lease_timeout,
        metrics_port=metrics_port or None,
        max_message_bytes=limit,
        max_pools=max_pools,
        max_blocks_per_pool=max_blocks_per_pool,
        block_sizes=list(sizes),
        redis_keys=store.stats(time.monotonic()).key_prefix or None,
        kv_events=kv_events.endpoint if kv_events is not None else None,
        keyed_hashes=bool(deployment_secret),
        auth="curve" if auth is not None else "none",
        keys=len(auth.principals) if auth is not None else None,
    )
    try:
        server.serve(socket)
    finally:
        flushed = store.flush_now(manager)
        log.info("blockd stopping", flushed=flushed)
        socket.close()
        if kv_events is not None:
            kv_events.close()
        if auth is not None:
            auth.stop()
        context.term()
        store.close()
        if embedded is not None:
            embedded.stop()


if __name__ == "__main__":  # pragma: no cover
    main()
