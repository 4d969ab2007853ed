"""Tensor and expert parallelism: an executor of `--tensor-parallel-size 2` is two real processes (gloo on the
CPU), one pool at blockd. Greedy outputs equal transformers' (logprobs within 2e-3) on Llama, Qwen3 (one KV head
replicated on both ranks, tied embeddings, an odd vocabulary), Qwen3-MoE (experts sliced, and split whole by
rank) and gpt-oss; a rank that is killed or paused stops the whole group, blockd takes the pool back by its
lease (no block leaks), and a restarted group serves the pool again."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from executor.checkpoint import iter_weights, load_config
from executor.client import ExecutorUnavailable, tokens_of
from executor.model_config import UnsupportedModel
from executor.parallel import make_shard
from executor.parallel_load import iter_shard_weights
from executor.parallel_runner import EX_GROUP_FAILED
from executor.params import SamplingParams
from pagedkv.tools.model_gen import write_model
from tests.executor.harness import hf_greedy, hf_greedy_ignoring_eos, hf_logprobs, random_prompts
from tests.support.models import FAMILY_SPECS, TINY
from tests.support.processes import BlockdProcess
from tests.support.waiting import wait_for

MAX_TOKENS = 8
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)
MODELS = {
    "llama": dict(arch="llama"),
    # An odd vocabulary: the last rank's rows of the (tied) embedding and head are padded.
    "qwen3-kv1-tied": {**FAMILY_SPECS["qwen3-hd64-gqa4-tied"], "vocab_size": 509},
    "qwen3_moe": FAMILY_SPECS["qwen3_moe-e4k2"],
    "gpt_oss": FAMILY_SPECS["gpt_oss-w16-e4k2"],  # biases after a reduction, sinks by head, stacked experts
}


@pytest.fixture(scope="module")
def tp_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    root = tmp_path_factory.mktemp("tp-models")
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = write_model(root / name, quiet=True, **{**TINY, **MODELS[name]})
        return made[name]

    return get


@pytest.fixture
def short_lease_blockd(tmp_path: Path):
    """blockd with a short lease, so a group that stopped loses its pool within the test; no leaks at teardown."""
    daemon = BlockdProcess(["--no-persistence", "--lease-timeout", "2"], tmp_path / "blockd.log")
    daemon.start()
    yield daemon
    if daemon.alive():
        daemon.kill9()


def test_shards_split_heads_rows_vocab_and_replicate_kv_heads(tp_model):
    config = load_config(tp_model("qwen3-kv1-tied"))  # 4 heads, 1 KV head
    shards = [make_shard(config, rank, 2) for rank in range(2)]
    assert [s.heads for s in shards] == [(0, 2), (2, 4)]
    assert [s.kv_heads for s in shards] == [(0, 1), (0, 1)]  # the one KV head on both ranks
    assert [s.vocab for s in shards] == [(0, 255), (255, 510)]  # 509 rows: the last shard padded by one
    moe = load_config(tp_model("qwen3_moe"))
    assert [make_shard(moe, r, 2, expert_parallel=True).experts for r in range(2)] == [(0, 2), (2, 4)]
    with pytest.raises(UnsupportedModel, match="4 attention heads do not split evenly"):
        make_shard(config, 0, 3)


@pytest.mark.parametrize(
    ("name", "flags"),
    [
        ("llama", ()),
        ("qwen3-kv1-tied", ()),
        ("qwen3_moe", ()),
        ("qwen3_moe", ("--enable-expert-parallel",)),
        ("gpt_oss", ()),
    ],
)
def test_tp2_greedy_matches_transformers(name, flags, tp_model, blockd, start_executor):
    model = tp_model(name)
    executor = start_executor(model, blockd.endpoint, "--tensor-parallel-size", "2", *flags)
    assert "tensor_parallel_group_joined" in executor.log()
    prompts = random_prompts([21, 5], vocab=509, seed=41)
    with executor.client() as client:
        for prompt in prompts:
            (choice,) = client.generate(prompt, PARAMS)
            tokens = tokens_of(choice)
            assert tokens == hf_greedy_ignoring_eos(model, prompt, MAX_TOKENS)
            reference = hf_logprobs(model, prompt, tokens)
            logprobs = [entry for delta in choice for entry in delta.logprobs or []]
            assert len(logprobs) == MAX_TOKENS
            for position, entry in enumerate(logprobs):
                assert abs(entry.logprob - reference[position, entry.token_id].item()) < 2e-3
        if name == "llama":  # two choices share the prompt's last block: copy-on-write on every rank
            pair = client.generate(prompts[0], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, n=2))
            assert [tokens_of(c) for c in pair] == [hf_greedy(model, prompts[0], MAX_TOKENS)] * 2


def _worker_pid(executor_pid: int) -> int:
    (child,) = Path(f"/proc/{executor_pid}/task/{executor_pid}/children").read_text().split()
    return int(child)


@pytest.mark.parametrize("how", ["killed", "paused"])
def test_a_failed_rank_stops_the_group_and_the_pool_is_reclaimed(how, tp_model, short_lease_blockd, start_executor):
    executor = start_executor(
        tp_model("llama"), short_lease_blockd.endpoint, "--tensor-parallel-size", "2",
        "--tensor-parallel-timeout", "3", "--pool-id", "tp",
    )  # fmt: skip
    worker = _worker_pid(executor.process.pid)
    with executor.client() as client:
        client.submit("long", [5, 6, 7], SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
        client.receive()  # generating
        with short_lease_blockd.client() as blockd:
            assert any(p.pool_id == "tp" and p.blocks_in_use for p in blockd.stats().pools)
        os.kill(worker, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        try:
            assert executor.process.wait(timeout=30) == EX_GROUP_FAILED
        finally:
            if how == "paused":
                os.kill(worker, signal.SIGCONT)
    wait_for(lambda: not Path(f"/proc/{worker}").exists() or _zombie(worker), what="the worker gone")
    with short_lease_blockd.client() as blockd:
        wait_for(lambda: all(p.pool_id != "tp" or not p.blocks_in_use for p in blockd.stats().pools), what="reclaim")
        assert blockd.check() == []
    with pytest.raises(ExecutorUnavailable), executor.client(timeout_s=0.5) as client:
        client.info()
    if how == "killed":  # a restarted group registers the pool under a new epoch and serves it
        again = start_executor(
            tp_model("llama"), short_lease_blockd.endpoint, "--tensor-parallel-size", "2", "--pool-id", "tp"
        )
        prompt = [5, 6, 7, 8]
        with again.client() as client:
            assert tokens_of(client.generate(prompt, PARAMS)[0]) == hf_greedy_ignoring_eos(
                tp_model("llama"), prompt, MAX_TOKENS
            )


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("name", ["llama", "gpt_oss"])
def test_each_rank_reads_only_its_slices(name, tp_model):
    """Loading by rank, without a group: the two ranks' tensors together hold the checkpoint once, plus the
    replicated ones (norms, router) twice and the zeros standing in for rank 1's share of a reduced bias."""
    model = tp_model(name)
    config = load_config(model)
    full = dict(iter_weights(model))
    ranks = [dict(iter_shard_weights(model, config, make_shard(config, r, 2))) for r in range(2)]
    assert ranks[0].keys() == ranks[1].keys() == full.keys()
    for tensor_name, whole in full.items():
        parts = [ranks[r][tensor_name] for r in range(2)]
        if parts[0].shape == whole.shape:  # replicated, or a reduced bias (rank 0's, zeros on rank 1)
            assert parts[0].equal(whole)
            assert parts[1].equal(whole) or not parts[1].any(), tensor_name
            continue
        assert sum(p.numel() for p in parts) == whole.numel(), tensor_name  # split, nothing read twice
    q = full["model.layers.0.self_attn.q_proj.weight"]
    half = q.shape[0] // 2
    assert ranks[0]["model.layers.0.self_attn.q_proj.weight"].equal(q[:half])
    assert ranks[1]["model.layers.0.self_attn.q_proj.weight"].equal(q[half:])
