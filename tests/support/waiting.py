"""Waiting for a condition instead of sleeping for a guess: poll it until it holds or a deadline passes."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(
    predicate: Callable[[], T], timeout_s: float = 10.0, interval_s: float = 0.05, what: str = "condition"
) -> T:
    """Poll `predicate()` until it returns something truthy and return that; AssertionError naming `what` once
    `timeout_s` has passed without it (the last try comes after the deadline, so a late poll is never what
    fails the wait)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)
