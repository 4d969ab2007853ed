"""The executor as a process: a real `pagedkv-executor`, a real blockd, ZeroMQ on loopback between all three."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import msgspec
import pytest

from common.net import free_port
from executor import protocol as ep
from executor.client import ExecutorClient, ExecutorRejected, tokens_of
from executor.params import SamplingParams
from tests.executor.harness import hf_greedy, hf_greedy_ignoring_eos, random_prompts
from tests.support.waiting import wait_for

GREEDY = SamplingParams(max_tokens=16, temperature=0.0)


def test_serves_concurrent_requests_streaming_identical_to_transformers(tiny_models, blockd, start_executor):
    model = tiny_models["llama"]
    executor = start_executor(model, blockd.endpoint, "--pool-id", "px")
    log = executor.log()
    for fact in ("executor_ready", "kv_blocks", "kv_tokens", "kv_bytes", "load_s", "tiny-llama"):
        assert fact in log
    prompts = random_prompts([9, 40, 23], vocab=512, seed=20)
    with executor.client() as client:
        info = client.info()
        assert info.pool_id == "px" and info.max_model_len == 512 and info.block_size == 16
        for i, prompt in enumerate(prompts):
            client.submit(f"q{i}", prompt, GREEDY)
        streams: dict[str, list[ep.Delta]] = {f"q{i}": [] for i in range(3)}
        while not all(s and s[-1].finish_reason for s in streams.values()):
            message = client.receive()
            assert type(message) is ep.Delta
            streams[message.request_id].append(message)
        # Finished sequences hand their blocks back with the next step's blockd message.
        load = wait_for(lambda: (r := client.load()).free_blocks == r.num_blocks and r, what="blocks returned")
    for i, prompt in enumerate(prompts):
        deltas = streams[f"q{i}"]
        assert len(deltas) == len(tokens_of(deltas))  # incremental: one token per delta
        assert [d.completion_tokens for d in deltas] == list(range(1, len(deltas) + 1))
        assert tokens_of(deltas) == hf_greedy(model, prompt, GREEDY.max_tokens)
        assert deltas[-1].prompt_tokens == len(prompt)
    assert load.running == 0 and load.waiting == 0 and load.num_blocks == info.num_blocks


def test_abort_over_the_wire_frees_blocks(tiny_models, blockd, start_executor):
    executor = start_executor(tiny_models["qwen2"], blockd.endpoint, "--pool-id", "pa")
    prompt = random_prompts([60], vocab=512, seed=21)[0]
    with executor.client() as client:
        client.submit("long", prompt, SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
        first = client.receive()
        assert type(first) is ep.Delta and first.finish_reason is None
        assert blockd.client().stats("pa").pools[0].blocks_in_use > 0
        client.abort("long")
        while True:
            message = client.receive()
            if message.finish_reason is not None:
                break
        assert message.finish_reason == "abort" and message.completion_tokens < 400
        wait_for(lambda: blockd.client().stats("pa").pools[0].blocks_in_use == 0, what="blocks freed")
        assert client.load().running == 0


def test_n_2_over_the_wire_every_choice_finishes_and_one_can_be_aborted(tiny_models, blockd, start_executor):
    executor = start_executor(tiny_models["llama"], blockd.endpoint, "--pool-id", "pn")
    prompt = random_prompts([20], vocab=512, seed=22)[0]
    with executor.client() as client:
        # Greedy choices finish in the same step: both final deltas must still be sent.
        choices = client.generate(prompt, SamplingParams(max_tokens=5, temperature=0.0, n=2, ignore_eos=True))
        assert [d[-1].finish_reason for d in choices] == ["length", "length"]
        assert tokens_of(choices[0]) == tokens_of(choices[1]) == hf_greedy_ignoring_eos(tiny_models["llama"], prompt, 5)
        client.submit("pair", prompt, SamplingParams(max_tokens=300, temperature=1.0, seed=5, n=2, ignore_eos=True))
        seen: dict[int, list[ep.Delta]] = {0: [], 1: []}
        while not (seen[0] and seen[1]):
            message = client.receive()
            seen[message.index].append(message)
        client.abort("pair", index=1)  # a gateway found a stop string in choice 1
        while not (seen[0] and seen[0][-1].finish_reason and seen[1][-1].finish_reason):
            message = client.receive()
            seen[message.index].append(message)
        assert seen[1][-1].finish_reason == "abort"
        assert seen[0][-1].finish_reason == "length" and seen[0][-1].completion_tokens == 300
        wait_for(lambda: blockd.client().stats("pn").pools[0].blocks_in_use == 0, what="blocks freed")


def test_bad_messages_get_clear_errors_and_serving_continues(tiny_models, blockd, start_executor):
    executor = start_executor(tiny_models["llama"], blockd.endpoint)
    good = random_prompts([12], vocab=512, seed=22)[0]
    with executor.client(timeout_s=10) as client:
        # Long enough to still be running when its duplicate arrives, however fast the machine; aborted below.
        client.submit("busy", good, SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True))
        with pytest.raises(ExecutorRejected) as info:
            client.generate(good, GREEDY, request_id="busy")
        assert info.value.code == "duplicate_request"
        bad_frames = {
            "garbage": b"\x00\xffnot msgpack",
            "unknown type": msgspec.msgpack.encode({"type": "explode", "v": 1}),
            "wrong version": msgspec.msgpack.encode({"type": "get_load", "v": 99}),
            "bad field": msgspec.msgpack.encode({"type": "submit", "v": 1, "request_id": "x", "prompt": 5}),
            "odd prompt bytes": ep.encode(ep.Submit(request_id="odd", prompt=b"\x01\x02\x03")),
            "unknown param": msgspec.msgpack.encode(
                {"type": "submit", "v": 1, "request_id": "u", "prompt": b"\x01\x00\x00\x00", "params": {"tempo": 1}}
            ),
        }
        for what, frame in bad_frames.items():
            client.send_raw(frame)
            reply = _next_rejection(client)
            assert reply.code in ("invalid_request", "unsupported_version") and reply.message, what
        cases = {
            "empty": ([], GREEDY, "invalid_request"),
            "context": ([1] * 600, GREEDY, "context_length_exceeded"),
            "temperature": ([1], SamplingParams(temperature=-2.0), "invalid_request"),
        }
        for request_id, (prompt, params, code) in cases.items():
            with pytest.raises(ExecutorRejected) as info:
                client.generate(prompt, params, request_id=request_id)
            assert info.value.code == code
        # New requests still work while the first one runs; then it is aborted and every block comes back.
        assert tokens_of(client.generate(good, GREEDY)[0]) == hf_greedy(tiny_models["llama"], good, 16)
        client.abort("busy")
        wait_for(
            lambda: (load := client.load()).running == 0 and load.free_blocks == load.num_blocks,
            timeout_s=60,
            what="the aborted request and the new one to hand their blocks back",
        )


def _next_rejection(client: ExecutorClient) -> ep.Rejected:
    while True:
        message = client.receive()
        if type(message) is ep.Rejected:
            return message


def test_blockd_killed_and_restarted_mid_generation_requests_finish_identically(tiny_models, blockd, start_executor):
    """While blockd is away the executor keeps answering: load says so, a new request is queued, an abort waits
    for the pending step. When blockd is back every request finishes with transformers' output."""
    model = tiny_models["mistral"]
    executor = start_executor(model, blockd.endpoint, "--pool-id", "pr")
    prompts = random_prompts([30, 18, 45, 12, 25], vocab=512, seed=23)
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    streams: dict[str, list[ep.Delta]] = {}

    def take(message) -> None:
        streams.setdefault(message.request_id, []).append(message)

    with executor.client(timeout_s=60) as client:
        for i in range(3):
            client.submit(f"k{i}", prompts[i], params)
        while sum(map(len, streams.values())) < 12:
            take(client.receive())
        blockd.kill9()
        load = wait_for(
            lambda: (r := client.load()).blockd_reachable is False and r,
            timeout_s=30,
            what="the executor to notice blockd is gone",
        )
        assert load.running + load.waiting == 3
        client.submit("k3", prompts[3], params)  # taken in while blockd is away
        client.submit("k4", prompts[4], params)
        client.abort("k4")  # waits for the pending step, then ends the request
        # The load report comes after the executor has handled everything sent before it: k3, k4 and the abort
        # are in while blockd is still away.
        load = client.load()
        assert load.running + load.waiting == 5 and load.blockd_reachable is False
        blockd.start()
        while len(streams) < 5 or not all(s[-1].finish_reason for s in streams.values()):
            take(client.receive())
        assert client.load().blockd_reachable
    assert streams["k4"][-1].finish_reason == "abort"
    for i in range(4):
        deltas = streams[f"k{i}"]
        assert deltas[-1].finish_reason == "length"
        assert tokens_of(deltas) == hf_greedy_ignoring_eos(model, prompts[i], 60), f"request {i}"
    with blockd.client() as admin:
        wait_for(lambda: admin.stats().pools[0].blocks_in_use == 0, what="blocks returned")
        (pool,) = admin.stats().pools
        assert pool.pool_id == "pr"


def test_sigterm_aborts_in_flight_requests_returns_blocks_and_unregisters(tiny_models, blockd, start_executor):
    executor = start_executor(tiny_models["llama"], blockd.endpoint, "--pool-id", "pt")
    with executor.client() as client:
        client.submit("endless", [5, 6, 7], SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
        assert type(client.receive()) is ep.Delta
        executor.process.send_signal(signal.SIGTERM)
        while True:
            message = client.receive()
            if message.finish_reason is not None:
                break
        assert message.finish_reason == "abort"
    assert executor.process.wait(timeout=30) == 0
    assert "executor_stopped" in executor.log()
    assert [p.pool_id for p in blockd.client().pools().pools] == []


def test_cli_help_and_startup_errors(tiny_models, tmp_path):
    help_text = subprocess.run(
        [sys.executable, "-m", "executor.main", "--help"], capture_output=True, text=True, timeout=60
    ).stdout
    for flag in (
        "--model",
        "--device",
        "--blockd",
        "--bind",
        "--block-size",
        "--num-blocks",
        "--kv-cache-memory",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--dtype",
    ):
        assert flag in help_text
    base = [sys.executable, "-m", "executor.main", "--model", str(tiny_models["llama"])]
    cases = [
        (["--device", "tpu"], 2, "--device"),
        (["--kv-cache-memory", "0.5"], 2, "CUDA"),
        (["--kv-cache-memory", "lots"], 2, "size"),
        (["--max-num-seqs", "64", "--max-num-batched-tokens", "32"], 2, "--max-num-seqs"),
        (["--model", str(tmp_path)], 1, "config.json"),
        (["--blockd", f"tcp://127.0.0.1:{free_port()}", "--blockd-wait", "0"], 69, "blockd_unreachable"),
    ]
    for args, code, message in cases:
        done = subprocess.run(base + args, capture_output=True, text=True, timeout=120)
        assert done.returncode == code, (args, done.stdout, done.stderr)
        assert message in done.stdout + done.stderr, args
    # Every option also reads PAGEDKV_EXECUTOR_<OPTION> (compose and other deployments configure it so).
    done = subprocess.run(
        base, capture_output=True, text=True, timeout=120, env={**os.environ, "PAGEDKV_EXECUTOR_DEVICE": "tpu"}
    )
    assert done.returncode == 2 and "--device" in done.stderr


def test_two_executors_share_one_blockd_with_separate_pools(tiny_models, blockd, start_executor):
    a = start_executor(tiny_models["llama"], blockd.endpoint, "--pool-id", "one", "--num-blocks", "40")
    b = start_executor(tiny_models["llama"], blockd.endpoint, "--pool-id", "two", "--num-blocks", "30")
    prompt = random_prompts([40], vocab=512, seed=24)[0]
    with a.client() as ca, b.client() as cb:
        assert tokens_of(ca.generate(prompt, GREEDY)[0]) == tokens_of(cb.generate(prompt, GREEDY)[0])
    pools = {p.pool_id: p.num_blocks for p in blockd.client().pools().pools}
    assert pools == {"one": 40, "two": 30}
    assert blockd.client().lookup(prompt) == {"one": 32, "two": 32}  # both cached the prompt's full blocks
