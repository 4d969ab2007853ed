"""tests/support/waiting.py: a wait returns the first truthy try and names what it waited for when it times out;
a watch fails at the first falsy try; the event-loop twins do the same while the loop runs on."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from tests.support.waiting import holds_throughout, holds_throughout_async, wait_for, wait_for_async


def test_wait_for_returns_the_first_truthy_try() -> None:
    tries = itertools.count()
    assert wait_for(lambda: next(tries) >= 3 and "ready", interval_s=0) == "ready"
    assert next(tries) == 4


def test_wait_for_names_what_it_waited_for_and_the_last_retried_error() -> None:
    with pytest.raises(AssertionError, match=r"timed out after 0 s waiting for the answer$"):
        wait_for(lambda: None, timeout_s=0, what="the answer")

    def refuses() -> bool:
        raise ConnectionError("refused")

    with pytest.raises(AssertionError, match=r"waiting for a peer; last: ConnectionError: refused"):
        wait_for(refuses, timeout_s=0, what="a peer", retry_on=(ConnectionError,))
    with pytest.raises(ConnectionError):  # one it was not told to retry ends the wait
        wait_for(refuses, timeout_s=5)


def test_holds_throughout_fails_at_the_first_falsy_try() -> None:
    tries = itertools.count()
    with pytest.raises(AssertionError, match="the lease stopped holding"):
        holds_throughout(lambda: next(tries) < 3, duration_s=10, interval_s=0, what="the lease")
    assert next(tries) == 4
    holds_throughout(lambda: True, duration_s=0, interval_s=0)


def test_the_event_loop_twins_let_the_loop_run_between_tries() -> None:
    async def scenario() -> None:
        ran = asyncio.Event()
        asyncio.get_running_loop().call_soon(ran.set)
        assert await wait_for_async(ran.is_set, interval_s=0) is True
        with pytest.raises(AssertionError, match="waiting for never"):
            await wait_for_async(lambda: False, timeout_s=0, what="never")
        await holds_throughout_async(ran.is_set, duration_s=0.05, interval_s=0.01)
        with pytest.raises(AssertionError):
            await holds_throughout_async(lambda: False, duration_s=5)

    asyncio.run(scenario())
