"""A tensor-parallel group whose ranks are started apart, as a LeaderWorkerSet runs them (one process per pod):
`pagedkv-executor --tp-rank 0 --tp-master HOST:PORT` (the leader) and `--tp-rank 1` (a worker), independent real
processes on loopback, keyed like a deployment. A worker holding a stranger's key is never admitted; the one
holding the pool's key joins, and the group's greedy outputs equal transformers'. A leader whose worker never
comes gives up clearly; a lost rank (worker or leader) stops the other; a process that reached the store without
the group's token is refused; LeaderWorkerSet's environment places a rank without options."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import zmq.auth

from common import processes
from common.auth import KeySet, generate
from common.net import free_port
from executor.client import tokens_of
from executor.parallel_rendezvous import DEFAULT_PORT, Placement, new_token, placement
from executor.parallel_runner import EX_GROUP_FAILED
from executor.params import SamplingParams
from pagedkv.tools.model_gen import write_model
from tests.executor.harness import hf_greedy_ignoring_eos, hf_logprobs, random_prompts
from tests.support.models import TINY
from tests.support.processes import BlockdProcess, ExecutorProcess
from tests.support.waiting import wait_for

MAX_TOKENS = 8
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def _rank_argv(model: Path, keys: Path, master: str, rank: int, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "executor.main", "--model", str(model), "--keys", str(keys), "--pool-id", "tp",
        "--tensor-parallel-size", "2", "--tp-rank", str(rank), "--tp-master", master, *extra,
    ]  # fmt: skip


def test_ranks_started_apart_match_transformers_and_a_stranger_key_is_refused(tmp_path: Path) -> None:
    model = write_model(tmp_path / "llama", quiet=True, **{**TINY, "arch": "llama"})
    generate(tmp_path / "keys", ["tp"])
    keys = KeySet(tmp_path / "keys")
    # A stranger: it trusts the right server key, but its own pool-tp key is not the deployment's.
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    shutil.copy(tmp_path / "keys" / "server.key", stranger / "server.key")
    zmq.auth.create_certificates(stranger, "pool-tp")
    blockd = BlockdProcess(["--no-persistence", "--keys", str(keys.directory)], tmp_path / "blockd.log")
    blockd.curve = keys.client("operator")
    blockd.start()
    master = f"127.0.0.1:{free_port()}"
    leader = ExecutorProcess(
        model, blockd.endpoint, tmp_path / "leader.log", "--keys", str(keys.directory), "--pool-id", "tp",
        "--tensor-parallel-size", "2", "--tp-rank", "0", "--tp-master", master,
        "--tensor-parallel-join-timeout", "120", curve=keys.client("gateway"),
    )  # fmt: skip
    worker = None
    try:
        refused = subprocess.run(
            _rank_argv(model, stranger, master, 1, "--tensor-parallel-join-timeout", "3"),
            capture_output=True, text=True, env=ENV, timeout=120,
        )  # fmt: skip
        assert refused.returncode == 1, refused.stderr[-2000:]
        assert "did not admit rank 1" in refused.stderr, refused.stderr[-2000:]
        assert "tensor_parallel_worker_joined" not in leader.log()
        worker = processes.start(_rank_argv(model, keys.directory, master, 1), tmp_path / "worker.log", env=ENV)
        leader.wait_ready(timeout_s=180)
        log = leader.log()
        assert "tensor_parallel_worker_joined" in log and "tensor_parallel_group_joined" in log
        with leader.client() as client:
            for prompt in random_prompts([17, 4], vocab=512, seed=47):
                (choice,) = client.generate(prompt, PARAMS)
                tokens = tokens_of(choice)
                assert tokens == hf_greedy_ignoring_eos(model, prompt, MAX_TOKENS)
                reference = hf_logprobs(model, prompt, tokens)
                logprobs = [entry for delta in choice for entry in delta.logprobs or []]
                assert len(logprobs) == MAX_TOKENS
                for position, entry in enumerate(logprobs):
                    assert abs(entry.logprob - reference[position, entry.token_id].item()) < 2e-3
        # A clean stop of the leader stops its worker cleanly too (it says stop over the group).
        (stopped,) = processes.stop([leader.process])
        assert stopped.returncode == 0, leader.log()[-3000:]
        assert worker.wait(timeout=30) == 0, (tmp_path / "worker.log").read_text()[-3000:]
        with blockd.client() as client:
            assert all(not p.blocks_in_use for p in client.stats().pools)
            assert client.check() == []
    finally:
        processes.stop([p for p in (worker, leader.process, blockd.process) if p is not None])


def test_a_leader_whose_worker_never_comes_fails_clearly(tmp_path: Path) -> None:
    model = write_model(tmp_path / "llama", quiet=True, **{**TINY, "arch": "llama"})
    argv = [
        sys.executable, "-m", "executor.main", "--model", str(model), "--tensor-parallel-size", "2",
        "--tp-master", f"127.0.0.1:{free_port()}", "--tensor-parallel-join-timeout", "2",
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, env=ENV, timeout=120)
    assert done.returncode == 1
    assert "rank(s) 1 did not join" in done.stderr, done.stderr[-2000:]


def test_leaderworkerset_environment_places_the_rank() -> None:
    lws = {"LWS_LEADER_ADDRESS": "tp-0.tp.default", "LWS_GROUP_SIZE": "4", "LWS_WORKER_INDEX": "3"}
    assert placement(1, None, None, lws) == Placement(4, 3, f"tp-0.tp.default:{DEFAULT_PORT}")
    assert placement(2, 1, "10.0.0.5:6000", lws) == Placement(2, 1, "10.0.0.5:6000")  # options win
    assert placement(2, None, None, {}) == Placement(2)  # no leader: rank 0 starts its workers
    assert placement(1, None, None, {**lws, "LWS_GROUP_SIZE": "1", "LWS_WORKER_INDEX": "0"}) == Placement(1)
    for size, rank, master, why in [
        (2, 1, None, "give --tp-master"),
        (2, 2, "h:1", "not a rank of a group of 2"),
        (1, 0, "h:1", "needs --tensor-parallel-size 2"),
        (2, 0, "h", "not HOST:PORT"),
    ]:
        with pytest.raises(ValueError, match=why):
            placement(size, rank, master, {})
    with pytest.raises(ValueError, match="LWS_WORKER_INDEX"):
        placement(1, None, None, {**lws, "LWS_WORKER_INDEX": "x"})


@pytest.mark.parametrize("lost", ["worker", "leader"])
def test_a_lost_rank_stops_the_whole_group_started_apart(lost: str, tmp_path: Path, blockd: BlockdProcess) -> None:
    """Without keys, on loopback: a dead worker is seen by the leader's idle ping (it has no child to watch), a dead
    leader by the worker's wait for the next op; either way the survivor exits 70."""
    model = write_model(tmp_path / "llama", quiet=True, **{**TINY, "arch": "llama"})
    master = f"127.0.0.1:{free_port()}"
    group = ("--tensor-parallel-size", "2", "--tp-master", master)
    leader = ExecutorProcess(
        model, blockd.endpoint, tmp_path / "leader.log", *group, "--tensor-parallel-timeout", "3", "--pool-id", "apart"
    )
    worker_log = tmp_path / "worker.log"
    worker = processes.start(
        [sys.executable, "-m", "executor.main", "--model", str(model), *group, "--tp-rank", "1"], worker_log, env=ENV
    )
    try:
        leader.wait_ready(timeout_s=180)
        with leader.client() as client:
            prompt = [5, 6, 7, 8]
            assert tokens_of(client.generate(prompt, PARAMS)[0]) == hf_greedy_ignoring_eos(model, prompt, MAX_TOKENS)
            wait_for(lambda: client.load().free_blocks == client.load().num_blocks, what="the blocks handed back")
        victim, survivor, log = (
            (worker, leader.process, leader.log_path) if lost == "worker" else (leader.process, worker, worker_log)
        )
        victim.kill()
        victim.wait()
        assert survivor.wait(timeout=60) == EX_GROUP_FAILED, log.read_text()[-3000:]
        assert "tensor_parallel_group_failed" in log.read_text()
    finally:
        processes.stop([worker, leader.process])


def test_a_rank_without_the_group_token_is_refused(tmp_path: Path) -> None:
    """The store admits anyone who reaches it: two processes that joined it with different tokens each find that
    the other does not hold the group's, and neither serves."""
    code = (
        "import sys, torch; from executor.parallel import GroupIntruder, init_group\n"
        "try:\n"
        "    init_group(int(sys.argv[1]), 2, int(sys.argv[2]), torch.device('cpu'), 5.0, token=sys.argv[3])\n"
        "except GroupIntruder as exc:\n"
        "    print(exc); sys.exit(3)\n"
    )
    port = str(free_port())
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(rank), port, new_token()], stdout=subprocess.PIPE, text=True, env=ENV
        )
        for rank in range(2)
    ]
    for rank, process in enumerate(ranks):
        out, _ = process.communicate(timeout=120)
        assert process.returncode == 3, out
        assert f"rank {1 - rank} of the group does not hold the group's token" in out
