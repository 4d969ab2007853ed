"""What several benchmarks share: plain text tables, a throwaway blockd daemon on a free loopback port, and the
workload length options."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

import click

from blockd.client import BlockdClient, BlockdUnavailable
from common import processes
from common.net import free_port

F = TypeVar("F", bound=Callable[..., object])


def table_lines(columns: Sequence[str], rows: Sequence[Sequence[str]], *, left: int = 1) -> list[str]:
    """A plain text table, header first: the first `left` columns left-aligned, the others right-aligned."""
    widths = [max([len(c), *(len(row[i]) for row in rows)]) for i, c in enumerate(columns)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.ljust(w) if i < left else v.rjust(w) for i, (v, w) in enumerate(zip(values, widths)))

    return [line(columns), *(line(row) for row in rows)]


def start_blockd(endpoint: str, flags: Sequence[str], log: Path, timeout_s: float = 30.0) -> subprocess.Popen[bytes]:
    """A blockd process at `endpoint` with these flags, its output appended to `log`; returns once it answers."""
    process = processes.start(
        [sys.executable, "-m", "blockd.main", "--endpoint", endpoint, "--log-level", "warning", *flags], log
    )

    def alive() -> None:
        if process.poll() is not None:
            raise processes.NotReady(f"blockd {processes.describe_exit(process.returncode)}")

    try:
        with BlockdClient(endpoint, timeout_s=0.5) as client:
            # Each ask waits out the client's timeout: no sleep between them.
            processes.wait_until(processes.answer(client.pools, BlockdUnavailable), timeout_s, check=alive, poll_s=0)
    except processes.NotReady:
        processes.stop([process])
        raise click.ClickException(f"blockd did not start; see {log}") from None
    return process


@contextlib.contextmanager
def blockd_daemon(log: Path, *flags: str) -> Iterator[str]:
    """A blockd process on a free loopback port with these flags; yields its endpoint and stops it after."""
    with blockd_process(log, *flags) as (endpoint, _):
        yield endpoint


@contextlib.contextmanager
def blockd_process(log: Path, *flags: str) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """As `blockd_daemon`, yielding the process too (to account for its CPU time)."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    process = start_blockd(endpoint, flags, log)
    try:
        yield endpoint, process
    finally:
        processes.stop([process])


def length_range_option(flag: str, default: tuple[int, int], help: str) -> Callable[[F], F]:
    """A `MIN MAX` option of two positive token counts (a workload's prompt or output lengths); MIN above MAX is
    a usage error."""

    def check(_ctx: click.Context, _param: click.Parameter, value: tuple[int, int]) -> tuple[int, int]:
        if value[0] > value[1]:
            raise click.BadParameter(f"MIN {value[0]} is above MAX {value[1]}")
        return value

    return click.option(
        flag,
        type=(click.IntRange(min=1), click.IntRange(min=1)),
        default=default,
        show_default=True,
        callback=check,
        help=help,
    )


def requests_option(default: int, help: str) -> Callable[[F], F]:
    """`--requests N`: how many requests a benchmark's workload holds."""
    return click.option(
        "--requests", "num_requests", type=click.IntRange(min=1), default=default, show_default=True, help=help
    )


def threads_option(help: str) -> Callable[[F], F]:
    """`--threads N`: torch intra-op threads (default: torch's own choice, one per core)."""
    return click.option("--threads", type=click.IntRange(min=1), default=None, help=help)


def log_tail(path: Path) -> str:
    """The end of a child's log (common.processes.tail), indented under the message that quotes it."""
    return "\n".join("  " + line for line in (processes.tail(path) or "(no log, or empty)").splitlines())
