"""Tensor and expert parallelism inside one executor: the process group of its N ranks and what each rank holds.

Rank 0 is the executor the rest of the system sees, ranks 1..N-1 its workers (`executor.parallel_worker`); each
holds a `Shard` of the model (Megatron-style). The split and the group: docs/architecture.md ("Tensor
parallelism").
"""

from __future__ import annotations

import dataclasses
import hmac
import socket
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from executor.model_config import ModelConfig, UnsupportedModel

DEFAULT_TIMEOUT_S = 30.0
STARTUP_TIMEOUT_S = 600.0  # joining and loading: a big checkpoint takes minutes, and a rank that fails exits


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of `world`: the slices of the model it holds. Ranges are [start, stop) of the full model's."""

    rank: int
    world: int
    expert_parallel: bool
    heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]  # stop may pass vocab_size: the last shard is padded so all shards are one size
    experts: tuple[int, int]  # expert parallel: whole experts; else every expert
    moe_intermediate: tuple[int, int]  # tensor-sliced experts: each expert's intermediate rows; else all

    @property
    def holds_reduced_bias(self) -> bool:
        return self.rank == 0

    @property
    def vocab_per_rank(self) -> int:
        return self.vocab[1] - self.vocab[0]


def _even(total: int, world: int, rank: int, what: str) -> tuple[int, int]:
    if total % world:
        raise UnsupportedModel(f"{total} {what} do not split evenly over a tensor-parallel size of {world}")
    size = total // world
    return rank * size, (rank + 1) * size


def make_shard(config: ModelConfig, rank: int, world: int, expert_parallel: bool = False) -> Shard:
    """Rank `rank`'s share of `config`'s model, or UnsupportedModel saying what does not split over `world`."""
    heads = _even(config.num_heads, world, rank, "attention heads")
    kv = config.num_kv_heads
    if kv >= world:
        kv_heads = _even(kv, world, rank, "KV heads")
    elif world % kv:
        raise UnsupportedModel(f"{kv} KV heads cannot be replicated evenly over a tensor-parallel size of {world}")
    else:  # fewer KV heads than ranks: each rank holds the one its query heads read
        group = config.num_heads // kv
        first = heads[0] // group
        kv_heads = (first, first + 1)
    intermediate = _even(config.intermediate_size, world, rank, "intermediate rows")
    per_vocab = -(-config.vocab_size // world)
    vocab = (rank * per_vocab, (rank + 1) * per_vocab)
    experts = moe_intermediate = (0, 0)
    if config.moe is not None:
        experts, moe_intermediate = (0, config.moe.num_experts), (0, config.moe.intermediate_size)
        if expert_parallel:
            experts = _even(config.moe.num_experts, world, rank, "experts")
        else:
            moe_intermediate = _even(config.moe.intermediate_size, world, rank, "expert intermediate rows")
    return Shard(rank, world, expert_parallel, heads, kv_heads, intermediate, vocab, experts, moe_intermediate)


def local_config(config: ModelConfig, shard: Shard) -> ModelConfig:
    """The model one rank builds: its heads, its rows and its experts. The vocabulary stays the full one (the
    rest of the executor samples from full logits); the parallel embedding and head hold their rows."""
    moe = config.moe
    if moe is not None:  # every expert still (the router chooses among all); `Shard.experts` says which are here
        moe = dataclasses.replace(moe, intermediate_size=shard.moe_intermediate[1] - shard.moe_intermediate[0])
    return dataclasses.replace(
        config,
        num_heads=shard.heads[1] - shard.heads[0],
        num_kv_heads=shard.kv_heads[1] - shard.kv_heads[0],
        intermediate_size=shard.intermediate[1] - shard.intermediate[0],
        moe=moe,
    )


class Collectives:
    """The model's collective ops over the group (the only traffic a step adds besides the plan's broadcast)."""

    def __init__(self, shard: Shard) -> None:
        self.shard = shard
        self.seconds = 0.0  # time spent in collectives, for the step's measurement

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        all_reduce(x)
        self.seconds += time.perf_counter() - started
        return x

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """[L, vocab_per_rank] on each rank -> [L, vocab_size] on each rank."""
        started = time.perf_counter()
        parts = [torch.empty_like(logits) for _ in range(self.shard.world)]
        all_gather(parts, logits.contiguous())
        self.seconds += time.perf_counter() - started
        return torch.cat(parts, dim=-1)[:, :vocab_size]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_serving: list[dist.ProcessGroup] = []  # the group the step's collectives run on, once joined


class GroupIntruder(RuntimeError):
    """A rank of the group does not hold the group's token: a process that was not admitted reached the store."""


def init_group(
    rank: int, world: int, port: int, device: torch.device, timeout_s: float, *, host: str = "127.0.0.1", token: str
) -> None:
    """Join the group's rendezvous at host:port (rank 0 hosts the store: on loopback when it started its workers,
    at its own address when they were started apart). The default group, for startup (ranks load at their own
    pace), waits up to STARTUP_TIMEOUT_S; the serving group's collectives (`broadcast`, `all_reduce`,
    `all_gather`) fail after `timeout_s` if a rank does not take part (dead or paused), and the group then stops
    as a unit. Before anything else every rank proves it holds `token` (GroupIntruder if one does not)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://{host}:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=STARTUP_TIMEOUT_S),
    )
    try:
        prove_membership(rank, world, token, device)
    except GroupIntruder:
        destroy_group()  # a refused rank exits with its own error, not an abort from the group's destructors
        raise
    _serving[:] = [dist.new_group(backend=backend, timeout=timedelta(seconds=timeout_s))]


def _proof(token: str, rank: int, world: int) -> list[int]:
    return list(hmac.digest(bytes.fromhex(token), f"pagedkv tensor-parallel rank {rank} of {world}".encode(), "sha256"))


def prove_membership(rank: int, world: int, token: str, device: torch.device) -> None:
    """Every rank shows every other an HMAC of its rank under the group's token (handed out only to admitted
    ranks: over CURVE, or on rank 0's command line to its children); the store itself admits anyone who reaches
    it, so this is what keeps a stranger out of the group's collectives."""
    mine = torch.tensor(_proof(token, rank, world), dtype=torch.int64, device=device)
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine)
    for other, part in enumerate(parts):
        if not hmac.compare_digest(bytes(part.tolist()), bytes(_proof(token, other, world))):
            raise GroupIntruder(f"rank {other} of the group does not hold the group's token: it was not admitted")


def destroy_group() -> None:
    """Leave the group before the interpreter exits: process groups (and rank 0's store) left to the C++
    destructors at exit abort the process ("terminate called without an active exception")."""
    _serving.clear()
    if dist.is_initialized():
        dist.destroy_process_group()


def broadcast(x: torch.Tensor) -> None:
    """Rank 0's `x` into every rank's `x`, on the serving group."""
    dist.broadcast(x, src=0, group=_serving[0])


def all_reduce(x: torch.Tensor) -> None:
    dist.all_reduce(x, group=_serving[0])


def all_gather(parts: list[torch.Tensor], x: torch.Tensor) -> None:
    dist.all_gather(parts, x, group=_serving[0])
