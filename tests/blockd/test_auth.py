"""Authentication at blockd, against a real blockd process with keys (`--keys DIR`): a peer without a known key
never gets an answer, and each key is kept to its role (executor: its own pool; gateway: lookups; operator:
blockd-cli). A refused request is answered `forbidden` and changes nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from blockd import protocol as p
from blockd.client import BlockdClient, BlockdUnavailable, PoolClient, PoolFenced
from blockd.errors import BlockdError, ErrorCode
from common.auth import KeySet, generate, is_loopback, unkeyed_refusal
from common.net import free_port
from common.tokens import pack_tokens
from tests.support.processes import TEST_BLOCK_SIZES, BlockdProcess

REPO = Path(__file__).resolve().parents[2]
BS = 4


@pytest.fixture
def keys(tmp_path: Path) -> KeySet:
    generate(tmp_path / "keys", ["ex0", "ex1"])
    return KeySet(tmp_path / "keys")


@pytest.fixture
def keyed_blockd(tmp_path: Path, keys: KeySet):
    daemon = BlockdProcess(
        ["--no-persistence", "--keys", str(keys.directory), "--block-sizes", TEST_BLOCK_SIZES],
        tmp_path / "blockd.log",
        curve=keys.client("operator"),
    )
    daemon.start()
    yield daemon
    if daemon.alive():
        daemon.kill9()


def forbidden(call, *args, **kwargs) -> str:
    with pytest.raises(BlockdError) as info:
        call(*args, **kwargs)
    assert info.value.code == ErrorCode.FORBIDDEN, info.value
    return info.value.message


def pool_of(daemon: BlockdProcess, keys: KeySet, pool_id: str, key: str | None = None) -> PoolClient:
    client = daemon.client(timeout_s=2.0, curve=keys.client(key or f"pool-{pool_id}"))
    pool = PoolClient(client, pool_id=pool_id, num_blocks=32, block_size=BS, model_id="tiny")
    pool.register()
    return pool


def state(daemon: BlockdProcess) -> list[dict]:
    with daemon.client() as operator:
        assert operator.check() == []
        pools = msgspec.to_builtins(operator.stats().pools)
    for pool in pools:
        pool.pop("counters")
    return pools


def test_a_peer_without_a_known_key_gets_no_answer(keyed_blockd: BlockdProcess, tmp_path: Path) -> None:
    generate(tmp_path / "strangers")
    stranger = KeySet(tmp_path / "strangers")
    for curve in (None, stranger.client("operator")):  # no keys at all; keys blockd does not know
        with BlockdClient(keyed_blockd.endpoint, timeout_s=0.5) as client:
            client.curve = curve
            with pytest.raises(BlockdUnavailable):
                client.pools()
            with pytest.raises(BlockdUnavailable):
                client.call(p.Register, pool_id="x", num_blocks=8, block_size=BS, model_id="m", epoch=1)
    # blockd is unaffected: it still answers those it knows, and nothing was registered.
    assert keyed_blockd.alive()
    with keyed_blockd.client() as operator:
        assert operator.pools().pools == []
        assert operator.check() == []


def test_operator_commands_work_with_the_operator_key(keyed_blockd: BlockdProcess, keys: KeySet) -> None:
    pool = pool_of(keyed_blockd, keys, "ex0")
    pool.admit("s", list(range(9)))
    pool.commit("s", 8)
    env = {**os.environ, "PYTHONPATH": str(REPO), "PAGEDKV_KEYS": str(keys.directory)}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        options = ["--endpoint", keyed_blockd.endpoint, "--timeout", "2"]
        if args[0] == "--key-name":
            options, args = [*options, *args[:2]], args[2:]
        command = [sys.executable, "-m", "blockd.admin", *options, *args]
        return subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)

    for args in (["stats"], ["pools"], ["seq", "s"], ["check"], ["reset-prefix-cache", "ex0"]):
        done = cli(*args)
        assert done.returncode == 0, (args, done.stdout, done.stderr)
    assert "ex0" in cli("pools").stdout
    # Without the keys, blockd-cli gets no answer (exit 69) and says where keys go.
    env.pop("PAGEDKV_KEYS")
    done = cli("stats")
    assert done.returncode == 69 and "--keys" in done.stderr
    # A gateway's key is not an operator's.
    env["PAGEDKV_KEYS"] = str(keys.directory)
    done = cli("--key-name", "gateway", "check")
    assert done.returncode == 1 and "forbidden" in done.stderr


def test_a_gateway_key_may_only_look_up(keyed_blockd: BlockdProcess, keys: KeySet) -> None:
    owner = pool_of(keyed_blockd, keys, "ex0")
    owner.admit("a", list(range(9)))
    owner.commit("a", 9)
    before = state(keyed_blockd)
    with keyed_blockd.client(curve=keys.client("gateway")) as gateway:
        assert gateway.lookup(list(range(12))) == {"ex0": 8}
        # Stepping, registering over, resetting or inspecting a pool: forbidden, whatever the epoch.
        ops = [p.Free("a"), p.Admit("planted", pack_tokens(list(range(9))), None)]
        assert "gateway" in forbidden(gateway.call, p.Step, pool_id="ex0", epoch=owner.epoch, ops=ops)
        forbidden(gateway.call, p.Heartbeat, pool_id="ex0", epoch=owner.epoch)
        forbidden(gateway.call, p.Register, pool_id="ex0", num_blocks=32, block_size=BS, model_id="tiny", epoch=5)
        forbidden(gateway.call, p.Unregister, pool_id="ex0", epoch=owner.epoch)
        forbidden(gateway.reset_prefix_cache, "ex0")
        forbidden(gateway.stats)
        forbidden(gateway.check)
    assert state(keyed_blockd) == before
    assert owner.step([p.Commit("a", 9)])  # the owner is unaffected


def test_an_executor_key_acts_only_on_its_own_pool(keyed_blockd: BlockdProcess, keys: KeySet) -> None:
    ex0 = pool_of(keyed_blockd, keys, "ex0")
    ex1 = pool_of(keyed_blockd, keys, "ex1")
    ex1.admit("victim", list(range(9)))
    before = state(keyed_blockd)
    # ex0's key, even holding ex1's epoch, may not touch ex1: its key names its pool.
    with keyed_blockd.client(curve=keys.client("pool-ex0")) as intruder:
        message = forbidden(intruder.call, p.Step, pool_id="ex1", epoch=ex1.epoch, ops=[p.Free("victim")])
        assert "ex0" in message
        forbidden(intruder.call, p.Register, pool_id="ex1", num_blocks=32, block_size=BS, model_id="tiny", epoch=7)
        forbidden(intruder.call, p.Heartbeat, pool_id="ex1", epoch=ex1.epoch)
        forbidden(intruder.call, p.Unregister, pool_id="ex1", epoch=ex1.epoch)
        forbidden(intruder.call, p.ResetPrefixCache, pool_id="ex1", epoch=ex1.epoch)
        forbidden(intruder.lookup, list(range(8)))  # nor is it a gateway or an operator
        forbidden(intruder.stats)
        forbidden(intruder.call, p.ResetPrefixCache, pool_id="ex0")  # an executor resets only with its epoch
    assert state(keyed_blockd) == before
    ex0.admit("own", list(range(5)))  # its own pool: fine
    with keyed_blockd.client() as operator:
        assert operator.sequence("victim", "ex1").blocks == ex1.seqs["victim"].blocks


def test_an_any_pool_executor_key_is_still_fenced_by_the_epoch(tmp_path: Path) -> None:
    """The `executor` key (no pool in its name) may register any pool, but a pool another executor holds stays
    its: fencing refuses another epoch (stale_epoch, pool_held) and nothing changes."""
    generate(tmp_path / "keys")
    keys = KeySet(tmp_path / "keys")
    daemon = BlockdProcess(
        ["--no-persistence", "--keys", str(keys.directory), "--block-sizes", TEST_BLOCK_SIZES],
        tmp_path / "blockd.log",
        curve=keys.client("operator"),
    )
    daemon.start()
    try:
        owner = pool_of(daemon, keys, "ex0", key="executor")
        owner.admit("victim", list(range(9)))
        before = state(daemon)
        with daemon.client(curve=keys.client("executor")) as other:
            with pytest.raises(BlockdError) as info:
                other.call(p.Step, pool_id="ex0", epoch=owner.epoch + 1, ops=[p.Free("victim")])
            assert info.value.code == ErrorCode.STALE_EPOCH
            intruder = PoolClient(other, pool_id="ex0", num_blocks=32, block_size=BS, model_id="tiny")
            with pytest.raises(PoolFenced):
                intruder.register()
        assert state(daemon) == before
    finally:
        daemon.kill9()


def test_beyond_loopback_without_keys_blockd_refuses_to_start(tmp_path: Path) -> None:
    port = free_port()
    command = [sys.executable, "-m", "blockd.main", "--no-persistence", "--endpoint", f"tcp://0.0.0.0:{port}"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("PAGEDKV_KEYS", None)
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 2
    assert "beyond loopback" in done.stderr and "--insecure" in done.stderr and "--keys" in done.stderr


def test_which_endpoints_are_loopback() -> None:
    for endpoint in ("tcp://127.0.0.1:5555", "tcp://localhost:1", "tcp://[::1]:5", "ipc:///tmp/x", "inproc://a"):
        assert is_loopback(endpoint), endpoint
    for endpoint in ("tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://10.0.0.2:1", "tcp://eth0:5", "tcp://blockd:5"):
        assert not is_loopback(endpoint), endpoint
    assert unkeyed_refusal("x", "tcp://*:1", None, insecure=True) is None
    assert unkeyed_refusal("x", "tcp://*:1", Path("k"), insecure=False) is None
    assert unkeyed_refusal("x", "tcp://*:1", None, insecure=False)
