"""The join of a tensor-parallel group whose ranks are started independently (one process per node or pod, as a
LeaderWorkerSet runs them): the workers ask rank 0 (the leader) to be admitted over ZeroMQ, CURVE-authenticated
like every other link; the leader answers each, once all N-1 have asked, with the group's settings, the
torch.distributed store's port and a fresh group token. Every rank then proves it holds the token
(`parallel.prove_membership`), so a process that reached the store without being admitted stops the group before
it serves. Why and what is not covered: docs/architecture.md ("Tensor parallelism", "Security model").
"""

from __future__ import annotations

import ipaddress
import json
import secrets
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import structlog
import zmq

from common.auth import ClientCurve, KeySet, Role, ServerAuth

log = structlog.get_logger("executor")

DEFAULT_PORT = 5570  # the leader's join port (--tp-master HOST:PORT, or LWS_LEADER_ADDRESS and this port)
_MAX_MESSAGE = 64 * 1024  # a join is a few hundred bytes: a peer cannot make the leader read more


class RendezvousError(RuntimeError):
    """The group could not be formed: a rank did not come in time, or the leader refused this one."""


@dataclass(frozen=True)
class Placement:
    """Where this process stands in its group: rank `rank` of `size`, the leader's join address, or (master
    None) the default: rank 0 starts ranks 1..N-1 as its children on loopback."""

    size: int
    rank: int = 0
    master: str | None = None  # "HOST:PORT"

    @property
    def independent(self) -> bool:
        return self.master is not None

    @property
    def host(self) -> str:
        assert self.master is not None
        return self.master.rsplit(":", 1)[0].strip("[]")

    @property
    def port(self) -> int:
        assert self.master is not None
        return int(self.master.rsplit(":", 1)[1])


def placement(size: int, rank: int | None, master: str | None, environ: Mapping[str, str]) -> Placement:
    """The options, else what a LeaderWorkerSet puts in every pod's environment (LWS_GROUP_SIZE,
    LWS_WORKER_INDEX, LWS_LEADER_ADDRESS; the leader's port is then DEFAULT_PORT). ValueError says what is wrong."""
    if master is None and environ.get("LWS_LEADER_ADDRESS"):
        if size == 1 and environ.get("LWS_GROUP_SIZE"):
            size = _int(environ["LWS_GROUP_SIZE"], "LWS_GROUP_SIZE")
        if rank is None and environ.get("LWS_WORKER_INDEX"):
            rank = _int(environ["LWS_WORKER_INDEX"], "LWS_WORKER_INDEX")
        if size > 1:  # a group of one is a plain executor
            master = f"{environ['LWS_LEADER_ADDRESS']}:{DEFAULT_PORT}"
    rank = rank or 0
    if master is None:
        if rank:
            raise ValueError("--tp-rank above 0 joins a leader: give --tp-master HOST:PORT")
        return Placement(size)
    host, sep, port = master.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{master!r} is not HOST:PORT")
    if size < 2:
        raise ValueError("--tp-master needs --tensor-parallel-size 2 or more")
    if not 0 <= rank < size:
        raise ValueError(f"--tp-rank {rank} is not a rank of a group of {size}")
    return Placement(size, rank, master)


def _int(text: str, name: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a number") from None


@dataclass(frozen=True)
class GroupSettings:
    """What the leader tells each admitted worker: the group's settings (one source: rank 0's options)."""

    store_port: int
    token: str
    model_id: str
    dtype: str
    backend: str
    block_size: int
    expert_parallel: bool
    timeout_s: float


def _bind_endpoint(host: str, port: int) -> str:
    """An IP literal is bound as it is; a name (a LeaderWorkerSet's leader address) on every interface."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return f"tcp://*:{port}"
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def admit_workers(
    where: Placement,
    settings: GroupSettings,
    *,
    keys: KeySet | None,
    pool_id: str,
    timeout_s: float,
) -> None:
    """The leader: wait until ranks 1..N-1 have each asked to join (a worker needs an executor key that may act on
    `pool_id`: its own pool's or the any-pool one), then admit them all. RendezvousError when they do not all come
    within timeout_s."""
    context = zmq.Context.instance()
    auth = ServerAuth(context, keys, (Role.EXECUTOR,)) if keys is not None else None
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.LINGER, 2000)
    socket.setsockopt(zmq.MAXMSGSIZE, _MAX_MESSAGE)
    if auth is not None:
        auth.secure(socket)
    endpoint = _bind_endpoint(where.host, where.port)
    socket.bind(endpoint)
    log.info("tensor_parallel_waiting_for_workers", bind=endpoint, size=where.size, auth="curve" if auth else "none")
    joined: dict[int, bytes] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(joined) < where.size - 1:
            left = deadline - time.monotonic()
            if left <= 0 or not socket.poll(int(min(left, 1.0) * 1000) + 1):
                if time.monotonic() >= deadline:
                    missing = sorted(set(range(1, where.size)) - set(joined))
                    raise RendezvousError(
                        f"rank(s) {', '.join(map(str, missing))} did not join {where.master} within {timeout_s:g} s "
                        "(not started, unreachable, or without a key this leader admits)"
                    )
                continue
            frames = socket.recv_multipart(copy=False)
            if len(frames) != 2:
                continue
            identity, body = frames[0].bytes, frames[1]
            refusal, rank = _check_join(body, where, settings, auth, pool_id)
            if refusal is not None:
                log.warning("tensor_parallel_join_refused", reason=refusal)
                socket.send_multipart([identity, json.dumps({"type": "refused", "reason": refusal}).encode()])
                continue
            if rank in joined:  # a worker restarted while the others came: the newer process takes the rank
                log.warning("tensor_parallel_worker_rejoined", rank=rank)
            joined[rank] = identity
            log.info("tensor_parallel_worker_joined", rank=rank, waiting_for=where.size - 1 - len(joined))
        admitted = json.dumps({"type": "admitted", **asdict(settings)}).encode()
        for identity in joined.values():
            socket.send_multipart([identity, admitted])
    finally:
        socket.close()
        if auth is not None:
            auth.stop()


def _check_join(
    frame: zmq.Frame, where: Placement, settings: GroupSettings, auth: ServerAuth | None, pool_id: str
) -> tuple[str | None, int]:
    """Why this join is refused (None: admissible) and the rank it asks for."""
    if auth is not None:
        principal = auth.principal(frame)
        if principal is None or not principal.may_act_on(pool_id):
            return f"this key may not join the group of pool {pool_id}", -1
    try:
        message: Any = json.loads(frame.bytes)
        rank, world, model_id = int(message["rank"]), int(message["world"]), str(message["model_id"])
    except (ValueError, KeyError, TypeError):
        return "not a join message", -1
    if world != where.size:
        return f"this group has {where.size} ranks, not {world}", rank
    if not 0 < rank < where.size:
        return f"rank {rank} is not a worker rank of a group of {where.size}", rank
    if model_id != settings.model_id:
        return f"the leader serves model {settings.model_id}, not {model_id}", rank
    return None, rank


def join_leader(where: Placement, model_id: str, *, curve: ClientCurve | None, timeout_s: float) -> GroupSettings:
    """A worker: ask the leader to admit rank `where.rank` (waiting for the leader to come up, within timeout_s);
    its settings, or RendezvousError (refused, or no answer: no leader there or it does not admit this key)."""
    context = zmq.Context.instance()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.MAXMSGSIZE, _MAX_MESSAGE)
    if curve is not None:
        curve.apply(socket)
    host = f"[{where.host}]" if ":" in where.host else where.host
    try:
        socket.connect(f"tcp://{host}:{where.port}")
        socket.send(json.dumps({"rank": where.rank, "world": where.size, "model_id": model_id}).encode())
        if not socket.poll(int(timeout_s * 1000)):
            raise RendezvousError(
                f"the leader at {where.master} did not admit rank {where.rank} within {timeout_s:g} s "
                "(no leader there, the other ranks not all started, or it does not admit this key)"
            )
        reply = json.loads(socket.recv())
    except ValueError:
        raise RendezvousError(f"the leader at {where.master} answered rank {where.rank} with no JSON") from None
    finally:
        socket.close()
    if not isinstance(reply, dict) or reply.get("type") != "admitted":
        reason = reply.get("reason") if isinstance(reply, dict) else reply
        raise RendezvousError(f"the leader at {where.master} refused rank {where.rank}: {reason}")
    try:
        return GroupSettings(**{k: v for k, v in reply.items() if k != "type"})
    except TypeError:  # another version's leader
        raise RendezvousError(f"the leader at {where.master} sent settings this worker does not know") from None


def new_token() -> str:
    return secrets.token_hex(32)
