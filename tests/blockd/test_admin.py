"""blockd-cli and `pagedkv bench blockd` as an operator runs them: real processes, real output."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from blockd.client import BlockdClient, PoolClient
from common.net import free_port
from tests.support.waiting import wait_for

BIN = Path(sys.executable).parent


def cli(endpoint: str, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "blockd-cli"), "--endpoint", endpoint, *args], capture_output=True, text=True, timeout=timeout
    )


def test_stats_pools_seq_check_reset_against_a_live_daemon(redis_process, start_blockd):
    daemon = start_blockd("--redis-url", redis_process.url, "--flush-interval", "0.05")
    ex = PoolClient(BlockdClient(daemon.endpoint), pool_id="gpu0", num_blocks=40, block_size=4, model_id="tiny")
    ex.register()
    ex.admit("done", list(range(17)))
    ex.commit("done", 17)
    ex.free("done")
    ex.admit("live", [*list(range(17)), 5, 6])  # 4 cached blocks reused, one new
    ex.append("live", [1, 2])  # 21 tokens in 6 blocks: 3 empty slots in the last one

    stats = cli(daemon.endpoint, "stats", "--json")
    assert stats.returncode == 0, stats.stderr
    figures = json.loads(stats.stdout)
    (pool,) = figures["pools"]
    assert pool["pool_id"] == "gpu0"
    assert pool["blocks_total"] == 40 and pool["blocks_in_use"] == 6 and pool["live_sequences"] == 1
    assert pool["blocks_cached_free"] == 0  # the cached blocks are in use again
    assert pool["blocks_never_used"] == 40 - 5 - 1
    assert pool["kv_utilization"] == 21 / 24
    assert pool["prefix_hit_rate_tokens"] == 16 / (17 + 19)
    assert figures["totals"]["blocks_in_use"] == 6
    assert figures["persistence"]["state"] == "ok" and figures["persistence"]["enabled"]
    assert figures["uptime_s"] > 0

    table = cli(daemon.endpoint, "stats")
    assert table.returncode == 0
    assert "gpu0" in table.stdout and "TOTAL" in table.stdout and "persistence: ok" in table.stdout
    assert "87.5%" in table.stdout  # kv utilization 21/24

    pools = cli(daemon.endpoint, "pools", "--json")
    (info,) = json.loads(pools.stdout)["pools"]
    assert "epoch" not in info and info["epoch_fingerprint"] == ex.epoch_fingerprint  # the epoch stays secret
    assert str(ex.epoch) not in pools.stdout + cli(daemon.endpoint, "stats", "--json").stdout
    assert ex.epoch_fingerprint in cli(daemon.endpoint, "pools").stdout

    seq = cli(daemon.endpoint, "seq", "live", "--json")
    assert json.loads(seq.stdout)["blocks"] == ex.seqs["live"].blocks
    assert json.loads(seq.stdout)["num_tokens"] == 21
    missing = cli(daemon.endpoint, "seq", "ghost")
    assert missing.returncode == 1 and "unknown_sequence" in missing.stderr

    check = cli(daemon.endpoint, "check")
    assert check.returncode == 0 and "every invariant holds" in check.stdout

    reset = cli(daemon.endpoint, "reset-prefix-cache", "gpu0")
    assert reset.returncode == 0 and "dropped 4 index entries" in reset.stdout
    assert BlockdClient(daemon.endpoint).lookup(list(range(17))) == {"gpu0": 0}
    unknown = cli(daemon.endpoint, "reset-prefix-cache", "nope")
    assert unknown.returncode == 1 and "unknown_pool" in unknown.stderr


def test_unreachable_blockd_is_a_clear_error_not_a_hang():
    started = time.monotonic()
    result = cli("tcp://127.0.0.1:9", "--timeout", "1", "stats")
    assert time.monotonic() - started < 10
    assert result.returncode == 69
    assert "did not answer within 1 s" in result.stderr and "is blockd running?" in result.stderr


def test_blockd_rejects_bad_flags_with_help():
    result = subprocess.run(
        [str(BIN / "blockd"), "--max-message-bytes", "lots"], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 2 and "is not a size" in result.stderr
    help_text = subprocess.run([str(BIN / "blockd"), "--help"], capture_output=True, text=True, timeout=30).stdout
    assert "--lease-timeout" in help_text and "--redis-url" in help_text
    for flag in (
        "--max-pools",
        "--max-blocks-per-pool",
        "--block-sizes",
        "--max-lookup-tokens",
        "--receive-queue",
        "--redis-prefix",
        "--persistence-queue",
    ):
        assert flag in help_text, flag
    assert "8,16,32,64" in help_text  # the kernels' block sizes by default
    bad = subprocess.run([str(BIN / "blockd"), "--block-sizes", "16,x"], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "--block-sizes" in bad.stderr


def test_bench_blockd_quick_prints_tables_and_a_json_last_line():
    result = subprocess.run(
        [str(BIN / "pagedkv"), "bench", "blockd", "--quick"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert any("in-process core" in line for line in lines)
    figures = json.loads(lines[-1])
    for key in (
        "inproc_block_ops_per_s",
        "rpc_step_p50_us",
        "rpc_step_p99_us",
        "rpc_block_ops_per_s",
        "persist_throughput_ratio",
    ):
        assert figures[key] > 0, key


def test_prometheus_metrics_endpoint(start_blockd):
    import urllib.request

    port = free_port()
    daemon = start_blockd("--no-persistence", "--metrics-port", str(port))
    ex = PoolClient(BlockdClient(daemon.endpoint), pool_id="gpu0", num_blocks=16, block_size=4, model_id="tiny")
    ex.register()
    ex.admit("s", list(range(9)))

    def scrape() -> str:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        return text if 'blockd_pool_blocks_in_use{pool="gpu0"} 3.0' in text else ""

    text = wait_for(scrape, timeout_s=10, what="pool gauges")
    assert 'blockd_requests_total{op="step",outcome="ok"}' in text
    assert "blockd_request_seconds_bucket" in text
    assert "blockd_persistence_degraded 0.0" in text


def test_check_reports_a_corrupted_pool_with_exit_status_1():
    """A real BlockdServer on a real socket (in a thread, so the test can corrupt its state directly)."""
    import threading

    import zmq
    from click.testing import CliRunner

    from blockd import admin as blockd_admin
    from blockd.manager import BlockManager
    from blockd.persistence import NoPersistence
    from blockd.server import BlockdServer

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    manager = BlockManager()
    server = BlockdServer(manager, NoPersistence())
    context = zmq.Context()
    socket = context.socket(zmq.ROUTER)
    socket.bind(endpoint)
    thread = threading.Thread(target=server.serve, args=(socket,), daemon=True)
    thread.start()
    try:
        ex = PoolClient(BlockdClient(endpoint), pool_id="gpu0", num_blocks=8, block_size=4, model_id="tiny")
        ex.register()
        ex.admit("s", list(range(6)))
        runner = CliRunner()
        assert runner.invoke(blockd_admin.main, ["--endpoint", endpoint, "check"]).exit_code == 0

        manager.pools["gpu0"].refcount[ex.seqs["s"].blocks[0]] += 1  # a leaked reference
        result = runner.invoke(blockd_admin.main, ["--endpoint", endpoint, "check"])
        assert result.exit_code == 1
        assert "I2 block" in result.output and "1 invariant violation(s)" in result.output
    finally:
        server.stop()
        thread.join(timeout=5)
        socket.close(linger=0)
        context.term()


def test_a_second_blockd_on_the_same_state_dir_refuses_to_start(start_blockd, tmp_path):
    state = tmp_path / "state"
    start_blockd("--state-dir", str(state))
    result = subprocess.run(
        [str(BIN / "blockd"), "--endpoint", f"tcp://127.0.0.1:{free_port()}", "--state-dir", str(state)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1 and "in use by another process" in result.stderr


def _cli_module(endpoint: str, *args: str) -> subprocess.CompletedProcess[str]:
    """blockd-cli as `python -m blockd.admin`: this checkout's code, whichever package the console script names."""
    argv = [sys.executable, "-m", "blockd.admin", "--endpoint", endpoint, *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=30)


def test_stats_and_metrics_show_each_tier_of_a_pool(start_blockd):
    import urllib.request

    from blockd.tiers import TierSpec

    port = free_port()
    daemon = start_blockd("--no-persistence", "--metrics-port", str(port))
    ex = PoolClient(BlockdClient(daemon.endpoint), pool_id="gpu0", num_blocks=4, block_size=4, model_id="tiny")
    ex.tiers = lambda: TierSpec(host_blocks=2, disk_blocks=8)
    ex.register()
    for first in (0, 100, 200):  # each prompt takes every block: the one before is demoted
        ex.admit(f"s{first}", list(range(first, first + 13)))
        ex.commit(f"s{first}", 13)
        ex.free(f"s{first}")
    table = _cli_module(daemon.endpoint, "stats")
    assert table.returncode == 0, table.stderr
    rows = {
        line.split()[1]: line.split()
        for line in table.stdout.splitlines()
        if line.startswith("gpu0 ") and len(line.split()) == 7
    }
    assert "CPU" in rows, table.stdout
    assert rows["CPU"][2] == "2/2" and rows["DISK"][2].endswith("/8")
    (pool,) = json.loads(_cli_module(daemon.endpoint, "stats", "--json").stdout)["pools"]
    cpu, disk = pool["tiers"]
    assert cpu["medium"] == "CPU" and cpu["counters"]["demotions"] == 6 and disk["counters"]["demotions"] == 4
    assert _cli_module(daemon.endpoint, "check").returncode == 0

    def scrape() -> str:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        return text if 'blockd_pool_tier_demotions{medium="DISK",pool="gpu0"} 4.0' in text else ""

    text = wait_for(scrape, timeout_s=10, what="tier gauges")
    assert 'blockd_pool_tier_capacity_blocks{medium="CPU",pool="gpu0"} 2.0' in text
