"""blockd against a real redis-server that wants a password, an ACL user, or TLS (rediss://, with certificates this
test makes), and a deployment secret that keys the hashes it stores. The URL's secret never shows in stats, logs
or errors."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from blockd.client import PoolClient
from blockd.embedded_redis import find_redis_server
from blockd.hashing import chain_hashes, extra_key, root_hash, secret_key
from blockd.persistence import redact
from common.net import free_port
from tests.support.processes import TEST_BLOCK_SIZES, BlockdProcess
from tests.support.waiting import wait_for

PASSWORD = "pw-Zq81-not-in-logs"
ACL_PASSWORD = "acl-Kx55-not-in-logs"
BS = 4


def _supports_tls(binary: str) -> bool:
    """A redis-server built with TLS complains of the missing certificate; one without, of an unknown directive."""
    command = [binary, "--port", "0", "--tls-port", str(free_port()), "--bind", "127.0.0.1", "--save", ""]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=5)
    except subprocess.TimeoutExpired:
        return True
    return "tls-cert-file" in done.stdout + done.stderr


@pytest.fixture
def start_redis(tmp_path: Path) -> Iterator:
    processes: list[subprocess.Popen[bytes]] = []

    def start(*args: str) -> None:
        process = subprocess.Popen(
            [
                find_redis_server(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(tmp_path),
                *args,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        processes.append(process)

    yield start
    for process in processes:
        process.kill()
        process.wait()


def run_blockd(tmp_path: Path, url: str, *extra: str) -> BlockdProcess:
    daemon = BlockdProcess(
        ["--redis-url", url, "--flush-interval", "0.05", "--block-sizes", TEST_BLOCK_SIZES, *extra],
        tmp_path / f"blockd-{time.monotonic_ns()}.log",
    )
    daemon.start()
    return daemon


def commit_a_prefix(daemon: BlockdProcess, tokens: list[int]) -> None:
    pool = PoolClient(daemon.client(), pool_id="ex0", num_blocks=32, block_size=BS, model_id="tiny")
    pool.register()
    pool.admit("s", tokens)
    pool.commit("s", len(tokens))


def persisted_hashes(client: redis.Redis) -> set[bytes]:
    """Every 16-byte string inside the index records blockd wrote (snapshot and log lists of msgpack blobs): the
    block hashes among them."""
    found: set[bytes] = set()
    for key in client.scan_iter(match="*"):
        if client.type(key) == b"list":
            for blob in client.lrange(key, 0, -1):
                found |= {blob[i : i + 16] for i in range(max(len(blob) - 15, 0))}
    return found


def index_records(client: redis.Redis) -> int:
    return sum(client.llen(key) for key in client.scan_iter(match="*") if client.type(key) == b"list")


def secret_free(daemon: BlockdProcess, *secrets: str) -> str:
    with daemon.client() as operator:
        stats = operator.stats()
    text = repr(stats) + daemon.log()
    for secret in secrets:
        assert secret not in text
    return stats.persistence.redis


def test_password_and_acl_user_in_the_url(start_redis, tmp_path: Path) -> None:
    port = free_port()
    start_redis(
        "--port",
        str(port),
        "--requirepass",
        PASSWORD,
        "--user",
        "blockd",
        "on",
        f">{ACL_PASSWORD}",
        "~*",
        "&*",
        "+@all",
    )
    wait_for(lambda: _pings(f"redis://:{PASSWORD}@127.0.0.1:{port}/0"), what="redis with a password")
    for url, secret in (
        (f"redis://:{PASSWORD}@127.0.0.1:{port}/0", PASSWORD),
        (f"redis://blockd:{ACL_PASSWORD}@127.0.0.1:{port}/0", ACL_PASSWORD),
    ):
        daemon = run_blockd(tmp_path, url)
        try:
            commit_a_prefix(daemon, list(range(9)))
            client = redis.Redis.from_url(url)
            wait_for(lambda client=client: index_records(client) >= 1, what="the index in redis")
            shown = secret_free(daemon, secret)
            assert shown == f"redis://***@127.0.0.1:{port}/0"
            with daemon.client() as operator:
                assert operator.stats().persistence.state == "ok"
        finally:
            daemon.kill9()
    # A wrong password: blockd runs without persistence for now, says why, and never shows the password it has.
    wrong = f"redis://:wrong-{PASSWORD}@127.0.0.1:{port}/0"
    daemon = run_blockd(tmp_path, wrong)
    try:
        with daemon.client() as operator:
            persistence = operator.stats().persistence
        assert persistence.state == "degraded" and persistence.last_error
        secret_free(daemon, PASSWORD)
    finally:
        daemon.kill9()


def test_password_from_a_file(start_redis, tmp_path: Path) -> None:
    """--redis-password-file (a compose or Kubernetes secret): the URL names no password, the file gives it."""
    port = free_port()
    start_redis("--port", str(port), "--requirepass", PASSWORD)
    wait_for(lambda: _pings(f"redis://:{PASSWORD}@127.0.0.1:{port}/0"), what="redis with a password")
    password_file = tmp_path / "redis-password"
    password_file.write_text(PASSWORD + "\n")
    daemon = run_blockd(tmp_path, f"redis://127.0.0.1:{port}/0", "--redis-password-file", str(password_file))
    try:
        commit_a_prefix(daemon, list(range(9)))
        client = redis.Redis.from_url(f"redis://:{PASSWORD}@127.0.0.1:{port}/0")
        wait_for(lambda: index_records(client) >= 1, what="the index in redis")
        assert secret_free(daemon, PASSWORD) == f"redis://127.0.0.1:{port}/0"
        with daemon.client() as operator:
            assert operator.stats().persistence.state == "ok"
    finally:
        daemon.kill9()


def _pings(url: str, **kwargs) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_timeout=1, **kwargs).ping())
    except redis.RedisError:
        return False


def test_redact_removes_every_credential() -> None:
    assert redact("redis://:pw@h:1/0") == "redis://***@h:1/0"
    assert redact("rediss://user:p@ss@h:1/0?ssl_ca_certs=/x") == "rediss://***@h:1/0?ssl_ca_certs=/x"
    assert redact("redis://h:1/0") == "redis://h:1/0"


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl to make certificates")
def test_tls_with_rediss_and_a_deployment_secret(start_redis, tmp_path: Path) -> None:
    binary = find_redis_server()
    if not _supports_tls(binary):
        pytest.skip(f"{binary} is built without TLS: install Debian's redis-server (.ci/run does)")
    certs = tmp_path / "certs"
    certs.mkdir()

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=certs, check=True, capture_output=True)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=test-ca", "-keyout",
            "ca.key", "-out", "ca.crt")  # fmt: skip
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", "redis.key", "-out",
            "redis.csr")  # fmt: skip
    (certs / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", "redis.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-days",
            "1", "-extfile", "san.ext", "-out", "redis.crt")  # fmt: skip
    port = free_port()
    start_redis(
        "--port", "0", "--tls-port", str(port), "--tls-cert-file", str(certs / "redis.crt"), "--tls-key-file",
        str(certs / "redis.key"), "--tls-ca-cert-file", str(certs / "ca.crt"), "--tls-auth-clients", "no",
        "--requirepass", PASSWORD,
    )  # fmt: skip
    url = f"rediss://:{PASSWORD}@127.0.0.1:{port}/0?ssl_ca_certs={certs / 'ca.crt'}"
    wait_for(lambda: _pings(url), what="redis over TLS")
    assert not _pings(f"redis://:{PASSWORD}@127.0.0.1:{port}/0"), "the port speaks TLS only"

    tokens = list(range(9))
    daemon = run_blockd(tmp_path, url, "--deployment-secret", "the-deployment-secret")
    try:
        commit_a_prefix(daemon, tokens)
        client = redis.Redis.from_url(url)
        wait_for(lambda: index_records(client) >= 1, what="the index in redis over TLS")
        shown = secret_free(daemon, PASSWORD, "the-deployment-secret")
        assert shown.startswith("rediss://***@127.0.0.1:")
        stored = persisted_hashes(client)
    finally:
        daemon.kill9()
    # The stored hashes are keyed: without the secret nobody can tell they stand for these tokens.
    key = secret_key("the-deployment-secret")
    plain = chain_hashes(tokens, BS, root_hash(), extra_key("tiny"))
    keyed = chain_hashes(tokens, BS, root_hash(key=key), extra_key("tiny", key=key), key=key)
    assert set(keyed) <= stored
    assert not set(plain) & stored
