"""The door (--max-queue-delay), model-free: links fed the frames an executor sends (load reports with measured
throughput, deltas), no sockets; the 429 itself, with Retry-After, is tested on real processes in
test_load_held.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq.asyncio

from executor import protocol as ep
from gateway.admission import Door
from gateway.executors import ExecutorLink, _Work

INFO = dict(model_id="m", model_dir="/m", max_model_len=4096, vocab_size=100, block_size=16, num_blocks=64)


def load(pool_id: str, busy_s: float, tokens: int, queued: int = 0) -> bytes:
    report = ep.LoadReport(
        pool_id=pool_id, running=0, waiting=0, free_blocks=64, num_blocks=64, kv_utilization=0.0, preemptions=0,
        steps=1, busy_s=busy_s, computed_tokens=tokens, queued_tokens=queued,
    )  # fmt: skip
    return ep.encode(report)


@pytest.fixture
def context() -> Iterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.term()


def link(context: zmq.asyncio.Context, pool_id: str, tokens_per_s: float | None) -> ExecutorLink:
    """A link in rotation whose executor measured `tokens_per_s` (None: has not worked yet)."""
    made = ExecutorLink(f"tcp://{pool_id}:1", context)
    made._on_frame(ep.encode(ep.Info(pool_id=pool_id, device="cpu", eos_token_ids=[0], **INFO)))
    if tokens_per_s is not None:
        made._on_frame(load(pool_id, 10.0, int(10 * tokens_per_s)))
    assert made.healthy and made.tokens_per_s == tokens_per_s
    return made


def queue(made: ExecutorLink, request_id: str, prompt: int, max_tokens: int, n: int = 1) -> None:
    """A request in flight, as `submit` records it (without a socket to send it on)."""
    made.streams[request_id] = None  # type: ignore[assignment]
    made.work[request_id] = _Work(prompt, [max_tokens] * n)


def test_queued_work_counts_prompts_until_started_and_each_choice_s_tokens_left(context) -> None:
    made = link(context, "a", 100.0)
    queue(made, "r", prompt=300, max_tokens=100, n=2)
    assert made.queued_tokens() == 500 and made.drain_s() == 5.0
    made._on_frame(ep.encode(ep.Delta(request_id="r", index=0, token_ids=[1, 2, 3])))
    assert made.queued_tokens() == 97 + 100  # the prompt is computed once a token came
    made._on_frame(ep.encode(ep.Delta(request_id="r", index=1, token_ids=[4], finish_reason="stop")))
    assert made.queued_tokens() == 97  # a finished choice needs nothing more
    made.release("r")
    assert made.queued_tokens() == 0


def test_throughput_is_measured_from_the_counters_of_load_reports(context) -> None:
    made = link(context, "a", 100.0)  # 1000 tokens in 10 s since the executor started
    made._on_frame(load("a", 10.1, 1000))  # too little work since: no new measure
    assert made.tokens_per_s == 100.0
    made._on_frame(load("a", 11.0, 1400))  # 400 tokens in 1 s: smoothed in
    assert made.tokens_per_s == pytest.approx(0.7 * 100 + 0.3 * 400)
    made._on_frame(load("a", 1.0, 50))  # a restarted executor: its own counters from the start
    assert made.tokens_per_s == 50.0


def test_the_door_refuses_only_when_every_executor_is_measured_and_past_the_bound(context) -> None:
    a, b = link(context, "a", 100.0), link(context, "b", 100.0)
    door = Door(lambda: [a, b], max_queue_delay_s=10.0)
    queue(a, "r1", prompt=2000, max_tokens=0)  # 20 s of work at a
    assert door.check() is None  # b is free: the router sends it there
    queue(b, "r2", prompt=1450, max_tokens=0)  # 14.5 s at b
    refusal = door.check()
    assert refusal is not None and refusal.wait_s == 14.5 and refusal.retry_after_s == 5
    assert Door(lambda: [a, b], max_queue_delay_s=None).check() is None  # no bound
    unmeasured = link(context, "c", None)
    assert Door(lambda: [a, b, unmeasured], max_queue_delay_s=10.0).check() is None  # c could take it
    b.release("r2")
    assert door.check() is None


def test_work_other_gateways_queued_counts_as_the_executor_reports_it(context) -> None:
    made = link(context, "a", 100.0)
    door = Door(lambda: [made], max_queue_delay_s=10.0)
    queue(made, "mine", prompt=100, max_tokens=0)
    assert door.check() is None  # 1 s of this gateway's own
    made._own_at_ask.append((made._own_queued(), made.in_flight))  # the load asked for with "mine" in flight
    made._on_frame(load("a", 10.0, 1000, queued=2500))  # the executor's whole queue, "mine" in it: 25 s
    refusal = door.check()
    assert refusal is not None and refusal.retry_after_s == 15


def test_a_report_counts_other_gateways_work_and_not_this_ones_since_finished(context) -> None:
    made = link(context, "a", 100.0)
    queue(made, "r", prompt=300, max_tokens=100)
    # a load asked for while r (400 tokens) was in flight here
    made._own_at_ask.append((made._own_queued(), made.in_flight))
    made.release("r")  # r ends before the report comes back
    made._on_frame(load("a", 10.0, 1000, queued=400 + 250))  # r's 400 and 250 of another gateway's
    assert made.queued_tokens() == 250  # not r's: finished since; the other gateway's stay until reported gone
    queue(made, "s", prompt=10, max_tokens=10)
    assert made.queued_tokens() == 250 + 20
    made._on_frame(load("a", 10.0, 1000, queued=0))  # a report asked for with nothing of ours in flight
    assert made.queued_tokens() == 20
