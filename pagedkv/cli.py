"""The umbrella command `pagedkv`: serve (a whole local stack), make-model, chaos (faults and attacks), benchmarks."""

from __future__ import annotations

import importlib

import click


class LazyGroup(click.Group):
    """A click group whose subcommands are imported on first use, so `--help` stays fast without torch."""

    def __init__(self, *args, lazy: dict[str, str] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._lazy = dict(lazy or {})

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(self._lazy))

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self._lazy:
            module_name, attr = self._lazy[name].split(":")
            return getattr(importlib.import_module(module_name), attr)
        return super().get_command(ctx, name)


@click.group(
    cls=LazyGroup,
    lazy={
        "make-model": "pagedkv.tools.model_gen.cli:make_model",
        "serve": "pagedkv.serve:serve",
        "chaos": "pagedkv.tools.chaos:chaos",
        "keys": "pagedkv.tools.keys:keys",
    },
)
@click.version_option(package_name="pagedkv")
def main() -> None:
    """pagedkv: LLM serving around PagedAttention."""


@main.group(
    cls=LazyGroup,
    lazy={
        "blockd": "pagedkv.bench.blockd:bench_blockd",
        "kernels": "pagedkv.bench.kernels:bench_kernels",
        "moe": "pagedkv.bench.moe:bench_moe",
        "capacity": "pagedkv.bench.capacity:bench_capacity",
        "throughput": "pagedkv.bench.throughput:bench_throughput",
        "speculative": "pagedkv.bench.speculative:bench_speculative",
        "tensor-parallel": "pagedkv.bench.tensor_parallel:bench_tensor_parallel",
        "tiers": "pagedkv.bench.tiers:bench_tiers",
        "serve": "pagedkv.bench.serve:bench_serve",
        "peer": "pagedkv.bench.peer:bench_peer",
    },
)
def bench() -> None:
    """Benchmarks. Each prints progress and tables, and as its last line one JSON object of its figures."""


# `python -m pagedkv.cli serve ...` (a checkout without the console script) runs the CLI instead of exiting 0
if __name__ == "__main__":
    main()
