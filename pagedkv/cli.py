"""The umbrella command `pagedkv`: serve (a whole local stack), make-model, benchmarks."""

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


def unless_given(ctx: click.Context, value: object, name: str, fallback: object) -> object:
    """`fallback` if the option `name` was left at its default (a bench's --quick), else what was given."""
    return fallback if ctx.get_parameter_source(name) is click.core.ParameterSource.DEFAULT else value


@click.group(cls=LazyGroup, lazy={"make-model": "executor.make_model:make_model", "serve": "pagedkv.serve:serve"})
@click.version_option(package_name="pagedkv")
def main() -> None:
    """pagedkv: LLM serving around PagedAttention."""


@main.group(
    cls=LazyGroup,
    lazy={
        "blockd": "blockd.bench:bench_blockd",
        "kernels": "kernels.bench:bench_kernels",
        "capacity": "blockd.capacity:bench_capacity",
        "throughput": "executor.bench:bench_throughput",
        "serve": "gateway.bench:bench_serve",
    },
)
def bench() -> None:
    """Benchmarks. Each prints progress and tables, and as its last line one JSON object of its figures."""
