"""Waiting for a condition instead of sleeping for a guess: poll it until it holds or a deadline passes; or, to
show that something does not happen, poll that it keeps holding for a while. Each has a twin for an event loop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Generator
from typing import Any, TypeVar

T = TypeVar("T")

_Tries = Generator[None, None, Any]


def _until(predicate: Callable[[], T], timeout_s: float, what: str, retry_on: tuple[type[Exception], ...]) -> _Tries:
    """The tries of a wait: yields between them (the caller sleeps), returns the first truthy value; the last try
    comes after the deadline, so a late poll is never what fails the wait."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while True:
        try:
            value = predicate()
        except retry_on as exc:  # not yet: a peer that does not answer yet, say
            value, last = None, f"; last: {type(exc).__name__}: {exc}"
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}{last}")
        yield


def _throughout(predicate: Callable[[], object], duration_s: float, what: str) -> _Tries:
    """The tries of a watch: fails at the first try that finds `predicate()` falsy, returns once `duration_s` has
    passed with every try truthy (the last try comes after it)."""
    end = time.monotonic() + duration_s
    while True:
        started = time.monotonic()
        assert predicate(), f"{what} stopped holding {started - end + duration_s:.2f} s into {duration_s} s"
        if started > end:
            return None
        yield


def _run(tries: _Tries, interval_s: float) -> Any:
    try:
        while True:
            next(tries)
            time.sleep(interval_s)
    except StopIteration as done:
        return done.value


async def _run_async(tries: _Tries, interval_s: float) -> Any:
    try:
        while True:
            next(tries)
            await asyncio.sleep(interval_s)
    except StopIteration as done:
        return done.value


def wait_for(
    predicate: Callable[[], T],
    timeout_s: float = 10.0,
    interval_s: float = 0.05,
    what: str = "condition",
    retry_on: tuple[type[Exception], ...] = (),
) -> T:
    """Poll `predicate()` until it returns something truthy and return that; AssertionError naming `what` once
    `timeout_s` has passed without it. An exception in `retry_on` counts as a falsy try (the last is named)."""
    return _run(_until(predicate, timeout_s, what, retry_on), interval_s)


async def wait_for_async(
    predicate: Callable[[], T], timeout_s: float = 10.0, interval_s: float = 0.02, what: str = "condition"
) -> T:
    """`wait_for` on an event loop: the loop runs on between tries."""
    return await _run_async(_until(predicate, timeout_s, what, ()), interval_s)


def holds_throughout(
    predicate: Callable[[], object], duration_s: float, interval_s: float = 0.05, what: str = "condition"
) -> None:
    """Poll `predicate()` for `duration_s`: AssertionError naming `what` at the first falsy try. Only for showing
    that something does NOT happen within a time (a lease that must not expire); say why where it is used."""
    _run(_throughout(predicate, duration_s, what), interval_s)


async def holds_throughout_async(
    predicate: Callable[[], object], duration_s: float, interval_s: float = 0.02, what: str = "condition"
) -> None:
    """`holds_throughout` on an event loop: the loop runs on between tries."""
    await _run_async(_throughout(predicate, duration_s, what), interval_s)
