"""The priority policy (`--scheduling-policy priority`) in the scheduler, run by the step loop against blockd's
BlockManager in this process (tests/executor/test_scheduler.py's harness): the queue by (priority, arrival),
the worst-ranked preempted first, a better-ranked head preempting a worse one, the plan made ahead leaving that
to the plan after sampling."""

from __future__ import annotations

import pytest

from executor.sequence import Status
from tests.executor.test_scheduler import Harness


def test_the_queue_is_ordered_by_priority_then_arrival() -> None:
    h = Harness(max_num_seqs=1, policy="priority")
    first = h.submit("first", 4, max_tokens=2, priority=3)
    late = h.submit("late", 4, max_tokens=2, priority=3)
    urgent = h.submit("urgent", 4, max_tokens=2, priority=-1)
    middle = h.submit("middle", 4, max_tokens=2, priority=0)
    assert list(h.scheduler.waiting) == [urgent, middle, first, late]
    records = h.run()
    order = [sid for r in records for sid in r.admitted()]
    assert order == ["urgent#0", "middle#0", "first#0", "late#0"]
    h.assert_all_done()


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_better_priority_that_does_not_fit_preempts_the_worst_running(pipelined: bool) -> None:
    h = Harness(num_blocks=12, block_size=4, max_num_seqs=4, policy="priority", pipelined=pipelined)
    worst = h.submit("worst", 8, max_tokens=12, priority=9)
    bad = h.submit("bad", 8, max_tokens=12, priority=5)
    for _ in range(3):
        h.step()
    assert worst.status is Status.RUNNING and bad.status is Status.RUNNING
    urgent = h.submit("urgent", 24, max_tokens=2, priority=0)  # 6 blocks and more: not beside both
    for _ in range(6):
        h.step()
        if urgent.status is not Status.WAITING:
            break
    assert urgent.status is Status.RUNNING
    assert worst.preemptions == 1 and bad.preemptions == 0  # the worst-ranked, not the most recently admitted
    assert h.scheduler.waiting[0] is worst
    h.run()
    h.assert_all_done()


def test_equal_priorities_never_preempt_to_admit() -> None:
    h = Harness(num_blocks=12, block_size=4, max_num_seqs=4, policy="priority")
    running = h.submit("running", 8, max_tokens=12, priority=1)
    h.step()
    waiting = h.submit("waiting", 40, max_tokens=2, priority=1)  # 10 blocks: never beside it
    for _ in range(3):
        h.step()
    assert running.preemptions == 0 and waiting.status is Status.WAITING
    h.run()
    h.assert_all_done()
