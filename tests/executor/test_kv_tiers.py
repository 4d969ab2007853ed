"""The host and disk KV tiers with real processes (blockd, executors): a prefix evicted from the device is
demoted and loaded back on its next admission, greedy output equal to transformers'; the disk tier survives a
kill -9 of the executor; corrupt, truncated, torn and foreign block files are dropped and counted, never read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from blockd.pool import BlockPool, PoolSpec
from blockd.tiers import TierStats
from executor.client import ExecutorClient, tokens_of
from executor.kv_tiers import KvLayout, encode_block
from executor.params import SamplingParams
from tests.executor.harness import hf_greedy_ignoring_eos, random_prompts
from tests.support.processes import BlockdProcess, ExecutorProcess
from tests.support.waiting import wait_for

BS = 16
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
#: 12 device blocks: five prompts of 4 full blocks and a token each cannot all stay cached on the device.
DEVICE = ("--block-size", str(BS), "--num-blocks", "12")


@pytest.fixture
def daemon(tmp_path: Path):
    """blockd with a short lease, so that a restarted executor takes its pool back soon after a kill -9."""
    blockd = BlockdProcess(["--no-persistence", "--lease-timeout", "1"], tmp_path / "blockd.log")
    blockd.start()
    yield blockd
    with blockd.client() as client:
        assert client.check() == []
    blockd.kill9()


@pytest.fixture
def executors(tmp_path: Path):
    started: list[ExecutorProcess] = []

    def start(model: Path, endpoint: str, *args: str) -> ExecutorProcess:
        executor = ExecutorProcess(model, endpoint, tmp_path / f"executor-{len(started)}.log", *args)
        started.append(executor)
        executor.wait_ready()
        return executor

    yield start
    for executor in started:
        executor.stop()


def _generate(client: ExecutorClient, prompt: list[int]) -> tuple[list[int], int]:
    (deltas,) = client.generate(prompt, GREEDY)
    return tokens_of(deltas), deltas[-1].cached_tokens


def _tiers(daemon: BlockdProcess) -> dict[str, TierStats]:
    with daemon.client() as client:
        (pool,) = client.stats().pools
    return {t.medium: t for t in pool.tiers}


def _evict(client: ExecutorClient, prompts: list[list[int]]) -> None:
    for prompt in prompts:
        client.generate(prompt, GREEDY)


def test_a_prefix_evicted_from_the_device_is_loaded_back_from_host_memory(tiny_models, daemon, executors):
    model = tiny_models["llama"]
    executor = executors(model, daemon.endpoint, *DEVICE, "--host-kv-memory", "2MiB")
    prompts = random_prompts([4 * BS + 1] * 5, 512, seed=3)
    want = hf_greedy_ignoring_eos(model, prompts[0], GREEDY.max_tokens)
    with executor.client() as client:
        assert _generate(client, prompts[0]) == (want, 0)
        _evict(client, prompts[1:])
        assert _generate(client, prompts[0]) == (want, 4 * BS)  # every full block loaded, output unchanged
        tiers = client.load().tiers
    cpu = _tiers(daemon)["CPU"]
    assert cpu.counters.loads >= 4 and cpu.counters.demotions >= 4 and cpu.blocks > 0
    assert tiers["loads_cpu"] >= 4 and tiers["saves_cpu"] >= 4


def test_the_disk_tier_survives_a_kill_and_drops_every_bad_file(tiny_models, daemon, executors, tmp_path):
    model = tiny_models["llama"]
    disk = tmp_path / "kv"
    flags = (
        *DEVICE,
        "--pool-id",
        "ex",
        "--host-kv-memory",
        "64KiB",
        "--disk-kv-dir",
        str(disk),
        "--disk-kv-size",
        "8MiB",
    )
    executor = executors(model, daemon.endpoint, *flags)
    prompts = random_prompts([4 * BS + 1] * 5, 512, seed=4)
    want = hf_greedy_ignoring_eos(model, prompts[0], GREEDY.max_tokens)
    info = executor.wait_ready()
    hashes = BlockPool(PoolSpec("x", 1, BS, info.model_id, 1)).prompt_hashes(prompts[0])
    files = [disk / f"{h.hex()}.kvb" for h in hashes]
    with executor.client() as client:
        assert _generate(client, prompts[0]) == (want, 0)
        _evict(client, prompts[1:])  # a's blocks: device -> host (4 slots) -> disk, written behind
        wait_for(lambda: all(f.exists() for f in files), timeout_s=20, what="a's blocks written to disk")
        # Corrupt a's second block while it is on disk only: its load fails, it is recomputed, never read.
        data = bytearray(files[1].read_bytes())
        data[-1] ^= 0xFF
        files[1].write_bytes(bytes(data))
        tokens, cached = _generate(client, prompts[0])
        assert tokens == want
        report = client.load().tiers
    assert report["dropped_corrupt"] == 1 and report["loads_disk"] >= 1
    assert cached == BS  # the first block loaded; the rest computed from the corrupt one on
    executor.stop()  # kill -9
    good = next(f for f in disk.iterdir() if f.suffix == ".kvb")
    # The layout JSON follows the 48-byte header, its length in bytes 6-8 (a "}" can fall in the hash or checksum).
    layout_length = int.from_bytes(good.read_bytes()[6:8], "little")
    layout = json.loads(good.read_bytes()[48 : 48 + layout_length])
    other = KvLayout(**{**layout, "model_id": "another-model"})
    planted = {
        "foreign-layout": encode_block(other, b"\x01" * 16, b"\x00" * other.block_bytes),
        "truncated": good.read_bytes()[:100],
        "corrupt": good.read_bytes()[:-1] + bytes([good.read_bytes()[-1] ^ 1]),
        "wrong-name": good.read_bytes(),
    }
    for i, data in enumerate(planted.values()):
        (disk / f"{(bytes([i + 2]) * 16).hex()}.kvb").write_bytes(data)
    (disk / "torn.kvb.tmp").write_bytes(b"half a block")
    restarted = executors(model, daemon.endpoint, *flags)
    with restarted.client() as client:
        tokens, cached = _generate(client, prompts[0])
        report = client.load().tiers
    assert tokens == want
    assert cached >= BS  # a's blocks on disk hit again after the restart
    assert report["loads_disk"] >= 1
    assert report["dropped_foreign"] == 2 and report["dropped_truncated"] == 2 and report["dropped_corrupt"] == 1
    assert not any(disk.glob("*.tmp"))


def test_fp8_blocks_go_through_host_and_disk_byte_for_byte(tiny_models, daemon, executors, tmp_path):
    """An fp8 cache's blocks (1 byte an element, its scales in the layout) come back from the tiers unchanged:
    the answer after a load is the answer computed the first time."""
    model = tiny_models["qwen2"]
    disk = ("--disk-kv-dir", str(tmp_path / "kv8"), "--disk-kv-size", "4MiB")
    executor = executors(model, daemon.endpoint, *DEVICE, "--kv-cache-dtype", "fp8", "--host-kv-memory", "32KiB", *disk)
    prompts = random_prompts([4 * BS + 1] * 5, 512, seed=5)
    with executor.client() as client:
        first, cached = _generate(client, prompts[0])
        assert cached == 0
        _evict(client, prompts[1:])
        assert _generate(client, prompts[0]) == (first, 4 * BS)
        report = client.load().tiers
    assert report["loads_disk"] + report["loads_cpu"] >= 4 and report["spills"] > 0


def test_a_failing_disk_loses_blocks_but_never_an_answer(tiny_models, daemon, executors, tmp_path):
    """Writes that fail (here: a directory squats each file's name, as a full or broken disk would refuse them)
    are counted and blockd hears of them at the next step, so it never sends a load of a block not written (no
    drop counted): the blocks are recomputed."""
    model = tiny_models["llama"]
    disk = tmp_path / "kv"
    executor = executors(model, daemon.endpoint, *DEVICE, "--disk-kv-dir", str(disk), "--disk-kv-size", "4MiB")
    prompts = random_prompts([4 * BS + 1] * 5, 512, seed=6)
    want = hf_greedy_ignoring_eos(model, prompts[0], GREEDY.max_tokens)
    info = executor.wait_ready()
    for h in BlockPool(PoolSpec("x", 1, BS, info.model_id, 1)).prompt_hashes(prompts[0]):
        (disk / f"{h.hex()}.kvb" / "squatter").mkdir(parents=True)
    with executor.client() as client:
        assert _generate(client, prompts[0]) == (want, 0)
        _evict(client, prompts[1:])
        wait_for(lambda: client.load().tiers.get("write_failures", 0) >= 4, timeout_s=20, what="the writes failed")
        tokens, cached = _generate(client, prompts[0])
        report = client.load().tiers
    assert tokens == want and cached == 0
    assert report["dropped_truncated"] == 0 and report.get("loads_disk", 0) == 0
    # The next step tells blockd, whose directory forgets them (it would otherwise load them, and never store them
    # anew).
    wait_for(lambda: _tiers(daemon)["DISK"].counters.drops >= 1, timeout_s=20, what="blockd forgot the lost blocks")
