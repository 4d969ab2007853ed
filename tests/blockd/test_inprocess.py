"""blockd.inprocess: the production BlockdClient and PoolClient answered by a BlockManager in this process."""

from __future__ import annotations

import pytest

from blockd import protocol as p
from blockd.client import PoolClient
from blockd.errors import BlockdError, ErrorCode
from blockd.inprocess import InProcessBlockd
from common.tokens import pack_tokens


def _pool(client: InProcessBlockd, epoch: int = 7) -> PoolClient:
    return PoolClient(client, pool_id="pool", num_blocks=8, block_size=4, model_id="m", epoch=epoch, retry_for_s=1.0)


def test_a_pool_client_over_it_steps_as_over_the_daemon() -> None:
    client = InProcessBlockd()
    pool = _pool(client)
    pool.register()
    admitted = pool.admit("a", list(range(6)))
    assert len(admitted.blocks) == 2 and pool.free_blocks == 6
    appended = pool.append("a", [6, 7, 8])
    assert len(appended.blocks) == 1 and pool.free_blocks == 5
    assert pool.commit("a", 8) == 2  # two full blocks into the prefix index
    (outcome,) = pool.step([p.Admit("a", pack_tokens([1]), None)])  # the sequence exists: an op error
    assert type(outcome) is p.OpError and outcome.code == ErrorCode.SEQUENCE_EXISTS
    pool.free("a")
    assert pool.free_blocks == 8
    blockd_pool = client.manager.pool("pool")
    assert blockd_pool.check() == []
    assert client.lookup(list(range(9))) == {"pool": 8}  # the committed prefix is found


def test_a_lost_pool_is_resynced_from_the_mirror() -> None:
    client = InProcessBlockd()
    pool = _pool(client)
    pool.register()
    pool.admit("a", list(range(5)))
    client.manager.unregister("pool", pool.epoch)  # as after an expired lease
    pool.heartbeat()  # unknown pool -> re-register with the live sequence
    assert pool.resyncs == 1
    assert client.manager.pool("pool").seqs["a"].table == pool.seqs["a"].blocks


def test_bad_requests_get_error_replies_and_change_nothing() -> None:
    client = InProcessBlockd()
    with pytest.raises(BlockdError) as raised:
        client.stats()  # not answered in process
    assert raised.value.code == ErrorCode.UNKNOWN_OP
    reply = p.decode_reply(client.answer(b"\x00not msgpack"))
    assert not reply.ok and reply.error is not None and reply.error.code == ErrorCode.BAD_MESSAGE
    with pytest.raises(BlockdError) as raised:
        client.call(p.Step, pool_id="nobody", epoch=1, ops=[])
    assert raised.value.code == ErrorCode.UNKNOWN_POOL
    assert client.manager.pools == {}


def test_the_mirror_follows_a_fork_and_a_copy_before_a_reserved_only_block() -> None:
    client = InProcessBlockd()
    pool = _pool(client)
    pool.register()
    pool.admit("a", list(range(5)))  # blocks of 4: one full, one open
    pool.append("a", [], reserve=7)  # the rest of the open block and a reserved-only one
    pool.fork("a", "b")
    (copied, child) = pool.step([p.Append("a", pack_tokens([5])), p.Append("b", pack_tokens([9]), 2)])
    assert type(copied) is p.AppendResult and len(copied.copies) == 1  # the parent copies the open block ...
    assert type(child) is p.AppendResult and not child.copies  # ... so the child holds the original alone
    blockd_pool = client.manager.pool("pool")
    for seq_id in ("a", "b"):
        assert pool.seqs[seq_id].blocks == blockd_pool.seqs[seq_id].table
        assert pool.seqs[seq_id].reserved == blockd_pool.seqs[seq_id].reserved
    assert pool.seqs["a"].blocks[1] == copied.copies[0][1] and len(pool.seqs["a"].blocks) == 3  # in its place
    assert pool.refcount == blockd_pool.refcount and blockd_pool.check() == []
    client.manager.unregister("pool", pool.epoch)  # and a re-sync from that mirror is taken as it is
    pool.heartbeat()
    assert client.manager.pool("pool").seqs["a"].table == pool.seqs["a"].blocks
    assert client.manager.pool("pool").check() == []
