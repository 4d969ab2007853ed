"""Priority scheduling (`--scheduling-policy priority`, vLLM's) on a real executor process and a real blockd: a
better-ranked request that does not fit preempts the worst-ranked running one, which still finishes with
transformers' output; an executor serving first come, first served refuses a non-zero priority by name."""

from __future__ import annotations

import pytest

from executor import protocol as ep
from executor.client import ExecutorRejected
from executor.params import SamplingParams
from tests.executor.harness import hf_greedy_ignoring_eos, random_prompts


def test_a_better_priority_preempts_the_worst_running_request(tiny_models, blockd, start_executor) -> None:
    model = tiny_models["llama"]
    executor = start_executor(
        model, blockd.endpoint, "--scheduling-policy", "priority", "--num-blocks", "24", "--block-size", "16"
    )
    low_prompts = random_prompts([40, 40], vocab=512, seed=31)
    (high_prompt,) = random_prompts([200], vocab=512, seed=32)
    low = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True, priority=5)
    high = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, priority=-1)
    tokens: dict[str, list[int]] = {}
    finished: list[str] = []

    def take(message: ep.Outbound) -> None:
        assert type(message) is ep.Delta, message
        tokens.setdefault(message.request_id, []).extend(message.token_ids)
        if message.finish_reason is not None:
            assert message.finish_reason == "length", message
            finished.append(message.request_id)

    with executor.client(timeout_s=60) as client:
        for i, prompt in enumerate(low_prompts):
            client.submit(f"low{i}", prompt, low)
        while min(len(tokens.get(f"low{i}", [])) for i in range(2)) < 20:
            take(client.receive())
        assert client.load().preemptions == 0
        # 2 x (60 tokens and their reserved room) of 24 blocks are held: the 200-token prompt does not fit.
        client.submit("high", high_prompt, high)
        while len(finished) < 3:
            take(client.receive())
        assert client.load().preemptions >= 1
    assert finished[0] == "high", finished  # it ran at once, ahead of both low-priority requests
    assert tokens["high"] == hf_greedy_ignoring_eos(model, high_prompt, high.max_tokens)
    for i, prompt in enumerate(low_prompts):  # preempted, recomputed, and the same output
        assert tokens[f"low{i}"] == hf_greedy_ignoring_eos(model, prompt, low.max_tokens), i


def test_fcfs_refuses_a_priority(tiny_models, blockd, start_executor) -> None:
    executor = start_executor(tiny_models["llama"], blockd.endpoint)
    with executor.client(timeout_s=30) as client:
        with pytest.raises(ExecutorRejected) as refused:
            client.generate([1, 2, 3], SamplingParams(max_tokens=2, priority=1), request_id="p")
        assert refused.value.code == "invalid_request" and refused.value.message.startswith("priority: ")
        assert "--scheduling-policy priority" in refused.value.message
        assert client.load().waiting == 0
