"""The executor's liveness apart from its progress, over the wire (a real executor and blockd): its beacon keeps
coming while a step is stalled on purpose (--fault-stall-step, spinning in pure Python), saying how long the step
has run; its load report counts the tokens its requests may still need."""

from __future__ import annotations

from executor import protocol as ep
from executor.params import SamplingParams
from tests.executor.harness import random_prompts
from tests.support.waiting import wait_for


def test_the_beacon_keeps_coming_through_a_stalled_step(tiny_models, blockd, start_executor):
    executor = start_executor(tiny_models["llama"], blockd.endpoint, "--pool-id", "pb", "--fault-stall-step", "3:1.5")
    with executor.client() as client:
        client.submit("r", [5, 6, 7], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        messages: list[ep.Outbound] = []
        while not (messages and type(messages[-1]) is ep.Delta and messages[-1].finish_reason is not None):
            assert client.socket.poll(30_000), "the executor went quiet"
            messages.append(ep.decode_outbound(client.socket.recv()))
    deltas = [i for i, m in enumerate(messages) if type(m) is ep.Delta]
    stalled = [i for i, m in enumerate(messages) if type(m) is ep.Alive and m.step_s >= 0.5]
    assert len(stalled) >= 2, "beacons during the stalled step"  # 1.5 s at one every 0.25 s
    assert deltas[0] < stalled[0] and stalled[-1] < deltas[-1]  # while the request was mid-way
    steps = {messages[i].steps for i in stalled}
    assert len(steps) == 1  # no progress meanwhile: one step, reported as running ever longer
    assert [messages[i].step_s for i in stalled] == sorted(messages[i].step_s for i in stalled)
    assert [m.finish_reason for m in messages if type(m) is ep.Delta][-1] == "length"


def test_the_load_report_counts_the_tokens_queued(tiny_models, blockd, start_executor):
    executor = start_executor(tiny_models["qwen2"], blockd.endpoint, "--pool-id", "pq")
    prompt = random_prompts([60], vocab=512, seed=22)[0]
    with executor.client() as client:
        assert client.load().queued_tokens == 0
        client.submit("long", prompt, SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
        first = client.receive()
        assert type(first) is ep.Delta and first.finish_reason is None
        queued = client.load().queued_tokens
        assert 0 < queued < 400  # its prompt is computed; what it may still generate, less what it has
        client.abort("long")
        wait_for(lambda: client.load().queued_tokens == 0, what="nothing queued once aborted")
        assert client.load().busy_s > 0 and client.load().computed_tokens >= len(prompt)
