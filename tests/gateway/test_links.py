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


async def _until(condition, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def test_a_busy_event_loop_is_not_a_silent_executor() -> None:
    async def scenario() -> None:
        context = zmq.asyncio.Context()
        fake = FakeExecutor(context)
        link = ExecutorLink(fake.endpoint, context, timeout_s=0.5, compatible=lambda info: None)
        link.start()
        try:
            await _until(lambda: link.healthy)
            time.sleep(1.5)  # the loop blocked for three timeouts (a huge prompt tokenized on it, say)
            await asyncio.sleep(0.3)
            assert link.healthy
            fake.answering = False
            await _until(lambda: not link.healthy, timeout_s=5)  # a real silence is still seen
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
            await _until(lambda: link.healthy)
            queue = link.submit("req-1", [1, 2, 3], SamplingParams(max_tokens=4))
            await _until(lambda: any(isinstance(m, ep.Submit) for _, m in fake.received))
            (submitter,) = {i for i, m in fake.received if isinstance(m, ep.Submit)}
            fake.answering = False  # stopped, not dead: what it is sent is read once it goes on
            lost = await asyncio.wait_for(queue.get(), timeout=5)
            assert isinstance(lost, ExecutorLost)
            await _until(lambda: any(isinstance(m, ep.Abort) for _, m in fake.received))
            aborts = [(i, m) for i, m in fake.received if isinstance(m, ep.Abort)]
            assert [(i, m.request_id) for i, m in aborts] == [(submitter, "req-1")]
        finally:
            await link.close()
            await fake.close()
            context.term()

    asyncio.run(scenario())
