"""`pagedkv bench peer`'s workloads: seeded requests, some groups of them sharing a prefix, and each system's
warm-up."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from pagedkv.bench.throughput import BenchRequest, make_workload

#: Requests (and output tokens each, at most) of every system's warm-up.
WARMUP_REQUESTS = 16
WARMUP_OUTPUT = 16


@dataclass(frozen=True)
class WorkloadSpec:
    name: str
    requests: int
    prompt_range: tuple[int, int]  # with a shared prefix: the length of each request's own part after it
    output_range: tuple[int, int]
    prefix_len: int = 0  # > 0: consecutive groups of `group_size` requests share a prefix of this many tokens
    group_size: int = 1

    def describe(self) -> str:
        text = f"{self.requests} requests, "
        if self.prefix_len:
            groups = -(-self.requests // self.group_size)
            text += (
                f"{groups} groups of {self.group_size} sharing a {self.prefix_len}-token prefix, then "
                f"{self.prompt_range[0]}-{self.prompt_range[1]} tokens of their own, "
            )
        else:
            text += f"prompts {self.prompt_range[0]}-{self.prompt_range[1]}, "
        return text + f"outputs {self.output_range[0]}-{self.output_range[1]} tokens"


WORKLOADS: dict[str, WorkloadSpec] = {
    "default": WorkloadSpec("default", 256, (16, 256), (16, 256)),
    "long": WorkloadSpec("long", 96, (16, 256), (16, 1024)),
    "prefix": WorkloadSpec("prefix", 256, (16, 256), (16, 256), prefix_len=512, group_size=16),
}
QUICK_WORKLOADS: dict[str, WorkloadSpec] = {
    "default": WorkloadSpec("default", 8, (8, 32), (8, 32)),
    "long": WorkloadSpec("long", 4, (8, 32), (8, 96)),
    "prefix": WorkloadSpec("prefix", 8, (8, 16), (8, 32), prefix_len=32, group_size=4),
}


def build_workload(spec: WorkloadSpec, vocab_size: int, special_ids: set[int], seed: int) -> list[BenchRequest]:
    """The workload's seeded requests: `make_workload`'s, with each group's shared prefix put in front."""
    requests = make_workload(spec.requests, spec.prompt_range, spec.output_range, vocab_size, special_ids, seed)
    if not spec.prefix_len:
        return requests
    rng = random.Random(f"{seed}-prefix")
    allowed = [t for t in range(vocab_size) if t not in special_ids]
    prefixes: dict[int, list[int]] = {}
    shared = []
    for i, r in enumerate(requests):
        prefix = prefixes.setdefault(i // spec.group_size, rng.choices(allowed, k=spec.prefix_len))
        shared.append(BenchRequest(r.request_id, prefix + r.prompt, r.output_len))
    return shared


def warmup_requests(requests: Sequence[BenchRequest]) -> list[BenchRequest]:
    return [
        BenchRequest(f"warm-{r.request_id}", r.prompt, min(r.output_len, WARMUP_OUTPUT))
        for r in requests[:WARMUP_REQUESTS]
    ]
