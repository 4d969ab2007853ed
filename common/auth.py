"""ZeroMQ authentication: CURVE key files, the roles they grant, and the ZAP authenticator of a service.

A key's file name is its role (`server`, `pool-POOL`, `executor[-NAME]`, `gateway[-NAME]`, `operator[-NAME]`); a
service admits only the public keys of the roles it talks to and maps each message's sender to a `Principal`.
What each role may do, and why: docs/architecture.md ("Security model").
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

KEYS_ENV = "PAGEDKV_KEYS"
SERVER = "server"


class Role(StrEnum):
    EXECUTOR = "executor"
    GATEWAY = "gateway"
    OPERATOR = "operator"


class KeysError(ValueError):
    """A key directory or file that cannot be used."""


@dataclass(frozen=True)
class Principal:
    """Who sent a message: the role of its key, the key's name, and (executors) the pool it may act on."""

    role: Role
    name: str
    pool: str | None = None  # executors: the one pool this key may act on; None: any

    def may_act_on(self, pool_id: str) -> bool:
        return self.pool is None or self.pool == pool_id


@dataclass(frozen=True)
class ClientCurve:
    """What a connecting socket needs: its own keypair and the server's public key."""

    public: bytes
    secret: bytes
    server: bytes

    def apply(self, socket: zmq.Socket) -> None:
        socket.curve_publickey = self.public
        socket.curve_secretkey = self.secret
        socket.curve_serverkey = self.server


_NAME = re.compile(r"^(server|executor|gateway|operator|pool)(?:-(.+))?$")


def principal_of(name: str) -> Principal | None:
    """The principal a key file name stands for (None: not a client key)."""
    match = _NAME.match(name)
    if match is None or match.group(1) == SERVER:
        return None
    if match.group(1) == "pool":
        return Principal(Role.EXECUTOR, name, match.group(2)) if match.group(2) else None
    return Principal(Role(match.group(1)), name)


class KeySet:
    """A directory of key files."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise KeysError(f"{self.directory}: no such key directory (make one with `pagedkv keys generate DIR`)")

    def _load(self, name: str, secret: bool) -> tuple[bytes, bytes | None]:
        path = self.directory / (f"{name}.key_secret" if secret else f"{name}.key")
        try:
            public, secret_key = zmq.auth.load_certificate(path)
        except (OSError, ValueError) as exc:
            raise KeysError(f"{path}: {exc}") from None
        if secret and not secret_key:
            raise KeysError(f"{path}: no secret key in it")
        return public, secret_key

    def server_keypair(self) -> tuple[bytes, bytes]:
        public, secret = self._load(SERVER, secret=True)
        assert secret is not None
        return public, secret

    def client(self, name: str) -> ClientCurve:
        """The keys a client named `name` (gateway, operator, pool-POOL, executor, ...) connects with."""
        public, secret = self._load(name, secret=True)
        assert secret is not None
        server, _ = self._load(SERVER, secret=False)
        return ClientCurve(public, secret, server)

    def executor_client(self, pool_id: str) -> ClientCurve:
        """An executor's keys: pool-POOL if there is one, else the any-pool `executor` key."""
        own = f"pool-{pool_id}"
        if (self.directory / f"{own}.key_secret").exists():
            return self.client(own)
        return self.client("executor")

    def principals(self, roles: Iterable[Role]) -> dict[bytes, Principal]:
        """z85 public key -> principal, for every client key of these roles in the directory."""
        wanted = set(roles)
        found: dict[bytes, Principal] = {}
        for path in sorted(self.directory.glob("*.key")):
            principal = principal_of(path.stem)
            if principal is None or principal.role not in wanted:
                continue
            public, _ = self._load(path.stem, secret=False)
            found[public] = principal
        return found


def generate(directory: str | os.PathLike[str], pools: Iterable[str] = (), *, force: bool = False) -> list[Path]:
    """Write a key set: server, gateway, operator, and `executor` (any pool) or one `pool-POOL` per pool."""
    target = Path(directory)
    target.mkdir(parents=True, exist_ok=True)
    os.chmod(target, 0o700)
    names = [SERVER, "gateway", "operator", *([f"pool-{p}" for p in pools] or ["executor"])]
    existing = [n for n in names if (target / f"{n}.key").exists() or (target / f"{n}.key_secret").exists()]
    if existing and not force:
        raise KeysError(f"{target} already holds keys ({', '.join(existing)}): use another directory or --force")
    written: list[Path] = []
    for name in names:
        principal = principal_of(name)
        metadata = {"role": principal.role.value if principal else SERVER}
        if principal is not None and principal.pool is not None:
            metadata["pool"] = principal.pool
        public, secret = zmq.auth.create_certificates(target, name, metadata)
        os.chmod(secret, 0o600)
        written += [Path(public), Path(secret)]
    return written


class _Credentials:
    def __init__(self, allowed: dict[bytes, Principal]) -> None:
        self.allowed = allowed

    def callback(self, _domain: str, key: bytes) -> bool:
        return key in self.allowed


class ServerAuth:
    """A service's side: CURVE on its listening socket, a ZAP handler admitting the keys of `roles`, and the
    principal of each message."""

    def __init__(self, context: zmq.Context, keys: KeySet, roles: Iterable[Role]) -> None:
        self.keys = keys
        self.public, self.secret = keys.server_keypair()
        self.principals = keys.principals(roles)
        if not self.principals:
            raise KeysError(
                f"{keys.directory} holds no key of {', '.join(r.value for r in roles)}: nobody could connect"
            )
        self._authenticator = ThreadAuthenticator(context)
        self._authenticator.start()
        self._authenticator.configure_curve_callback("*", _Credentials(self.principals))

    def secure(self, socket: zmq.Socket) -> None:
        """Make a listening socket CURVE-only (before bind)."""
        socket.curve_secretkey = self.secret
        socket.curve_publickey = self.public
        socket.curve_server = True

    def principal(self, frame: Any) -> Principal | None:
        """Who sent this frame (a zmq.Frame received with copy=False); None if unknown."""
        try:
            user_id = frame.get("User-Id")
        except zmq.ZMQError:
            return None
        if isinstance(user_id, str):
            user_id = user_id.encode()
        return self.principals.get(user_id)

    def stop(self) -> None:
        self._authenticator.stop()


def is_loopback(endpoint: str) -> bool:
    """Whether a ZeroMQ endpoint (or a bare host) is reachable only from this machine."""
    transport, _, rest = endpoint.partition("://")
    if not rest:
        host = endpoint
    elif transport in ("ipc", "inproc"):
        return True
    else:
        host = rest.rsplit(":", 1)[0] if not rest.startswith("[") else rest[1 : rest.index("]")]
        host = host.split(";")[-1]  # tcp://src;dst
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # *, an interface name or a host name: may be reachable from elsewhere


def unkeyed_refusal(what: str, endpoint: str, keys: object, insecure: bool) -> str | None:
    """Why a service must not start: bound beyond loopback without keys and without --insecure (else None)."""
    if keys is not None or insecure or is_loopback(endpoint):
        return None
    return (
        f"{what} would listen on {endpoint}, beyond loopback, without keys: give --keys DIR (or {KEYS_ENV}; make "
        "them with `pagedkv keys generate DIR`), or --insecure to run unauthenticated anyway"
    )
