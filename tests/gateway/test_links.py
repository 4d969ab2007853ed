"""An `ExecutorLink` against a fake executor (a ROUTER socket in this process): silence is judged only after
what already came in is read (a busy event loop is not a silent executor), and requests in flight on an
executor found silent are aborted there, on the connection that submitted them."""

from __future__ import annotations

import asyncio
import time

import zmq
import zmq.asyncio

from common.net import free_port
from executor import protocol as ep
from executor.params import SamplingParams
from gateway.executors import ExecutorLink, ExecutorLost
from tests.support.waiting import holds_throughout_async, wait_for_async

INFO = ep.Info(
    pool_id="fake-0",
    model_id="fake",
    model_dir="/nowhere",
    max_model_len=64,
    vocab_size=100,
    block_size=16,
    num_blocks=8,
    device="cpu",
    eos_token_ids=[0],
)
LOAD = ep.LoadReport(
    pool_id="fake-0", running=0, waiting=0, free_blocks=8, num_blocks=8, kv_utilization=0.0, preemptions=0, steps=0
)


class FakeExecutor:
    """Answers GetInfo and GetLoad while `answering`; records every Submit and Abort with the sender."""

    def __init__(self, context: zmq.asyncio.Context) -> None:
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.socket = context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(self.endpoint)
        self.answering = True
        self.received: list[tuple[bytes, object]] = []
        self.task = asyncio.get_running_loop().create_task(self._serve())

    async def _serve(self) -> None:
        while True:
            identity, frame = await self.socket.recv_multipart()
            message = ep.decode_inbound(frame)
            self.received.append((identity, message))
            if not self.answering:
                continue
            if isinstance(message, ep.GetInfo):
                await self.socket.send_multipart([identity, ep.encode(INFO)])
            elif isinstance(message, ep.GetLoad):
                await self.socket.send_multipart([identity, ep.encode(LOAD)])

    async def close(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        self.socket.close()


def _block_the_event_loop(seconds: float) -> None:
    """What a huge prompt tokenized on the loop does: nothing else runs on it meanwhile (the scenario, not a wait)."""
    time.sleep(seconds)


def test_a_busy_event_loop_is_not_a_silent_executor() -> None:
    async def scenario() -> None:
        context = zmq.asyncio.Context()
        fake = FakeExecutor(context)
        link = ExecutorLink(fake.endpoint, context, timeout_s=0.5, compatible=lambda info: None)
        link.start()
        try:
            await wait_for_async(lambda: link.healthy)
            _block_the_event_loop(1.5)  # three timeouts
            # What came in meanwhile is read before silence is judged: the link must not be lost after the block,
            # which only watching it for a while shows.
            await holds_throughout_async(lambda: link.healthy, 0.3, what="the link's health")
            fake.answering = False
            await wait_for_async(lambda: not link.healthy, timeout_s=5)  # a real silence is still seen
        finally:
            await link.close()
            await fake.close()
            context.term()

    asyncio.run(scenario())


def test_requests_on_a_silent_executor_are_aborted_there() -> None:
    async def scenario() -> None:
        context = zmq.asyncio.Context()
        fake = FakeExecutor(context)
        link = ExecutorLink(fake.endpoint, context, timeout_s=0.5, compatible=lambda info: None)
        link.start()
        try:
            await wait_for_async(lambda: link.healthy)
            queue = link.submit("req-1", [1, 2, 3], SamplingParams(max_tokens=4))
            await wait_for_async(lambda: any(isinstance(m, ep.Submit) for _, m in fake.received))
            (submitter,) = {i for i, m in fake.received if isinstance(m, ep.Submit)}
            fake.answering = False  # stopped, not dead: what it is sent is read once it goes on
            lost = await asyncio.wait_for(queue.get(), timeout=5)
            assert isinstance(lost, ExecutorLost)
            await wait_for_async(lambda: any(isinstance(m, ep.Abort) for _, m in fake.received))
            aborts = [(i, m) for i, m in fake.received if isinstance(m, ep.Abort)]
            assert [(i, m.request_id) for i, m in aborts] == [(submitter, "req-1")]
        finally:
            await link.close()
            await fake.close()
            context.term()

    asyncio.run(scenario())
