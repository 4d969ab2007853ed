"""`pagedkv-executor`, the executor's entry point: its options, checked; the model loaded, the engine assembled and
registered at blockd (waiting for it, and for a predecessor's lease on the pool); then the serving loop
(executor/server.py) until SIGTERM. Exit status: 69 blockd unreachable, 78 the pool held by another live
executor, 75 the pool taken over later, 70 a rank of its tensor-parallel group died or stopped answering
(`--tensor-parallel-size`: the group is started before the model is loaded, executor/parallel_group.py; with
`--tp-master` the ranks are started apart and a rank above 0 runs as that group's worker, parallel_worker.py).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import sys
import time
from pathlib import Path

import click
import structlog
import torch
import zmq

from blockd.client import BlockdUnavailable, PoolClient, PoolFenced
from blockd.protocol import DEFAULT_ENDPOINT as DEFAULT_BLOCKD
from common.auth import KeysError, KeySet, Role, ServerAuth, unkeyed_refusal
from common.clicks import insecure_option, keys_option
from common.limits import SUPPORTED_BLOCK_SIZES
from common.logs import configure_logging
from common.units import parse_size
from executor import protocol as ep
from executor.checkpoint import load_config
from executor.engine import Engine, EngineLimits
from executor.kv_budget import KvBudget, parse_kv_budget, resolve_num_blocks
from executor.model_config import CheckpointError, UnsupportedModel
from executor.parallel import DEFAULT_TIMEOUT_S as DEFAULT_TP_TIMEOUT_S
from executor.parallel import STARTUP_TIMEOUT_S, GroupIntruder, Shard, free_port, make_shard
from executor.parallel_group import WorkerGroup
from executor.parallel_rendezvous import GroupSettings, Placement, RendezvousError, new_token, placement
from executor.parallel_runner import ParallelRunner, broadcast_int
from executor.pooling import Embedder, PoolingConfigError, read_pooling_config
from executor.runner import DTYPES, LoadedModel, ModelRunner, kv_layout, load_model
from executor.server import DEFAULT_MAX_QUEUED_REQUESTS, EmbedFault, ExecutorServer, Fenced, StepStall
from executor.shared_tier import SharedStore
from executor.speculative import SpeculativeConfig, SpeculativeConfigError
from executor.step_budget import DEFAULT_MAX_STEP_MS
from executor.tier_store import TierStore
from pagedkv_kernels.quant import KV_CACHE_DTYPES

log = structlog.get_logger("executor")

EX_FENCED = 75  # the pool was taken over by another executor while this one ran
EX_POOL_HELD = 78  # at start: another live executor holds this --pool-id


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


def _speculative(text: str | None, embed: bool, tensor_parallel_size: int, block_size: int) -> SpeculativeConfig | None:
    """--speculative-config, checked at startup: a bad one is refused before the model loads."""
    if text is None:
        return None
    try:
        config = SpeculativeConfig.parse(text)
        config.check_block_size(block_size)
        if config.model is not None and config.method == "draft_model" and not Path(config.model).is_dir():
            raise SpeculativeConfigError(f"draft model {config.model}: not a directory")
    except SpeculativeConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="--speculative-config") from None
    if embed:
        raise click.UsageError("--speculative-config applies to generation, not --task embed")
    if tensor_parallel_size > 1:
        raise click.UsageError("--speculative-config runs with --tensor-parallel-size 1 only, for now")
    return config


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
    "--max-step-ms",
    type=click.FloatRange(min=0),
    default=DEFAULT_MAX_STEP_MS,
    help="Target duration of one step, in milliseconds: each step's token budget is sized from the measured cost "
    "of the steps before it so that a step lasts about this long (--max-num-batched-tokens stays the cap, and "
    "every running sequence still gets its decode token). It bounds the wait of streams already decoding while a "
    "burst of long prompts is prefilled, and keeps any step from running for seconds on a slow device or a busy "
    "host. 0: no time bound, the token budget alone.",
)
@click.option(
    "--scheduling-policy",
    type=click.Choice(["fcfs", "priority"]),
    default="fcfs",
    help="fcfs: requests are served first come, first served (a non-zero priority is refused); priority (vLLM's): "
    "the waiting queue is ordered by (priority, arrival), lower sooner, and when blocks run short the worst-ranked "
    "running requests are preempted, also to admit a better-ranked one.",
)
@click.option(
    "--dtype",
    type=click.Choice(["auto", *DTYPES]),
    default="auto",
    help="Weights and KV dtype. auto: the checkpoint's (float32 for bfloat16 checkpoints on CPU).",
)
@click.option(
    "--kv-cache-dtype",
    type=click.Choice(list(KV_CACHE_DTYPES)),
    default="auto",
    help="KV cache element type. auto: the model's dtype; fp8 (= fp8_e4m3) or fp8_e5m2: 8-bit blocks, half the "
    "bytes of float16 (twice the blocks in the same memory), quantized on write with per-tensor scales of 1.0, "
    "upcast inside attention.",
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
@click.option(
    "--task",
    type=click.Choice(["generate", "embed"]),
    default=None,
    help="generate: completions and chat; embed: serve the checkpoint as an embedding model (/v1/embeddings: "
    "prefill-only passes, hidden states after the final norm pooled per prompt). Default: generate.",
)
@click.option(
    "--runner",
    type=click.Choice(["generate", "pooling"]),
    default=None,
    help="vLLM's spelling of --task: pooling = embed.",
)
@click.option(
    "--pooling-type",
    type=click.Choice(["last", "mean", "cls"], case_sensitive=False),
    default=None,
    help="With --task embed: how a prompt's hidden states become one vector. Default: the checkpoint's "
    "sentence-transformers config (modules.json, 1_Pooling/config.json), else last (decoder embedding models).",
)
@click.option(
    "--allow-any-dimensions",
    is_flag=True,
    default=False,
    help="With --task embed: accept `dimensions` (truncate, then normalise) even when config.json does not say the "
    "model was trained for it (is_matryoshka, matryoshka_dimensions).",
)
@click.option(
    "--speculative-config",
    "speculative_config",
    default=None,
    help='Speculative decoding, as vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": K, '
    '"prompt_lookup_max": N, "prompt_lookup_min": M} or {"method": "draft_model", "model": DIR, '
    '"num_speculative_tokens": K} (a small model of the same vocabulary, with its own KV cache); K below the '
    "block size. Drafts are verified "
    "in the same forward pass; greedy output is unchanged and sampled output keeps the model's distribution.",
)
@click.option(
    "--tensor-parallel-size",
    type=click.IntRange(min=1),
    default=1,
    help="Devices (worker processes) this executor spans: heads, MLP rows and the vocabulary split over them "
    "(cuda:N..N+size-1 on CUDA, gloo between processes on the CPU). One pool at blockd either way.",
)
@click.option(
    "--enable-expert-parallel/--no-enable-expert-parallel",
    default=False,
    help="With --tensor-parallel-size: split MoE experts whole by rank instead of slicing every expert.",
)
@click.option(
    "--tensor-parallel-timeout",
    type=click.FloatRange(min=0.5),
    default=DEFAULT_TP_TIMEOUT_S,
    help="Seconds a collective of the group may wait for a rank (dead or paused) before the whole group stops.",
)
@click.option(
    "--tp-rank",
    type=click.IntRange(min=0),
    default=None,
    help="With --tp-master: this process's rank in a group whose ranks are started apart (one per node or pod): "
    "0 is the leader (talks to blockd and the gateways), 1..N-1 its workers. Default: LWS_WORKER_INDEX, else 0.",
)
@click.option(
    "--tp-master",
    default=None,
    metavar="HOST:PORT",
    help="The leader's join address, for ranks started apart: the leader listens there, the workers ask it to "
    "admit them (CURVE, with --keys: a worker needs an executor key for this pool). Default: LWS_LEADER_ADDRESS "
    "and port 5570 in a LeaderWorkerSet, else none: rank 0 starts its workers itself, on this machine.",
)
@click.option(
    "--tensor-parallel-join-timeout",
    type=click.FloatRange(min=1),
    default=STARTUP_TIMEOUT_S,
    help="With --tp-master: seconds the leader waits for every worker to join (and a worker for the leader to "
    "admit it) before giving up.",
)
@click.option(
    "--host-kv-memory",
    default="0",
    help="Bytes of host memory (pinned on CUDA) for KV blocks evicted from the device, which blockd loads back on "
    "a prefix hit (e.g. 8GiB; 0: no host tier).",
)
@click.option(
    "--disk-kv-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="A directory of this executor's for KV blocks (checksummed files): they survive restarts of the executor.",
)
@click.option("--disk-kv-size", default="0", help="Bytes the --disk-kv-dir tier may hold (e.g. 64GiB).")
@click.option(
    "--shared-kv-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    envvar="PAGEDKV_EXECUTOR_SHARED_KV_DIR",
    help="A directory every executor of the deployment mounts (a shared volume): each block this executor computes "
    "is written there behind, and any executor of the same model and KV layout loads it on a prefix hit; it "
    "survives restarts of the whole stack.",
)
@click.option(
    "--shared-kv-size",
    default="0",
    envvar="PAGEDKV_EXECUTOR_SHARED_KV_SIZE",
    help="Bytes the --shared-kv-dir tier holds (e.g. 1TiB); blockd takes the first executor's figure.",
)
@keys_option(
    "Key directory (`pagedkv keys generate DIR`): serve gateways over CURVE only, and reach blockd with this "
    "pool's executor key (pool-POOL, else executor).",
)
@insecure_option("Allow --bind beyond loopback without --keys (anyone who reaches the port may submit).")
@click.option(
    "--fault-embed-error",
    "embed_fault",
    type=click.IntRange(min=1),
    default=None,
    hidden=True,
    help="TEST ONLY, fault injection: embedding pass N (counted from 1) raises.",
)
@click.option(
    "--fault-stall-step",
    "stall_spec",
    default=None,
    hidden=True,
    help="TEST ONLY, fault injection: N:SECONDS makes step N (counted from 1) last SECONDS longer.",
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
    max_step_ms,
    scheduling_policy,
    dtype,
    kv_cache_dtype,
    kernels,
    seed,
    adapt_threads,
    pin_threads,
    blockd_wait,
    pool_wait,
    max_message_bytes,
    max_queued_requests,
    task,
    runner,
    pooling_type,
    allow_any_dimensions,
    speculative_config,
    tensor_parallel_size,
    enable_expert_parallel,
    tensor_parallel_timeout,
    tp_rank,
    tp_master,
    tensor_parallel_join_timeout,
    host_kv_memory,
    disk_kv_dir,
    disk_kv_size,
    shared_kv_dir,
    shared_kv_size,
    keys_dir,
    insecure,
    embed_fault,
    stall_spec,
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
    try:
        where = placement(tensor_parallel_size, tp_rank, tp_master, os.environ)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    tensor_parallel_size = where.size
    if where.independent:  # the join and the store are reached beyond loopback like any other link
        refusal = unkeyed_refusal("the tensor-parallel group", f"tcp://{where.master}", keys_dir, insecure)
        if refusal:
            raise click.UsageError(refusal)
    if where.rank > 0:
        _run_worker(where, model_dir, device, keys_dir, pool_id, tensor_parallel_join_timeout, log_level)
        return
    embed = _embedding_task(task, runner)
    if embed and kv_cache_dtype != "auto":  # an embedding pass keeps its own scratch cache, in the model's dtype
        raise click.UsageError("--kv-cache-dtype applies to generation; an embedding executor keeps no KV cache")
    if not embed and (pooling_type or allow_any_dimensions):
        raise click.UsageError("--pooling-type and --allow-any-dimensions apply to --task embed only")
    if embed and tensor_parallel_size > 1:  # the embedder runs the model on rank 0 alone
        raise click.UsageError("--task embed runs on one device: --tensor-parallel-size 1")
    if kv_cache_dtype != "auto" and tensor_parallel_size > 1:  # the worker ranks allocate their caches unquantized
        raise click.UsageError("--kv-cache-dtype fp8 runs with --tensor-parallel-size 1 only, for now")
    speculative = _speculative(speculative_config, embed, tensor_parallel_size, int(block_size))
    if max_num_batched_tokens < max_num_seqs:
        raise click.BadParameter("must be at least --max-num-seqs", param_hint="--max-num-batched-tokens")
    budget: KvBudget = parse_kv_budget(kv_cache_memory, device)
    host_kv_bytes, disk_kv_bytes = _tier_sizes(host_kv_memory, disk_kv_dir, disk_kv_size)
    shared_kv_bytes = _shared_size(shared_kv_dir, shared_kv_size)
    if (host_kv_bytes or disk_kv_bytes or shared_kv_bytes) and (embed or tensor_parallel_size > 1):
        raise click.UsageError(
            "--host-kv-memory, --disk-kv-dir and --shared-kv-dir run with generation on one device, for now"
        )
    stall = _stall(stall_spec) if stall_spec else None
    try:
        message_limit = parse_size(max_message_bytes)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--max-message-bytes") from None
    if model_dir is None:
        from common.default_model import ensure_default_model

        model_dir = ensure_default_model()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    block_size_int = int(block_size)
    pool_id = pool_id or _default_pool_id(bind, device)
    parallel = None
    if tensor_parallel_size > 1:
        parallel = _start_group(
            where,
            enable_expert_parallel,
            tensor_parallel_timeout,
            model_dir,
            device,
            dtype,
            kernels,
            block_size_int,
            log_level,
            _Admission(keys_dir, pool_id, tensor_parallel_join_timeout),
        )
    log.info("loading_model", model=str(model_dir), device=str(device), tensor_parallel_size=tensor_parallel_size)
    try:
        loaded = load_model(model_dir, device, None if dtype == "auto" else DTYPES[dtype], parallel and parallel[0])
    except (CheckpointError, UnsupportedModel) as exc:
        raise click.ClickException(str(exc)) from None
    loaded = dataclasses.replace(loaded, kv_cache_dtype=kv_cache_dtype)
    embedder = None
    if embed:  # its own scratch cache per pass (executor.pooling); the pool at blockd holds one block, unused
        try:
            pooling = read_pooling_config(loaded.model_dir, pooling_type, allow_any_dimensions)
        except PoolingConfigError as exc:
            raise click.ClickException(str(exc)) from None
        embedder = Embedder(
            loaded.model,
            loaded.config,
            pooling,
            device=device,
            dtype=loaded.dtype,
            block_size=int(block_size),
            max_batch_tokens=max_num_batched_tokens,
            backend=kernels,
        )
        log.info("embedding_model", pooling=pooling.type.value, normalize=pooling.normalize)
    blocks = (
        1 if embed else resolve_num_blocks(num_blocks, budget, loaded.config, block_size_int, loaded.kv_dtype, device)
    )
    group_runner = None
    if parallel is not None:
        group_runner = _parallel_runner(loaded, blocks, block_size_int, kernels, tensor_parallel_timeout)
    keys = curve = None
    if keys_dir is not None:
        try:
            keys = KeySet(keys_dir)
            curve = keys.executor_client(pool_id)
        except KeysError as exc:
            raise click.ClickException(str(exc)) from None
    # A short retry window: while blockd is away the loop goes back to answering gateways between attempts.
    try:
        engine = Engine.assemble(
            loaded,
            blockd_endpoint,
            pool_id=pool_id,
            num_blocks=blocks,
            block_size=block_size_int,
            limits=EngineLimits(
                max_num_seqs, max_num_batched_tokens, max_step_ms or None, scheduling_policy, speculative
            ),
            backend=kernels,
            seed=seed,
            retry_for_s=2.0,
            curve=curve,
            adapt_threads=adapt_threads,
            pin_threads=pin_threads,
            runner=group_runner,
        )
    except SpeculativeConfigError as exc:  # (a draft model that does not fit the target)
        raise click.BadParameter(str(exc), param_hint="--speculative-config") from None
    model_runner = engine.runner
    store = None
    if host_kv_bytes or disk_kv_bytes or shared_kv_bytes:
        if any(loaded.config.sliding_windows):  # (windowed and layer-grouped pools have no tiers yet)
            raise click.UsageError(
                "--host-kv-memory, --disk-kv-dir and --shared-kv-dir need a model without sliding-window layers, "
                "for now"
            )
        layout = kv_layout(loaded, block_size_int)
        shared = None
        if shared_kv_dir is not None:
            try:
                shared = SharedStore(layout, shared_kv_dir, shared_kv_bytes)
            except OSError as exc:
                raise click.BadParameter(f"{shared_kv_dir}: {exc}", param_hint="--shared-kv-dir") from None
            if shared.blocks == 0:
                raise click.BadParameter(f"holds no block of {layout.file_bytes} bytes", param_hint="--shared-kv-size")
        store = TierStore(
            layout,
            model_runner.kv_caches,
            host_bytes=host_kv_bytes,
            disk_dir=disk_kv_dir,
            disk_bytes=disk_kv_bytes,
            shared=shared,
        )
        engine.model_step.tiers = store
        engine.pool.tiers = store.spec
        engine.pool.tier_drops = store.take_drops
        engine.pool.shared_reports = store.take_shared_reports
        log.info(
            "kv_tiers",
            host_blocks=store.host_blocks,
            disk_blocks=store.disk_blocks,
            disk_held=len(store.disk),
            shared_blocks=shared.blocks if shared is not None else 0,
            shared_id=shared.shared_id if shared is not None else None,
        )
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
        task="embed" if embed else "generate",
    )
    auth = None
    if keys is not None:
        try:
            auth = ServerAuth(zmq.Context.instance(), keys, (Role.GATEWAY, Role.OPERATOR))
        except KeysError as exc:
            raise click.ClickException(str(exc)) from None
    server = ExecutorServer(
        engine,
        bind,
        info,
        max_message_bytes=message_limit,
        max_queued_requests=max_queued_requests,
        auth=auth,
        stall=stall,
        embedder=embedder,
        embed_fault=None if embed_fault is None else EmbedFault(embed_fault),
    )
    log.info(
        "executor_ready",
        model=str(model_dir),
        architecture=loaded.config.architecture,
        model_id=loaded.config.model_id,
        parameters=sum(p.numel() for p in loaded.model.parameters()),
        max_model_len=loaded.config.max_model_len,
        dtype=str(loaded.dtype).removeprefix("torch."),
        kv_cache_dtype=str(loaded.kv_dtype).removeprefix("torch."),
        device=str(device),
        load_s=round(loaded.load_s, 2),
        kv_blocks=blocks,
        kv_tokens=blocks * block_size_int,
        kv_bytes=model_runner.kv_cache_bytes,
        kernels=kernels,
        max_step_ms=max_step_ms or None,
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
    finally:
        if store is not None:
            store.flush()  # the writes behind, on disk before the process goes
        if parallel is not None:
            _stop_group(group_runner, parallel[1])
    log.info("executor_stopped", pool_id=pool_id)


def _tier_sizes(host: str, disk_dir: Path | None, disk: str) -> tuple[int, int]:
    try:
        host_bytes = parse_size(host)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--host-kv-memory") from None
    try:
        disk_bytes = parse_size(disk)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--disk-kv-size") from None
    if (disk_dir is None) != (disk_bytes == 0):
        raise click.UsageError("--disk-kv-dir and --disk-kv-size go together")
    return host_bytes, disk_bytes


def _shared_size(directory: Path | None, size: str) -> int:
    try:
        shared_bytes = parse_size(size)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--shared-kv-size") from None
    if (directory is None) != (shared_bytes == 0):
        raise click.UsageError("--shared-kv-dir and --shared-kv-size go together")
    return shared_bytes


def _stall(spec: str) -> StepStall:
    step, _, seconds = spec.partition(":")
    try:
        stall = StepStall(int(step), float(seconds))
    except ValueError:
        raise click.BadParameter(f"{spec!r} is not N:SECONDS", param_hint="--fault-stall-step") from None
    if stall.step < 1 or stall.seconds < 0:
        raise click.BadParameter("N is at least 1 and SECONDS at least 0", param_hint="--fault-stall-step")
    log.warning("fault_injection_armed", option="--fault-stall-step", step=stall.step, seconds=stall.seconds)
    return stall


def _embedding_task(task: str | None, runner: str | None) -> bool:
    """Whether --task / --runner ask for an embedding model; they must agree when both are given."""
    from_runner = None if runner is None else runner == "pooling"
    from_task = None if task is None else task == "embed"
    if from_runner is not None and from_task is not None and from_runner != from_task:
        raise click.UsageError(f"--task {task} and --runner {runner} disagree")
    return bool(from_task or from_runner)


@dataclasses.dataclass(frozen=True)
class _Admission:
    """For a group whose ranks are started apart: the keys the leader admits workers by, and for how long."""

    keys_dir: Path | None
    pool_id: str
    timeout_s: float


def _run_worker(
    where: Placement, model_dir: Path | None, device: torch.device, keys_dir: Path | None, pool_id: str | None,
    timeout_s: float, log_level: str,
) -> None:  # fmt: skip
    """Rank 1..N-1 started apart: admitted by the leader (with keys: this pool's executor key, else the any-pool
    one), then its share of every step until the leader says stop."""
    from executor.parallel_worker import join, run_apart  # the worker's modules, only where one runs

    if model_dir is None:
        from common.default_model import ensure_default_model

        model_dir = ensure_default_model()
    try:
        curve = KeySet(keys_dir).executor_client(pool_id or "") if keys_dir is not None else None
        spec = join(where, model_dir, device, curve=curve, timeout_s=timeout_s, log_level=log_level)
    except (KeysError, RendezvousError, CheckpointError) as exc:
        raise click.ClickException(str(exc)) from None
    run_apart(spec)


def _start_group(
    where: Placement,
    expert_parallel: bool,
    timeout_s: float,
    model_dir: Path,
    device: torch.device,
    dtype: str,
    kernels: str,
    block_size: int,
    log_level: str,
    admission: _Admission,
) -> tuple[Shard, WorkerGroup]:
    """Ranks 1..size-1 started (or, started apart, admitted) and joined; rank 0's shard of the model (refused
    early if it does not split)."""
    size = where.size
    try:
        config = load_config(model_dir)
        shard = make_shard(config, 0, size, expert_parallel)
    except (CheckpointError, UnsupportedModel) as exc:
        raise click.ClickException(str(exc)) from None
    if where.independent:
        settings = GroupSettings(
            free_port(), new_token(), config.model_id, dtype, kernels, block_size, expert_parallel, timeout_s
        )
        try:
            keys = KeySet(admission.keys_dir) if admission.keys_dir is not None else None
            group = WorkerGroup.admit(
                where, settings, device, keys=keys, pool_id=admission.pool_id, join_timeout_s=admission.timeout_s
            )
        except (KeysError, RendezvousError, GroupIntruder) as exc:
            log.error("tensor_parallel_join_failed", reason=str(exc))
            raise click.ClickException(str(exc)) from None
        log.info("tensor_parallel_group_joined", size=size, expert_parallel=expert_parallel, leader=where.master)
        return shard, group
    if device.type == "cuda" and (device.index or 0) + size > torch.cuda.device_count():
        raise click.BadParameter(
            f"{size} ranks from {device} need more than this machine's {torch.cuda.device_count()} CUDA devices",
            param_hint="--tensor-parallel-size",
        )
    if device.type == "cpu":
        torch.set_num_threads(max(1, torch.get_num_threads() // size))  # the ranks share the cores
    group = WorkerGroup.start(
        size,
        model_dir,
        device,
        dtype=dtype,
        backend=kernels,
        block_size=block_size,
        expert_parallel=expert_parallel,
        timeout_s=timeout_s,
        log_level=log_level,
    )
    log.info("tensor_parallel_group_joined", size=size, expert_parallel=expert_parallel, workers=group.pids)
    return shard, group


def _parallel_runner(loaded: LoadedModel, blocks: int, block_size: int, kernels: str, timeout_s: float) -> ModelRunner:
    """Rank 0's runner; the workers size their caches by rank 0's count (one pool, one set of block ids)."""
    broadcast_int(blocks, loaded.device)
    return ParallelRunner(loaded, num_blocks=blocks, block_size=block_size, backend=kernels, ping_s=timeout_s / 3)  # type: ignore[arg-type]


def _stop_group(runner: ModelRunner | None, group: WorkerGroup) -> None:
    group.expect_exit()
    if isinstance(runner, ParallelRunner):
        runner.close()
    group.stop()


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


if __name__ == "__main__":  # pragma: no cover
    main()
