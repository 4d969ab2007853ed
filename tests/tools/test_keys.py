"""`pagedkv keys generate`: a key set of ZeroMQ certificates whose names say what each key may do."""

from __future__ import annotations

import stat
from pathlib import Path

import zmq.auth
from click.testing import CliRunner

from common.auth import KeySet, Principal, Role, principal_of
from pagedkv.cli import main


def test_generate_writes_server_and_role_keys(tmp_path: Path) -> None:
    target = tmp_path / "keys"
    result = CliRunner().invoke(main, ["keys", "generate", str(target), "--pool", "executor-0", "--pool", "gpu-1"])
    assert result.exit_code == 0, result.output
    names = sorted(p.name for p in target.iterdir())
    expected = ["gateway", "operator", "pool-executor-0", "pool-gpu-1", "server"]
    assert names == sorted([*(f"{n}.key" for n in expected), *(f"{n}.key_secret" for n in expected)])
    for name in expected:
        public, secret = zmq.auth.load_certificate(target / f"{name}.key_secret")
        assert secret and public == zmq.auth.load_certificate(target / f"{name}.key")[0]
        assert stat.S_IMODE((target / f"{name}.key_secret").stat().st_mode) == 0o600
    principals = KeySet(target).principals(Role)
    assert sorted(principals.values(), key=lambda p: p.name) == [
        Principal(Role.GATEWAY, "gateway"),
        Principal(Role.OPERATOR, "operator"),
        Principal(Role.EXECUTOR, "pool-executor-0", "executor-0"),
        Principal(Role.EXECUTOR, "pool-gpu-1", "gpu-1"),
    ]
    # A second run does not overwrite keys in use unless told to.
    again = CliRunner().invoke(main, ["keys", "generate", str(target)])
    assert again.exit_code == 1 and "--force" in again.output
    assert CliRunner().invoke(main, ["keys", "generate", str(target), "--force"]).exit_code == 0
    assert (target / "executor.key_secret").exists()  # no --pool: one key for any pool


def test_key_names_and_roles() -> None:
    assert principal_of("server") is None and principal_of("notes") is None and principal_of("pool") is None
    assert principal_of("executor") == Principal(Role.EXECUTOR, "executor", None)
    assert principal_of("pool-a-b") == Principal(Role.EXECUTOR, "pool-a-b", "a-b")
    assert principal_of("gateway-eu") == Principal(Role.GATEWAY, "gateway-eu")
    assert principal_of("pool-x").may_act_on("x") and not principal_of("pool-x").may_act_on("y")
