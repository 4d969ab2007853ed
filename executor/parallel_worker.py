"""A worker of a tensor-parallel group (ranks 1..N-1), started by rank 0 (`executor.parallel_group`), or apart
(`pagedkv-executor --tp-rank R --tp-master HOST:PORT`, one per node or pod: `join` asks the leader to admit it
first): join the group, load this rank's slices of the model, hold this rank's heads of every KV block, run each
op rank 0 sends.

It never talks to blockd or to a gateway. Exit status 0 when rank 0 says stop; non-zero when a collective fails
(rank 0 died or a peer stopped answering past the timeout: 70 for a worker started apart); SIGTERM from the
kernel when a rank 0 that started it exits.
"""

from __future__ import annotations

import sys
from pathlib import Path

import structlog
import torch
import torch.distributed as dist

from common.auth import ClientCurve
from common.logs import configure_logging
from executor.checkpoint import load_config
from executor.parallel import destroy_group, init_group, make_shard
from executor.parallel_group import WorkerSpec
from executor.parallel_rendezvous import Placement, join_leader
from executor.parallel_runner import broadcast_int, fail, serve_worker
from executor.runner import DTYPES, ModelRunner, load_model

log = structlog.get_logger("executor")


def join(
    where: Placement, model_dir: Path, device: torch.device, *, curve: ClientCurve | None, timeout_s: float,
    log_level: str,
) -> WorkerSpec:  # fmt: skip
    """A worker started apart: admitted by the leader (RendezvousError if not), the group's settings from it."""
    settings = join_leader(where, load_config(model_dir).model_id, curve=curve, timeout_s=timeout_s)
    log.info("tensor_parallel_admitted", rank=where.rank, world=where.size, leader=where.master)
    return WorkerSpec(
        where.rank,
        where.size,
        settings.store_port,
        str(model_dir),
        str(device),
        settings.dtype,
        settings.backend,
        settings.block_size,
        settings.expert_parallel,
        settings.timeout_s,
        log_level,
        master=where.host,
        token=settings.token,
    )


def run_apart(spec: WorkerSpec) -> None:
    """A worker started apart serves until rank 0 says stop; a failed collective stops it with exit 70."""
    try:
        run(spec, share_cores=False)
    except (RuntimeError, dist.DistError) as exc:
        fail(f"rank {spec.rank}: {exc}")


def run(spec: WorkerSpec, share_cores: bool = True) -> None:
    """`share_cores`: on the CPU, rank 0 and its children share one machine's cores."""
    device = torch.device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif share_cores:
        torch.set_num_threads(max(1, torch.get_num_threads() // spec.world))
    init_group(spec.rank, spec.world, spec.port, device, spec.timeout_s, host=spec.master, token=spec.token)
    shard = make_shard(load_config(spec.model_dir), spec.rank, spec.world, spec.expert_parallel)
    loaded = load_model(spec.model_dir, device, None if spec.dtype == "auto" else DTYPES[spec.dtype], shard)
    num_blocks = broadcast_int(0, device)
    runner = ModelRunner(loaded, num_blocks=num_blocks, block_size=spec.block_size, backend=spec.backend)  # type: ignore[arg-type]
    log.info("tensor_parallel_worker_ready", rank=spec.rank, world=spec.world, device=str(device), kv_blocks=num_blocks)
    serve_worker(runner)
    destroy_group()
    log.info("tensor_parallel_worker_stopped", rank=spec.rank)


def main() -> None:
    spec = WorkerSpec.from_json(sys.argv[1])
    configure_logging("executor", spec.log_level)
    run(spec)


if __name__ == "__main__":  # pragma: no cover
    main()
