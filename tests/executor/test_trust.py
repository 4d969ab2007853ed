"""Trust at the executor's seams, with real processes: a duplicated --pool-id, a stranger acting on a live pool
through blockd, and the executor's own bounds (queue, message size, prompt length, abort by owner only)."""

from __future__ import annotations

import random
import re
import signal

import pytest

from blockd import protocol as p
from blockd.client import PoolClient
from blockd.errors import BlockdError, ErrorCode
from common.tokens import pack_tokens
from executor import protocol as ep
from executor.client import ExecutorClient, ExecutorUnavailable, tokens_of
from executor.params import SamplingParams
from tests.executor.harness import hf_greedy_ignoring_eos, random_prompts
from tests.support.processes import BlockdProcess, ExecutorProcess
from tests.support.waiting import wait_for

LONG = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)


@pytest.fixture
def start_executor(tmp_path):
    started: list[ExecutorProcess] = []

    def start(model, blockd_endpoint: str, *args: str) -> ExecutorProcess:
        executor = ExecutorProcess(model, blockd_endpoint, tmp_path / f"executor-{len(started)}.log", *args)
        started.append(executor)
        executor.wait_ready()
        return executor

    yield start
    for executor in started:
        executor.stop()


def collect(client: ExecutorClient, streams: dict[str, list[ep.Delta]], rejected: list[ep.Rejected], done) -> None:
    """Receive until done() holds, sorting deltas by request and keeping rejections."""
    while not done():
        message = client.receive()
        if type(message) is ep.Rejected:
            rejected.append(message)
        elif type(message) is ep.Delta:
            streams.setdefault(message.request_id, []).append(message)


def finished(streams: dict[str, list[ep.Delta]], *request_ids: str) -> bool:
    return all(streams.get(r) and streams[r][-1].finish_reason for r in request_ids)


def test_a_duplicated_pool_id_exits_at_start_and_the_first_executor_keeps_serving(
    tiny_models, blockd, start_executor, tmp_path
):
    model = tiny_models["llama"]
    first = start_executor(model, blockd.endpoint, "--pool-id", "executor-0")
    prompt = random_prompts([40], vocab=512, seed=30)[0]
    params = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
    streams: dict[str, list[ep.Delta]] = {}
    with first.client(timeout_s=120) as client:
        client.submit("before", prompt, params)
        second = ExecutorProcess(
            model, blockd.endpoint, tmp_path / "second.log", "--pool-id", "executor-0", "--pool-wait", "1"
        )
        try:
            assert second.process.wait(timeout=180) == 78
        finally:
            second.stop()
        client.submit("after", prompt, params)
        collect(client, streams, [], lambda: finished(streams, "before", "after"))
    assert "pool executor-0 is held by a live executor since" in second.log()
    want = hf_greedy_ignoring_eos(model, prompt, 300)
    assert tokens_of(streams["before"]) == want and tokens_of(streams["after"]) == want
    (pool,) = blockd.client().pools().pools
    assert pool.pool_id == "executor-0"
    fingerprint = re.search(r"epoch\W+([0-9a-f]{8})\b", first.log())
    assert fingerprint and pool.epoch_fingerprint == fingerprint.group(1)  # still the first executor's pool


def test_a_cross_pool_attack_through_blockd_changes_no_output(tiny_models, blockd, start_executor):
    model = tiny_models["qwen2"]
    victim = start_executor(model, blockd.endpoint, "--pool-id", "victim")
    prompts = random_prompts([33, 20], vocab=512, seed=31)
    rng = random.Random(3)
    streams: dict[str, list[ep.Delta]] = {}
    with victim.client(timeout_s=120) as client, blockd.client() as attacker:
        client.submit("v0", prompts[0], LONG)
        client.submit("v1", prompts[1], LONG)
        collect(client, streams, [], lambda: len(streams.get("v0", [])) >= 3)
        (info,) = attacker.pools().pools  # the attacker learns the pool's id and shape, never its epoch
        attacks = 0
        for _ in range(30):
            epoch = rng.randrange(1, 2**62)
            for request_type, fields in (
                (p.Step, {"ops": [p.Free("v0#0")]}),
                (p.Step, {"ops": [p.Admit("planted", pack_tokens(prompts[1][:32])), p.Commit("planted", 32)]}),
                (p.Step, {"ops": [p.Append("v1#0", pack_tokens([1] * 16))]}),
                (p.Heartbeat, {}),
                (p.ResetPrefixCache, {}),
                (p.Unregister, {}),
                (p.Register, {"num_blocks": info.num_blocks, "block_size": info.block_size, "model_id": "x"}),
            ):
                with pytest.raises(BlockdError) as refused:
                    attacker.call(request_type, pool_id=info.pool_id, epoch=epoch, **fields)
                assert refused.value.code in (ErrorCode.STALE_EPOCH, ErrorCode.POOL_HELD)
                attacks += 1
        collect(client, streams, [], lambda: finished(streams, "v0", "v1"))
        # The executor's free blocks and blockd's agree once everything is done.
        load = wait_for(lambda: (r := client.load()).free_blocks == r.num_blocks and r, what="blocks returned")
        assert blockd.client().stats("victim").pools[0].blocks_in_use == 0
        # The prefix cache holds only what the executor computed: a repeat is a correct hit.
        again = client.generate(prompts[0], LONG)[0]
    assert attacks == 210 and load.blockd_reachable
    for i in range(2):
        assert tokens_of(streams[f"v{i}"]) == hf_greedy_ignoring_eos(model, prompts[i], LONG.max_tokens)
    assert tokens_of(again) == tokens_of(streams["v0"]) and again[-1].cached_tokens == 32
    assert blockd.client().check() == []


def test_executor_inputs_are_bounded_and_aborts_need_the_owner(tiny_models, blockd, start_executor):
    model = tiny_models["llama"]
    executor = start_executor(model, blockd.endpoint, "--max-queued-requests", "2", "--max-message-bytes", "64KiB")
    streams: dict[str, list[ep.Delta]] = {}
    rejected: list[ep.Rejected] = []
    with executor.client(timeout_s=120) as owner, executor.client(timeout_s=10) as stranger:
        owner.submit("ctx", [1] * 600)  # past the context: refused from its packed length
        collect(owner, streams, rejected, lambda: rejected)
        assert rejected.pop().code == "context_length_exceeded"
        owner.submit("a", [1, 2, 3], LONG)
        owner.submit("b", [4, 5, 6], SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True))
        owner.submit("c", [7, 8, 9], LONG)  # a third: the queue holds two
        collect(owner, streams, rejected, lambda: rejected)
        full = rejected.pop()
        assert full.request_id == "c" and full.code == "queue_full" and "--max-queued-requests" in full.message

        stranger.abort("a")  # not the stranger's request
        reply = stranger.receive()
        assert type(reply) is ep.Rejected and reply.code == "not_owner" and reply.request_id == "a"
        owner.abort("b")  # the owner may

        # Over --max-message-bytes: ZeroMQ cuts the sender off unread; the executor serves on.
        stranger.send_raw(ep.encode(ep.Submit(request_id="big", prompt=bytes(100_000))))
        with pytest.raises(ExecutorUnavailable):
            stranger.receive(timeout_s=1.0)
        assert stranger.load().num_blocks > 0  # it reconnects as a new peer

        collect(owner, streams, rejected, lambda: finished(streams, "a", "b"))
    assert streams["b"][-1].finish_reason == "abort"
    assert streams["a"][-1].finish_reason == "length"
    assert tokens_of(streams["a"]) == hf_greedy_ignoring_eos(model, [1, 2, 3], LONG.max_tokens)
    assert not rejected


def test_an_executor_whose_pool_was_taken_over_ends_its_requests_and_exits(tiny_models, tmp_path):
    """SIGSTOP past the lease, another executor takes the pool: on SIGCONT the first one hears stale_epoch, ends
    its requests with finish_reason "error" (it must not touch the pool) and exits 75."""
    daemon = BlockdProcess(["--no-persistence", "--lease-timeout", "1"], tmp_path / "blockd.log")
    daemon.start()
    executor = ExecutorProcess(tiny_models["llama"], daemon.endpoint, tmp_path / "executor.log", "--pool-id", "gpu0")
    try:
        executor.wait_ready()
        streams: dict[str, list[ep.Delta]] = {}
        with executor.client(timeout_s=60) as client, daemon.client() as operator:
            client.submit("r", [1, 2, 3], SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
            collect(client, streams, [], lambda: "r" in streams)
            executor.process.send_signal(signal.SIGSTOP)
            wait_for(lambda: not operator.pools().pools, what="the stopped executor's lease to run out")
            successor = PoolClient(
                daemon.client(), pool_id="gpu0", num_blocks=32, block_size=16, model_id="other", retry_for_s=1
            )
            successor.register()
            successor.start_heartbeats()
            executor.process.send_signal(signal.SIGCONT)
            collect(client, streams, [], lambda: finished(streams, "r"))
            assert streams["r"][-1].finish_reason == "error"
            assert executor.process.wait(timeout=60) == 75
            (pool,) = operator.pools().pools
            assert pool.epoch_fingerprint == successor.epoch_fingerprint and pool.num_blocks == 32
            assert operator.stats("gpu0").pools[0].blocks_in_use == 0 and operator.check() == []
            successor.stop_heartbeats()
        assert "pool_fenced" in executor.log()
    finally:
        executor.process.send_signal(signal.SIGCONT)
        executor.stop()
        daemon.kill9()
