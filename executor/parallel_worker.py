"""A worker of a tensor-parallel group (ranks 1..N-1), started by rank 0 (`executor.parallel_group`): join the
group, load this rank's slices of the model, hold this rank's heads of every KV block, run each op rank 0 sends.

It never talks to blockd or to a gateway. Exit status 0 when rank 0 says stop; non-zero when a collective fails
(rank 0 died or a peer stopped answering past the timeout); SIGTERM from the kernel when rank 0 exits.
"""

from __future__ import annotations

import sys

import structlog
import torch
import torch.distributed as dist

from common.logs import configure_logging
from executor.checkpoint import load_config
from executor.parallel import init_group, make_shard
from executor.parallel_group import WorkerSpec
from executor.parallel_runner import broadcast_int, serve_worker
from executor.runner import DTYPES, ModelRunner, load_model

log = structlog.get_logger("executor")


def run(spec: WorkerSpec) -> None:
    device = torch.device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, torch.get_num_threads() // spec.world))
    init_group(spec.rank, spec.world, spec.port, device, spec.timeout_s)
    shard = make_shard(load_config(spec.model_dir), spec.rank, spec.world, spec.expert_parallel)
    loaded = load_model(spec.model_dir, device, None if spec.dtype == "auto" else DTYPES[spec.dtype], shard)
    num_blocks = broadcast_int(0, device)
    runner = ModelRunner(loaded, num_blocks=num_blocks, block_size=spec.block_size, backend=spec.backend)  # type: ignore[arg-type]
    log.info("tensor_parallel_worker_ready", rank=spec.rank, world=spec.world, device=str(device), kv_blocks=num_blocks)
    serve_worker(runner)
    dist.destroy_process_group()
    log.info("tensor_parallel_worker_stopped", rank=spec.rank)


def main() -> None:
    spec = WorkerSpec.from_json(sys.argv[1])
    configure_logging("executor", spec.log_level)
    run(spec)


if __name__ == "__main__":  # pragma: no cover
    main()
