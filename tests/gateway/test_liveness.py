"""Liveness apart from progress, at the link: an executor that answers nothing for many timeouts (a long step)
but whose beacon keeps coming stays in rotation with its streams; once the beacon stops too, it is lost."""

from __future__ import annotations

import asyncio

import zmq.asyncio

from executor import protocol as ep
from executor.params import SamplingParams
from gateway.executors import ExecutorLink, ExecutorLost
from tests.gateway.test_links import FakeExecutor
from tests.support.waiting import holds_throughout_async, wait_for_async


class BeaconingExecutor(FakeExecutor):
    """The fake executor with a liveness beacon to every peer it heard from, while `beaconing`."""

    def __init__(self, context: zmq.asyncio.Context) -> None:
        super().__init__(context)
        self.beaconing = True
        self.beacon = asyncio.get_running_loop().create_task(self._beat())

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(ep.ALIVE_INTERVAL_S)  # the beacon's own period, as the executor's thread keeps it
            if self.beaconing:
                alive = ep.encode(ep.Alive(pool_id="fake-0", steps=3, step_s=9.0))
                for identity in {i for i, _ in self.received}:
                    await self.socket.send_multipart([identity, alive])

    async def close(self) -> None:
        self.beacon.cancel()
        await asyncio.gather(self.beacon, return_exceptions=True)
        await super().close()


def test_a_long_step_is_not_death_but_a_stopped_beacon_is() -> None:
    async def scenario() -> None:
        context = zmq.asyncio.Context()
        fake = BeaconingExecutor(context)
        link = ExecutorLink(fake.endpoint, context, timeout_s=0.5, compatible=lambda info: None)
        link.start()
        try:
            await wait_for_async(lambda: link.healthy)
            queue = link.submit("req-1", [1, 2, 3], SamplingParams(max_tokens=4))
            fake.answering = False  # in a step: no answers, no deltas, only the beacon
            await holds_throughout_async(lambda: link.healthy, 2.0, what="the link's health")  # four timeouts
            assert queue.empty() and link.in_flight == 1  # its stream is intact
            assert link.alive is not None and link.alive.step_s == 9.0  # the step's progress, reported apart
            fake.beaconing = False  # now the process is gone quiet altogether
            lost = await asyncio.wait_for(queue.get(), timeout=5)
            assert isinstance(lost, ExecutorLost) and not link.healthy
        finally:
            await link.close()
            await fake.close()
            context.term()

    asyncio.run(scenario())
