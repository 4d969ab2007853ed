"""The block pool: one executor's KV blocks, their refcounts, block tables, prefix index and free queue; no I/O.

How its operations work is told in docs/architecture.md ("The core"). I1-I5 and I7 hold in every state: `check()`
verifies them (`blockd-cli check` on a live daemon). I6 is about a transition: the tests compare the whole state
before and after every failed operation (tests/blockd/test_pool_model.py).

 I1. Every block is either free (in the free queue, refcount 0) or referenced (refcount > 0), never both:
     the free queue holds exactly the blocks whose refcount is 0.
 I2. A block's refcount equals the number of times it appears in the block tables of live sequences;
     so the sum of refcounts equals the number of non-hole entries of all block tables.
 I3. The prefix index and the per-block hash agree both ways: index[h] == b  <=>  block_hash[b] == h.
     A block carries a hash only while its KV holds exactly the tokens that hash names.
 I4. A live sequence of n tokens and r reserved slots holds ceil((n + r) / block_size) blocks, its reserved
     slots end at most one block past the block its next token goes into (r <= block_rule.reservable), its
     committed blocks are full, and the blocks past its tokens (reserved slots only) are its alone (refcount 1).
     Reserved slots are written before blockd hears of their tokens, so a shared open block (partly filled)
     that holds some of one sequence's reserved slots is, for every other sequence holding it, its open block
     too, with no reserved slots in it and no more tokens than the writer has there.
     Holes: in a pool with a sliding window, a table's leading entries may be holes (HOLE, no block): blocks
     handed back by `slide` because no future query reads them. Only leading entries, only full blocks of
     registered tokens no query at or past the last registered token reads (block_rule.dead_blocks), and they
     count in the table's length as the blocks they were. A `trim` lowers r and hands back the blocks past
     ceil((n + r) / block_size) (block_rule.trimmed_blocks): so I4 holds after it as before.
 I5. Free blocks without a hash sit before every free block with one (they are reused first), and free
     blocks with a hash are in least-recently-freed order: allocation takes the queue's head.
 I6. A failed operation changes nothing.
 I7. Layer groups (`PoolSpec.group_sliding`): a sequence has one table per group (`<seq>`, `<seq>@g<i>`), all
     with its tokens, reserved slots and committed blocks; each group's chains are keyed by the group, and only
     sliding groups' tables have holes. Every op on a sequence applies to all its tables, all or nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Final, Protocol

import msgspec

from blockd.block_rule import (
    dead_blocks,
    growth,
    reservable,
    reserved_after,
    shared_blocks,
    trimmed_blocks,
    writes_open_block,
)
from blockd.errors import BlockdError, ErrorCode
from blockd.hashing import chain_hashes, epoch_fingerprint, extra_key, group_extra_key, root_hash
from blockd.tiers import Tier, TierDirectory, TierOp, TierStats
from common.tokens import TOKEN_BYTES as _TOKEN_BYTES
from common.tokens import as_packed, unpack_tokens

#: What a block holds, as persistence records it: (hash, generation, lru stamp).
BlockRecord = tuple[bytes, int, int]
#: Changes since persistence last collected them, newest per block; None = the block holds no prefix any more.
#: Keyed by block, so an eviction needs no entry: the evicted block's record names a generation its executor no
#: longer has, and re-sync drops it (see `restore_index`); its next commit overwrites it. Plain frees are not
#: journaled either (the commonest event): the stamp persistence hears is the LRU clock at the block's commit or
#: last reuse from the free queue. A dict write is all the hot path pays.
Journal = dict[int, "BlockRecord | None"]

_RECENTLY_FREED_MEMORY: Final = 4096

#: A table entry whose block went back to the pool (`slide`): no future query of the sequence reads it.
HOLE: Final = -1

#: Token ids as a sequence of ints, or packed as little-endian uint32 bytes (the wire format).
TokenIds = Sequence[int] | bytes | bytearray


def _packed(tokens: TokenIds) -> bytes | bytearray:
    try:
        return as_packed(tokens)
    except (OverflowError, TypeError, ValueError) as exc:
        raise BlockdError(ErrorCode.INVALID_REQUEST, f"token ids must be integers in [0, 2**32): {exc}") from None


class KvEventSink(Protocol):
    """Hears every change of a pool's prefix index as it happens (blockd.kv_events publishes them)."""

    def stored(
        self, spec: PoolSpec, parent: bytes | None, block_hash: bytes, tokens: bytes | bytearray, i: int
    ) -> None:
        """Block i of a sequence (packed tokens `tokens`) entered the index; parent: block i-1's hash or None."""

    def removed(self, spec: PoolSpec, block_hash: bytes) -> None:
        """An entry left the index: its block was evicted for new content."""

    def cleared(self, spec: PoolSpec) -> None:
        """Every entry left the index."""

    def tier_stored(self, spec: PoolSpec, block_hash: bytes, medium: str) -> None:
        """A lower tier (blockd.tiers: CPU, DISK or SHARED) now holds the block."""

    def tier_removed(self, spec: PoolSpec, block_hash: bytes, medium: str) -> None:
        """A lower tier no longer holds the block."""


class PoolSpec(msgspec.Struct, frozen=True):
    """What an executor declares about its KV cache when it registers."""

    pool_id: str
    num_blocks: int
    block_size: int
    model_id: str
    epoch: int
    sliding_window: int | None = None  # every layer sees keys k from a query q with q - k < window (None: all)
    # Layer groups (blockd.grouped_pool), one flag each: whether the group's layers slide by `sliding_window`.
    # () is one group of every layer, which slides when there is a window.
    group_sliding: tuple[bool, ...] = ()


class SeqState(msgspec.Struct):
    """A live sequence as the pool knows it."""

    tokens: bytearray  # its token ids, packed (see common.tokens.pack_tokens)
    table: list[int]
    hashes: list[bytes]  # chained hashes of its full blocks computed so far (a prefix of the full blocks)
    committed: int  # leading blocks that are in the index or were offered to it
    extra: bytes  # extra key (model identity and cache salt) of its chain
    reserved: int = 0  # slots past its tokens held for tokens not registered yet (blockd.block_rule)
    holes: int = 0  # leading table entries that are HOLE (blocks handed back by `slide`)
    group: int = 0  # the layer group whose table this is (see `group_table_ids`)


class GroupTable(msgspec.Struct, frozen=True):
    """The table another layer group's admission gave (pools with layer groups)."""

    blocks: list[int]
    generations: list[int]


class AdmitResult(msgspec.Struct, tag="admit", omit_defaults=True):
    blocks: list[int]  # the whole block table (leading HOLEs: a cached prefix's blocks no query reads)
    generations: list[int]  # generation of each block of the table
    num_cached_tokens: int  # prompt tokens whose KV is already there (cached prefix), or loaded by `tier_ops`
    loaded_tokens: int = 0  # of those, the tokens in blocks loaded from a lower tier (not in the index yet)
    tier_ops: tuple[TierOp, ...] = ()  # moves the executor makes first, in order (blockd.tiers)
    groups: list[GroupTable] = []  # layer groups 1.. (their tables `<seq>@g<i>`), with layer groups


class GroupGrowth(msgspec.Struct, frozen=True, omit_defaults=True):
    """What one append did to one table (`AppendResult`'s fields)."""

    blocks: tuple[int, ...] = ()
    generations: tuple[int, ...] = ()
    copies: tuple[tuple[int, int], ...] = ()
    copy_generations: tuple[int, ...] = ()


class AppendResult(msgspec.Struct, tag="append", frozen=True, omit_defaults=True):
    blocks: tuple[int, ...] = ()  # blocks appended to the table
    generations: tuple[int, ...] = ()  # their generations
    copies: tuple[tuple[int, int], ...] = ()  # (src, dst): copy src into dst; dst takes src's place in the table
    copy_generations: tuple[int, ...] = ()  # generation of each dst
    tier_ops: tuple[TierOp, ...] = ()  # demotions of the cached blocks its allocations evict (blockd.tiers)
    groups: tuple[GroupGrowth, ...] = ()  # layer groups 1..: what it did to each of their tables (none: nothing)

    def of_group(self, group: int) -> GroupGrowth:
        if group == 0:
            return GroupGrowth(self.blocks, self.generations, self.copies, self.copy_generations)
        return self.groups[group - 1] if self.groups else _NO_GROWTH


_NOTHING_APPENDED = AppendResult()
_NO_GROWTH = GroupGrowth()

#: Joins a sequence's id and a layer group's number into the id of that group's table.
GROUP_MARK: Final = "@g"
#: Most layer groups one pool has (a model's layer pattern: Gemma 3's is 6).
MAX_GROUPS: Final = 64


def group_suffix(group: int) -> str:
    """What a layer group's table id adds to its sequence's: nothing for the first, `@g<i>` for the others."""
    return f"{GROUP_MARK}{group}" if group else ""


def group_table_ids(seq_id: str, num_groups: int) -> list[str]:
    """The tables of a sequence, one per layer group: `<seq>` for the first, `<seq>@g<i>` for the others."""
    return [seq_id + group_suffix(g) for g in range(num_groups)]


class PoolCounters(msgspec.Struct):
    """Monotonic counters since the pool was registered."""

    queried_tokens: int = 0
    hit_tokens: int = 0
    queried_blocks: int = 0
    hit_blocks: int = 0
    granted_blocks: int = 0
    freed_blocks: int = 0
    evictions: int = 0
    copies_on_write: int = 0
    admits: int = 0
    admit_failures: int = 0


class PoolStats(msgspec.Struct):
    pool_id: str
    epoch_fingerprint: str  # see hashing.epoch_fingerprint: the epoch itself never leaves blockd
    model_id: str
    block_size: int
    blocks_total: int
    blocks_in_use: int
    blocks_cached_free: int
    blocks_never_used: int
    index_entries: int
    live_sequences: int
    tokens_held: int  # token slots of in-use blocks that hold a token
    kv_utilization: float  # tokens_held / slots of in-use blocks (1 - internal fragmentation)
    prefix_hit_rate_tokens: float
    prefix_hit_rate_blocks: float
    counters: PoolCounters
    tiers: list[TierStats] = []  # the executor's lower tiers (blockd.tiers), host first


def _written_ahead_problem(block: int, open_for: list[tuple[int, int]], holders: int) -> str | None:
    """I4's rule for a block that is open (partly filled) for the sequences in `open_for` ((tokens in it,
    reserved slots) each) and held `holders` times: if one of them writes ahead into it (reserved slots), every
    other holder has it open too, reserves nothing, and reads no slot the writer writes. None when it holds."""
    writers = [filled for filled, reserved in open_for if reserved]
    if not writers:
        return None
    if len(writers) > 1 or holders != len(open_for) or max(filled for filled, _ in open_for) > writers[0]:
        return f"block {block} holds one sequence's reserved slots and another sequence reads or reserves them"
    return None


def _leading_holes(table: Sequence[int]) -> int:
    holes = 0
    while holes < len(table) and table[holes] == HOLE:
        holes += 1
    return holes


def valid_prefix_lengths(block_size: int, window: int | None, found: Sequence[int | None]) -> list[bool]:
    """For each length L in 0..len(found) (in blocks), whether a prefix of L blocks is cached: `found` holds the
    indexed block of each hash (None: not indexed). Without a window every block of it must be there; with one,
    only the blocks the prefix's first query after it reads (a block's hash names its whole prefix, not the blocks
    before it). Its last block always (a window of one reads none before a query's own key: no prefix is cached
    that no block holds)."""
    ok = [True]
    run_start = 0  # where the indexed run ending at the current block starts
    for i, b in enumerate(found):
        if b is None:
            if window is None:  # no longer prefix is cached
                return ok + [False] * (len(found) - i)
            run_start = i + 1
        ok.append(b is not None and run_start <= dead_blocks(block_size, window, (i + 1) * block_size))
    return ok


def prefix_table(block_size: int, window: int | None, found: Sequence[int | None], length: int) -> list[int]:
    """The table of a cached prefix of `length` blocks (a valid one: `valid_prefix_lengths`): its blocks, the
    leading ones no query past it reads HOLE."""
    holes = min(dead_blocks(block_size, window, length * block_size), max(length - 1, 0))
    return [HOLE] * holes + [b for b in found[holes:length] if b is not None]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class BlockPool:
    """All blocks of one pool. See the module docstring for what always holds."""

    def num_tokens(self, seq_id: str) -> int:
        return len(self._seq(seq_id).tokens) // _TOKEN_BYTES

    def token_ids(self, seq_id: str) -> list[int]:
        return unpack_tokens(self._seq(seq_id).tokens)

    def __init__(
        self,
        spec: PoolSpec,
        *,
        deployment: str = "pagedkv",
        journal: Journal | None = None,
        hash_key: bytes = b"",
    ) -> None:
        if spec.num_blocks <= 0:
            raise BlockdError(ErrorCode.INVALID_REQUEST, f"num_blocks must be positive, got {spec.num_blocks}")
        if spec.block_size <= 0:
            raise BlockdError(ErrorCode.INVALID_REQUEST, f"block_size must be positive, got {spec.block_size}")
        self.spec = spec
        self.block_size = spec.block_size
        self.num_blocks = spec.num_blocks
        sliding = spec.group_sliding or (spec.sliding_window is not None,)
        if len(sliding) > MAX_GROUPS or (any(sliding) and spec.sliding_window is None):
            raise BlockdError(
                ErrorCode.INVALID_REQUEST,
                f"{len(sliding)} layer groups (at most {MAX_GROUPS}), sliding ones need a window: "
                f"{list(sliding)} with window {spec.sliding_window}",
            )
        self.num_groups = len(sliding)
        #: Each layer group's window (None: its layers read every key, its table never slides).
        self.windows: list[int | None] = [spec.sliding_window if slides else None for slides in sliding]
        self.hash_key = hash_key  # the deployment secret's key (b"": unkeyed hashes)
        self.root = root_hash(deployment, hash_key)
        self._default_extra = extra_key(spec.model_id, None, hash_key)
        self.refcount: list[int] = [0] * spec.num_blocks
        self.block_hash: list[bytes | None] = [None] * spec.num_blocks
        self.generation: list[int] = [0] * spec.num_blocks
        self.stamp: list[int] = [0] * spec.num_blocks  # LRU clock value when the block last became free
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(spec.num_blocks))
        self.index: dict[bytes, int] = {}
        self.seqs: dict[str, SeqState] = {}
        self.counters = PoolCounters()
        self.journal = journal
        self.kv_events: KvEventSink | None = None  # set by blockd.kv_events when blockd publishes KV events
        self.tiers: TierDirectory | None = None  # the executor's lower tiers, when it declared any
        self._clock = 0
        self._recently_freed: OrderedDict[str, None] = OrderedDict()

    # ----------------------------------------------------------------------------------------- helpers

    def extra_for(self, cache_salt: str | None, group: int = 0) -> bytes:
        """The extra key of a chain; with layer groups it names the group too, so that one group's blocks (other
        layers' KV) are never a hit for another's."""
        extra = self._default_extra if cache_salt is None else extra_key(self.spec.model_id, cache_salt, self.hash_key)
        return extra if self.num_groups == 1 else group_extra_key(extra, group, self.hash_key)

    def table_ids(self, seq_id: str) -> list[str]:
        """The sequence's tables (one per layer group); a client names a sequence, never a group's table."""
        if self.num_groups == 1:
            return [seq_id]
        if GROUP_MARK in seq_id:
            raise BlockdError(
                ErrorCode.INVALID_REQUEST,
                f"sequence id {seq_id!r} holds {GROUP_MARK!r}, which names layer groups' tables in this pool",
            )
        return group_table_ids(seq_id, self.num_groups)

    def _seq(self, seq_id: str) -> SeqState:
        seq = self.seqs.get(seq_id)
        if seq is None:
            if seq_id in self._recently_freed:
                raise BlockdError(ErrorCode.DOUBLE_FREE, f"sequence {seq_id!r} was already freed")
            raise BlockdError(ErrorCode.UNKNOWN_SEQUENCE, f"no live sequence {seq_id!r} in pool {self.spec.pool_id!r}")
        return seq

    def _check_new_seq_id(self, seq_id: str) -> None:
        if seq_id in self.seqs:
            raise BlockdError(ErrorCode.SEQUENCE_EXISTS, f"sequence {seq_id!r} is already live")

    def _allocate(self, count: int) -> list[int]:
        """Take the `count` least recently used free blocks, evicting their index entries.

        The caller has checked that there are enough.
        """
        popitem = self.free_queue.popitem
        block_hash, generation, refcount = self.block_hash, self.generation, self.refcount
        index = self.index
        granted: list[int] = []
        evicted = 0
        for _ in range(count):
            block = popitem(last=False)[0]
            old = block_hash[block]
            if old is not None:
                del index[old]
                block_hash[block] = None
                evicted += 1
                if self.kv_events is not None:
                    self.kv_events.removed(self.spec, old)
                if self.tiers is not None:  # kept below instead of dropped (copied out before the block is reused)
                    self.tiers.demote(old, block)
            generation[block] += 1
            refcount[block] = 1
            granted.append(block)
        self.counters.evictions += evicted
        return granted

    def _release(self, blocks: Iterable[int]) -> None:
        """Drop one reference from each block, in the given order; blocks left unreferenced become free."""
        refcount, block_hash, free_queue = self.refcount, self.block_hash, self.free_queue
        stamp, clock = self.stamp, self._clock
        for block in blocks:
            rc = refcount[block] - 1
            refcount[block] = rc
            if rc:
                continue
            free_queue[block] = None
            h = block_hash[block]
            if h is None:
                free_queue.move_to_end(block, last=False)  # holds nothing worth keeping: reuse it first
            else:
                clock += 1
                stamp[block] = clock
        self._clock = clock

    def _shortfall(self, needed: int, available: int, what: str) -> BlockdError:
        missing = needed - available
        return BlockdError(
            ErrorCode.OUT_OF_BLOCKS,
            f"{what} needs {needed} free blocks, {available} are free ({missing} missing)",
            missing_blocks=missing,
        )

    # --------------------------------------------------------------------------------------- operations

    def cached_prefix_blocks(self, hashes: Sequence[bytes], limit: int) -> list[int]:
        """The table of the longest cached prefix among the first `limit` hashes (see `valid_prefix_lengths`)."""
        window = self.spec.sliding_window
        found = [self.index.get(h) for h in hashes[:limit]]
        lengths = valid_prefix_lengths(self.block_size, window, found)
        return prefix_table(self.block_size, window, found, max(i for i, ok in enumerate(lengths) if ok))

    def _cached_prefix(
        self, packed: bytes | bytearray, cache_salt: str | None, limit: int
    ) -> tuple[int, list[list[int]]]:
        """(blocks, each group's table of them) of the longest prefix among the first `limit` full blocks that
        every layer group has cached: one cached length for all (each group's rule: `valid_prefix_lengths`)."""
        bs = self.block_size
        found: list[list[int | None]] = []
        valid: list[bool] | None = None
        for g, window in enumerate(self.windows):
            hashes = chain_hashes(packed, bs, self.root, self.extra_for(cache_salt, g), 0, limit, self.hash_key)
            found.append([self.index.get(h) for h in hashes])
            ok = valid_prefix_lengths(bs, window, found[-1])
            valid = ok if valid is None else [a and b for a, b in zip(valid, ok, strict=True)]
        assert valid is not None
        length = max(i for i, ok in enumerate(valid) if ok)
        return length, [prefix_table(bs, w, f, length) for w, f in zip(self.windows, found, strict=True)]

    def admit(
        self,
        seq_id: str,
        tokens: TokenIds,
        cache_salt: str | None = None,
        *,
        reuse_prefix: bool = True,
        hold: int | None = None,
    ) -> AdmitResult:
        """Give a new sequence blocks for its whole prompt, reusing the longest cached prefix (unless
        `reuse_prefix` is False: then every token is computed, and its blocks are still committed as usual).
        With `hold`, only the prompt's first `hold` tokens past the cached prefix are registered (and given
        blocks): the executor appends the rest as its prefill reaches them (a sliding window's long prompt).

        At least the prompt's last token is left to compute (its logits are needed), so a fully cached prompt
        reuses all but its last block. With layer groups, every group's table is admitted at once, with the one
        cached length every group has. All or nothing: if blocks are missing, nothing changes.
        """
        table_ids = self.table_ids(seq_id)
        self._check_new_seq_id(seq_id)
        packed = _packed(tokens)
        n = len(packed) // _TOKEN_BYTES
        if n == 0:
            raise BlockdError(ErrorCode.INVALID_REQUEST, "a sequence needs at least one prompt token")
        bs = self.block_size
        if (n if hold is None else hold) > self.num_blocks * bs:  # before hashing: the pool could never hold it
            self.counters.admit_failures += 1
            raise BlockdError(
                ErrorCode.TOO_MANY_TOKENS,
                f"a prompt of {n} tokens is more than pool {self.spec.pool_id!r} holds ({self.num_blocks * bs})",
            )
        cached_blocks, hit_tables = self._cached_prefix(packed, cache_salt, (n - 1) // bs if reuse_prefix else 0)
        tiers = self.tiers
        loads: list[tuple[Tier, bytes]] = []
        if reuse_prefix and tiers is not None:  # (a pool with tiers has one group: the executor refuses windows)
            hashes = chain_hashes(packed, bs, self.root, self.extra_for(cache_salt, 0), key=self.hash_key)
            loads = self._tier_hits(hashes, cached_blocks, (n - 1) // bs)
        refcount = self.refcount
        cached = (cached_blocks + len(loads)) * bs
        if hold is not None and cached + hold < n:
            n = cached + max(hold, 1)
            packed = packed[: n * _TOKEN_BYTES]
        needed = growth(bs, cached, n - cached, cached_blocks + len(loads)).blocks + len(loads)
        # Cached-free hits leave the free queue (a block is in one group's chain only: hashes differ per group).
        reclaimed = sum(1 for hits in hit_tables for b in hits if b != HOLE and refcount[b] == 0)
        counters = self.counters
        available = len(self.free_queue) - reclaimed
        if needed * self.num_groups > available:
            counters.admit_failures += 1
            raise self._shortfall(needed * self.num_groups, available, f"admitting {seq_id!r}")
        free = self.free_queue
        journal = self.journal
        if loads:  # its own allocations' demotions must not push out what it loads
            tiers.pinned.update(h for _, h in loads)  # type: ignore[union-attr]
        tables: list[list[int]] = []
        for g, (table_id, hits) in enumerate(zip(table_ids, hit_tables, strict=True)):
            extra = self.extra_for(cache_salt, g)
            hashes = chain_hashes(packed, bs, self.root, extra, key=self.hash_key)
            holes = _leading_holes(hits)
            for i, b in enumerate(hits[holes:], holes):
                if refcount[b] == 0:
                    del free[b]
                    if journal is not None:  # a cached prefix proved useful: persistence records its recency
                        journal[b] = (hashes[i], self.generation[b], self._clock)
                refcount[b] += 1
            table = hits + self._allocate(needed)
            for j, (tier, h) in enumerate(loads):  # loaded blocks are indexed by the executor's next commit
                tiers.load(tier, h, table[len(hits) + j])  # type: ignore[union-attr]
            self.seqs[table_id] = SeqState(bytearray(packed), table, hashes, cached_blocks, extra, holes=holes, group=g)
            tables.append(table)
        counters.admits += 1
        counters.queried_blocks += n // bs
        counters.hit_blocks += cached_blocks
        counters.queried_tokens += n
        counters.hit_tokens += cached
        counters.granted_blocks += needed * self.num_groups
        generation = self.generation
        result = [(table, [0 if b == HOLE else generation[b] for b in table]) for table in tables]
        return AdmitResult(
            *result[0],
            cached,
            loaded_tokens=len(loads) * bs,
            tier_ops=tiers.take() if tiers is not None else (),
            groups=[GroupTable(*r) for r in result[1:]],
        )

    def take_tier_ops(self) -> tuple[TierOp, ...]:
        """The tier moves the last op caused (a commit's shared writes), for its result."""
        return self.tiers.take() if self.tiers is not None else ()

    def _tier_hits(self, hashes: Sequence[bytes], start: int, limit: int) -> list[tuple[Tier, bytes]]:
        """The chain's blocks after the device's cached prefix that a lower tier holds, in a row (not with a
        sliding window, whose hits may start with holes); the admit loads them into fresh blocks."""
        tiers = self.tiers
        if tiers is None or self.spec.sliding_window is not None:
            return []
        found: list[tuple[Tier, bytes]] = []
        for h in hashes[start:limit]:
            tier = None if h in self.index else tiers.find(h)  # (a device copy further on: stop, keep it simple)
            if tier is None:
                break
            found.append((tier, h))
        return found

    def append(self, seq_id: str, tokens: TokenIds, reserve: int = 0) -> AppendResult:
        """Register `tokens` after the sequence's current tokens (they fill its reserved slots first), and keep
        `reserve` slots reserved past them: room for tokens the executor computes before it registers them, up to
        the end of the block after the one the first of them goes into (blockd.block_rule).

        New blocks are taken at block boundaries. If the tokens or new reserved slots land in an open block that
        another sequence shares (after a fork), that block is copied first: a fresh block in its place in the
        table plus a (src, dst) copy instruction. With layer groups, every group's table grows at once, all or
        nothing.
        """
        packed = tokens if type(tokens) is bytes and not len(tokens) % _TOKEN_BYTES else _packed(tokens)
        k = len(packed) // _TOKEN_BYTES
        if self.num_groups == 1:  # the hot path (a decode step's append), kept lean
            seq = self.seqs.get(seq_id) or self._seq(seq_id)
            if reserve:
                self._check_reserve(seq_id, seq, k, reserve)
            keep = reserved_after(seq.reserved, k, reserve)
            need = self._table_need(seq, k, keep, reserve)
            if need is None:
                seq.tokens += packed
                seq.reserved = keep
                return _NOTHING_APPENDED
            return self._grow_all([seq], packed, keep, [need], seq_id)
        seqs = [self._seq(t) for t in self.table_ids(seq_id)]
        if reserve:
            self._check_reserve(seq_id, seqs[0], k, reserve)
        keep = reserved_after(seqs[0].reserved, k, reserve)
        return self._grow_all(seqs, packed, keep, [self._table_need(q, k, keep, reserve) for q in seqs], seq_id)

    def _check_reserve(self, seq_id: str, seq: SeqState, k: int, reserve: int) -> None:
        """Refuse a `reserve` past block_rule's bound for an append of `k` tokens."""
        n = len(seq.tokens) // _TOKEN_BYTES + k
        if not 0 <= reserve <= reservable(self.block_size, n):
            raise BlockdError(
                ErrorCode.INVALID_REQUEST,
                f"reserve {reserve} for {seq_id!r} reaches more than a block past the block its first slot is in "
                f"(at most {reservable(self.block_size, n)})",
            )

    def _table_need(self, seq: SeqState, k: int, keep: int, reserve: int) -> tuple[int, bool] | None:
        """(new blocks, copy-on-write) one table's append takes; None: nothing (its room is held, in a block
        nobody else reads)."""
        bs = self.block_size
        table = seq.table
        n_old = len(seq.tokens) // _TOKEN_BYTES
        writes = writes_open_block(bs, n_old, k, seq.reserved, keep)
        open_shared = writes and self.refcount[table[n_old // bs]] > 1  # (only then looked up: the common case)
        if n_old + k + keep <= len(table) * bs and not open_shared:
            return None
        grow = growth(bs, n_old, k, len(table), open_block_shared=open_shared, reserved=seq.reserved, reserve=reserve)
        return grow.new_blocks, grow.copy_on_write

    def _grow_all(
        self,
        seqs: list[SeqState],
        packed: bytes | bytearray,
        keep: int,
        needs: list[tuple[int, bool] | None],
        seq_id: str,
    ) -> AppendResult:
        """Apply an append to every table of a sequence, if the free blocks allow all of it."""
        needed = sum(new + cow for new, cow in filter(None, needs))
        if needed > len(self.free_queue):
            k = len(packed) // _TOKEN_BYTES
            raise self._shortfall(needed, len(self.free_queue), f"appending {k} tokens to {seq_id!r}")
        self.counters.granted_blocks += needed
        n_old = len(seqs[0].tokens) // _TOKEN_BYTES
        grown = [self._grow(seq, packed, keep, need, n_old) for seq, need in zip(seqs, needs, strict=True)]
        if len(grown) == 1:
            return grown[0]
        if all(g is _NOTHING_APPENDED for g in grown):
            return _NOTHING_APPENDED
        head = grown[0]
        others = tuple(GroupGrowth(g.blocks, g.generations, g.copies, g.copy_generations) for g in grown[1:])
        return AppendResult(
            head.blocks, head.generations, head.copies, head.copy_generations, head.tier_ops, groups=others
        )

    def _grow(
        self, seq: SeqState, packed: bytes | bytearray, keep: int, need: tuple[int, bool] | None, n_old: int
    ) -> AppendResult:
        """Apply one table's part of an append (the blocks are there: `append` checked)."""
        seq.tokens += packed
        seq.reserved = keep
        if need is None:
            return _NOTHING_APPENDED
        new_blocks, cow = need
        table = seq.table
        generation = self.generation
        copies: tuple[tuple[int, int], ...] = ()
        copy_generations: tuple[int, ...] = ()
        if cow:
            src = table[n_old // self.block_size]
            (dst,) = self._allocate(1)
            self.refcount[src] -= 1  # stays >= 1: another sequence holds it
            table[n_old // self.block_size] = dst
            copies, copy_generations = ((src, dst),), (generation[dst],)
            self.counters.copies_on_write += 1
        grown = self._allocate(new_blocks) if new_blocks > 0 else []
        table.extend(grown)
        ops = self.tiers.take() if self.tiers is not None else ()
        return AppendResult(tuple(grown), tuple(generation[b] for b in grown), copies, copy_generations, ops)

    def commit(self, seq_id: str, num_computed_tokens: int) -> int:
        """Enter the sequence's computed full blocks into the prefix index (every group's, each hashed from the
        same tokens with its group's key); returns how many entries it added. With a shared tier, each new entry
        is written there too (`take_tier_ops` hands out the writes).

        A block whose hash is already indexed under another block (the same prefix computed twice) is left out
        of the index: the first copy stays the hit.
        """
        seqs = [self._seq(t) for t in self.table_ids(seq_id)]
        n = len(seqs[0].tokens) // _TOKEN_BYTES
        if num_computed_tokens < 0 or num_computed_tokens > n:
            raise BlockdError(
                ErrorCode.INVALID_REQUEST,
                f"num_computed_tokens {num_computed_tokens} is outside [0, {n}] for {seq_id!r}",
            )
        return sum(self._commit_table(seq, num_computed_tokens // self.block_size) for seq in seqs)

    def _commit_table(self, seq: SeqState, full: int) -> int:
        if full <= seq.committed:
            return 0
        hashes = seq.hashes
        if len(hashes) < full:
            parent = hashes[-1] if hashes else self.root
            hashes.extend(
                chain_hashes(seq.tokens, self.block_size, parent, seq.extra, len(hashes), full, self.hash_key)
            )
        index, block_hash, table = self.index, self.block_hash, seq.table
        added = 0
        for i in range(seq.committed, full):
            h = hashes[i]
            if h in index:
                continue
            b = table[i]
            if b == HOLE or block_hash[b] is not None:  # handed back, or indexed already (shared via fork)
                continue
            index[h] = b
            block_hash[b] = h
            added += 1
            if self.tiers is not None:  # the deployment's shared tier gets it now, while its author still holds it
                self.tiers.publish(h, b)
            if self.journal is not None:
                self.journal[b] = (h, self.generation[b], self._clock)
            if self.kv_events is not None:
                self.kv_events.stored(self.spec, hashes[i - 1] if i else None, h, seq.tokens, i)
        seq.committed = full
        return added

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares the parent's blocks that hold its tokens (not its reserved-only blocks) and has no
        reserved slots; a write into their shared open block copies it first. Every group's table alike."""
        parents = [self._seq(t) for t in self.table_ids(parent_id)]
        children = self.table_ids(child_id)
        self._check_new_seq_id(child_id)
        refcount = self.refcount
        for parent, table_id in zip(parents, children, strict=True):
            shared = parent.table[: shared_blocks(self.block_size, len(parent.tokens) // _TOKEN_BYTES)]
            for b in shared[parent.holes :]:
                refcount[b] += 1
            self.seqs[table_id] = SeqState(
                bytearray(parent.tokens),
                shared,
                list(parent.hashes),
                parent.committed,
                parent.extra,
                holes=parent.holes,
                group=parent.group,
            )
        self._recently_freed.pop(child_id, None)

    def free(self, seq_id: str) -> int:
        """Release a sequence's blocks (every group's table), tail first, so a chain's tail is evicted before its
        shared head."""
        table_ids = self.table_ids(seq_id)
        self._seq(seq_id)
        released = 0
        for table_id in table_ids:
            seq = self.seqs.pop(table_id)
            held = seq.table[seq.holes :]
            self._release(reversed(held))
            released += len(held)
        self.counters.freed_blocks += released
        self._recently_freed[seq_id] = None
        if len(self._recently_freed) > _RECENTLY_FREED_MEMORY:
            self._recently_freed.popitem(last=False)
        return released

    def slide(self, seq_id: str, num_computed_tokens: int) -> int:
        """The sequence has computed its first `num_computed_tokens` tokens (registered ones): hand back the
        leading blocks no query from there on reads (block_rule.dead_blocks) of every sliding group's table, as
        a free does (tail first; one with a hash stays a prefix hit until evicted), leaving holes in its table.
        Returns the blocks released."""
        if self.spec.sliding_window is None:
            raise BlockdError(
                ErrorCode.INVALID_REQUEST, f"pool {self.spec.pool_id!r} has no sliding window: every block is read"
            )
        seqs = [self._seq(t) for t in self.table_ids(seq_id)]
        n = len(seqs[0].tokens) // _TOKEN_BYTES
        if not 0 <= num_computed_tokens <= n:
            raise BlockdError(
                ErrorCode.INVALID_REQUEST,
                f"num_computed_tokens {num_computed_tokens} is outside [0, {n}] for {seq_id!r}: blocks of tokens "
                "blockd has not heard of are not handed back",
            )
        released = 0
        for seq in seqs:
            dead = dead_blocks(self.block_size, self.windows[seq.group], num_computed_tokens)
            if dead <= seq.holes:
                continue
            table = seq.table
            handed = table[seq.holes : dead]
            self._release(reversed(handed))
            table[seq.holes : dead] = [HOLE] * len(handed)
            seq.holes = dead
            released += len(handed)
        self.counters.freed_blocks += released
        return released

    def trim(self, seq_id: str, reserve: int) -> int:
        """Rollback of room: keep `reserve` of the sequence's reserved slots (at most those it holds) and hand
        back the blocks past its tokens and them (block_rule.trimmed_blocks), tail first. They hold reserved
        slots only, never a registered token: speculative decoding's rejected drafts were computed there and are
        never hashed. Returns the blocks released."""
        seq = self._seq(seq_id)
        if self.num_groups > 1:  # (the executor refuses speculative decoding with layer groups)
            raise BlockdError(ErrorCode.INVALID_REQUEST, "trim is for pools of one layer group")
        if not 0 <= reserve <= seq.reserved:
            raise BlockdError(
                ErrorCode.INVALID_REQUEST,
                f"reserve {reserve} for {seq_id!r} is outside [0, {seq.reserved}]: a trim only gives room back",
            )
        table = seq.table
        n = len(seq.tokens) // _TOKEN_BYTES
        count = trimmed_blocks(self.block_size, n, reserve, len(table))
        seq.reserved = reserve
        if not count:
            return 0
        released = table[len(table) - count :]
        del table[len(table) - count :]
        self._release(reversed(released))
        self.counters.freed_blocks += count
        return count

    def free_all(self) -> int:
        """Free every live sequence (lease expiry, executor restart)."""
        return sum(self.free(seq_id) for seq_id, seq in list(self.seqs.items()) if seq.group == 0)

    def prompt_hashes(self, tokens: TokenIds, cache_salt: str | None = None) -> list[bytes]:
        """Hashes of the prompt blocks an admit could reuse (all full blocks but a last one holding the end)."""
        packed = _packed(tokens)
        limit = max(len(packed) // _TOKEN_BYTES - 1, 0) // self.block_size
        return chain_hashes(packed, self.block_size, self.root, self.extra_for(cache_salt), 0, limit, self.hash_key)

    def lookup(self, tokens: TokenIds, cache_salt: str | None = None) -> int:
        """How many prompt tokens `admit` would find cached right now."""
        packed = _packed(tokens)
        limit = max(len(packed) // _TOKEN_BYTES - 1, 0) // self.block_size
        return self._cached_prefix(packed, cache_salt, limit)[0] * self.block_size

    def tier_extent(self, hashes: Sequence[bytes], device_blocks: int) -> dict[str, int]:
        """Per lower tier, the prompt tokens `admit` would load from it after a device prefix of `device_blocks`
        blocks, `hashes` being the prompt's reusable chain (`prompt_hashes`). The one walk admission makes
        (`_tier_hits`), so a lookup says what the admit would do; media with none are left out."""
        found: dict[str, int] = {}
        for tier, _h in self._tier_hits(hashes, device_blocks, len(hashes)):
            found[tier.medium] = found.get(tier.medium, 0) + self.block_size
        return found

    def reset_prefix_cache(self) -> int:
        """Forget every index entry; blocks stay where they are. Returns how many entries were dropped."""
        dropped = len(self.index)
        for _h, b in self.index.items():
            self.block_hash[b] = None
            if self.journal is not None:
                self.journal[b] = None
            if self.refcount[b] == 0:
                self.free_queue.move_to_end(b, last=False)
        self.index.clear()
        if self.tiers is not None:
            self.tiers.clear()
        if self.kv_events is not None:
            self.kv_events.cleared(self.spec)
        return dropped

    # ----------------------------------------------------------------------------- restore and re-sync

    def restore_sequence(
        self,
        seq_id: str,
        tokens: TokenIds,
        table: Sequence[int],
        num_computed: int,
        cache_salt: str | None = None,
        reserved: int = 0,
        group_tables: Sequence[Sequence[int]] = (),
    ) -> None:
        """Take a live sequence from its executor (re-sync): its tables (`table`, then layer groups 1..'s) are the
        truth; refcounts follow from them. Only into a pool being built (register): a bad table leaves the tables
        before it restored, and register drops the whole pool."""
        table_ids = self.table_ids(seq_id)
        self._check_new_seq_id(seq_id)
        if len(group_tables) != self.num_groups - 1:
            raise BlockdError(
                ErrorCode.INVALID_REQUEST,
                f"sequence {seq_id!r}: {1 + len(group_tables)} tables for a pool of {self.num_groups} layer groups",
            )
        packed = _packed(tokens)
        for g, (table_id, tab) in enumerate(zip(table_ids, [table, *group_tables], strict=True)):
            self._restore_table(table_id, g, packed, tab, num_computed, cache_salt, reserved)
        self.commit(seq_id, min(max(num_computed, 0), len(packed) // _TOKEN_BYTES))

    def _restore_table(
        self,
        seq_id: str,
        group: int,
        packed: bytes | bytearray,
        table: Sequence[int],
        num_computed: int,
        cache_salt: str | None,
        reserved: int,
    ) -> None:
        n = len(packed) // _TOKEN_BYTES
        if not 0 <= reserved <= reservable(self.block_size, n):
            raise BlockdError(
                ErrorCode.INVALID_REQUEST,
                f"sequence {seq_id!r}: {reserved} reserved slots reach more than a block past its next token's "
                f"block (at most {reservable(self.block_size, n)})",
            )
        if len(table) != _ceil_div(n + reserved, self.block_size) or not n:
            raise BlockdError(
                ErrorCode.INVALID_REQUEST,
                f"sequence {seq_id!r}: {n} tokens and {reserved} reserved slots need "
                f"{_ceil_div(n + reserved, self.block_size)} blocks, the table has {len(table)}",
            )
        holes = _leading_holes(table)
        allowed = dead_blocks(self.block_size, self.windows[group], min(max(num_computed, 0), n))
        if holes > allowed:
            raise BlockdError(
                ErrorCode.INVALID_REQUEST,
                f"sequence {seq_id!r}: {holes} leading holes where a query still reads (at most {allowed})",
            )
        held = table[holes:]
        for b in held:
            if not 0 <= b < self.num_blocks:
                what = "a hole past its leading entries" if b == HOLE else f"block {b} is not in the pool"
                raise BlockdError(ErrorCode.INVALID_REQUEST, f"sequence {seq_id!r}: {what}")
        if len(set(held)) < len(held):
            raise BlockdError(ErrorCode.INVALID_REQUEST, f"sequence {seq_id!r}: its table names a block twice")
        tails = table[shared_blocks(self.block_size, n) :]
        if any(self.refcount[b] for b in tails) or not self._tails().isdisjoint(held):
            raise BlockdError(
                ErrorCode.INVALID_REQUEST,
                f"sequence {seq_id!r}: a block past its tokens (reserved slots only) is held by another sequence",
            )
        open_blocks = self._open_blocks()
        if n % self.block_size:
            open_blocks.setdefault(table[n // self.block_size], []).append((n % self.block_size, reserved))
        for b in open_blocks.keys() & set(held):
            if (problem := _written_ahead_problem(b, open_blocks[b], self.refcount[b] + 1)) is not None:
                raise BlockdError(ErrorCode.INVALID_REQUEST, f"sequence {seq_id!r}: {problem}")
        for b in held:
            if self.refcount[b] == 0:
                del self.free_queue[b]
            self.refcount[b] += 1
        extra = self.extra_for(cache_salt, group)
        self.seqs[seq_id] = SeqState(bytearray(packed), list(table), [], 0, extra, reserved, holes, group)

    def _group_problems(self) -> list[str]:
        """I7: a sequence has one table per layer group, named by `group_table_ids`, all of its tokens, reserved
        slots and committed blocks, each keyed by its group."""
        if self.num_groups == 1:
            return []
        problems: list[str] = []
        pid = self.spec.pool_id
        for seq_id, seq in self.seqs.items():
            if seq.group != 0:
                base = seq_id.rpartition(GROUP_MARK)[0]
                if seq_id != group_table_ids(base, self.num_groups)[seq.group] or base not in self.seqs:
                    problems.append(f"{pid}: I7 table {seq_id!r} of group {seq.group} belongs to no live sequence")
                continue
            for g, table_id in enumerate(group_table_ids(seq_id, self.num_groups)):
                other = self.seqs.get(table_id)
                if other is None or other.group != g:
                    problems.append(f"{pid}: I7 sequence {seq_id!r} has no table {table_id!r} of group {g}")
                elif (other.tokens, other.reserved, other.committed) != (seq.tokens, seq.reserved, seq.committed):
                    problems.append(f"{pid}: I7 table {table_id!r} differs from {seq_id!r} in tokens or slots")
        return problems

    def _open_blocks(self) -> dict[int, list[tuple[int, int]]]:
        """Each live sequence's open block (partly filled: its next token goes there) -> (its tokens in that
        block, its reserved slots) for every sequence it is open for (O(live sequences): re-sync and check)."""
        bs = self.block_size
        found: dict[int, list[tuple[int, int]]] = {}
        for q in self.seqs.values():
            n = len(q.tokens) // _TOKEN_BYTES
            if n % bs and n // bs < len(q.table):  # (a table too short for its tokens is I4's other report)
                found.setdefault(q.table[n // bs], []).append((n % bs, q.reserved))
        return found

    def _tails(self) -> set[int]:
        """Every live sequence's blocks past its tokens (O(live sequences): re-sync only)."""
        bs = self.block_size
        return {b for q in self.seqs.values() for b in q.table[shared_blocks(bs, len(q.tokens) // _TOKEN_BYTES) :]}

    def restore_index(self, records: Iterable[tuple[int, BlockRecord]], generations: Sequence[int] | None) -> int:
        """Re-enter block records persisted earlier, keeping only those the executor's KV still backs.

        A record (block -> h, gen) survives only if the executor reports generation `gen` for that block, the
        block carries no other hash and h is not indexed yet. Free blocks among them go to the LRU queue in their
        persisted order. Returns the number of entries restored.
        """
        if generations is None:
            return 0
        kept: list[tuple[int, bytes, int]] = []
        for b, (h, gen, stamp) in records:
            if not 0 <= b < self.num_blocks or generations[b] != gen or gen == 0:
                continue
            if self.block_hash[b] is not None or h in self.index:
                continue
            self.index[h] = b
            self.block_hash[b] = h
            self.stamp[b] = stamp
            kept.append((stamp, h, b))
        for _, _, b in sorted(kept):
            if self.refcount[b] == 0:
                self.free_queue.move_to_end(b)
        self._clock = max(self._clock, max((s for s, _, _ in kept), default=0))
        return len(kept)

    def adopt_generations(self, generations: Sequence[int]) -> None:
        """Take the executor's generation of every block (what its KV holds) as the truth."""
        if len(generations) != self.num_blocks:
            raise BlockdError(
                ErrorCode.INVALID_REQUEST,
                f"generations has {len(generations)} entries, the pool has {self.num_blocks} blocks",
            )
        for b, gen in enumerate(generations):
            if gen < 0:
                raise BlockdError(ErrorCode.INVALID_REQUEST, f"block {b}: generation {gen} is negative")
        self.generation = list(generations)

    def block_records(self) -> dict[int, BlockRecord]:
        """What every indexed block holds, as persistence writes and `restore_index` takes it (O(index))."""
        return {b: (h, self.generation[b], self.stamp[b]) for h, b in self.index.items()}

    # ------------------------------------------------------------------------------------ observability

    def stats(self) -> PoolStats:
        bs = self.block_size
        fill: dict[int, int] = {}
        for seq in self.seqs.values():
            n = len(seq.tokens) // _TOKEN_BYTES
            for i, b in enumerate(seq.table[seq.holes :], seq.holes):
                used = min(bs, n - i * bs)
                if used > fill.get(b, 0):
                    fill[b] = used
        in_use = self.num_blocks - len(self.free_queue)
        tokens_held = sum(fill.values())
        cached_free = sum(1 for b in self.free_queue if self.block_hash[b] is not None)
        never_used = sum(1 for b in self.free_queue if self.generation[b] == 0)
        c = self.counters
        return PoolStats(
            pool_id=self.spec.pool_id,
            epoch_fingerprint=epoch_fingerprint(self.spec.epoch),
            model_id=self.spec.model_id,
            block_size=bs,
            blocks_total=self.num_blocks,
            blocks_in_use=in_use,
            blocks_cached_free=cached_free,
            blocks_never_used=never_used,
            index_entries=len(self.index),
            live_sequences=len(self.seqs) // self.num_groups,  # (every group's table of each)
            tokens_held=tokens_held,
            kv_utilization=tokens_held / (in_use * bs) if in_use else 1.0,
            prefix_hit_rate_tokens=c.hit_tokens / c.queried_tokens if c.queried_tokens else 0.0,
            prefix_hit_rate_blocks=c.hit_blocks / c.queried_blocks if c.queried_blocks else 0.0,
            counters=msgspec.structs.replace(c),
            tiers=self.tiers.stats() if self.tiers is not None else [],
        )

    def check(self) -> list[str]:
        """Verify the state invariants I1-I5 and I7 (this module's docstring; I6 needs a before and an after:
        the tests compare states); returns one line per violation (empty: all hold)."""
        problems: list[str] = []
        pid = self.spec.pool_id
        references = [0] * self.num_blocks
        for seq_id, seq in self.seqs.items():
            n = len(seq.tokens) // _TOKEN_BYTES
            expected = _ceil_div(n + seq.reserved, self.block_size)
            if len(seq.table) != expected or not n or not 0 <= seq.reserved <= reservable(self.block_size, n):
                problems.append(
                    f"{pid}: I4 sequence {seq_id!r} holds {len(seq.table)} blocks for {n} tokens and "
                    f"{seq.reserved} reserved slots (expected {expected})"
                )
            for b in seq.table[shared_blocks(self.block_size, n) :]:
                if 0 <= b < self.num_blocks and self.refcount[b] != 1:  # (outside the pool: reported below)
                    problems.append(
                        f"{pid}: I4 sequence {seq_id!r} shares block {b}, which holds only its reserved slots"
                    )
            if seq.committed > n // self.block_size:
                problems.append(
                    f"{pid}: I4 sequence {seq_id!r} has {seq.committed} committed blocks, more than its full blocks"
                )
            holes = _leading_holes(seq.table)
            allowed = dead_blocks(self.block_size, self.windows[seq.group], n)
            if holes != seq.holes or holes > allowed:
                problems.append(
                    f"{pid}: I4 sequence {seq_id!r} has {holes} leading holes (counted {seq.holes}), where at most "
                    f"{allowed} blocks are past every query's window"
                )
            for b in seq.table[holes:]:
                if not 0 <= b < self.num_blocks:
                    problems.append(f"{pid}: sequence {seq_id!r} names block {b} outside the pool")
                else:
                    references[b] += 1
        for b in range(self.num_blocks):
            if self.refcount[b] != references[b]:
                problems.append(f"{pid}: I2 block {b} has refcount {self.refcount[b]} but {references[b]} references")
            if (self.refcount[b] == 0) != (b in self.free_queue):
                problems.append(
                    f"{pid}: I1 block {b} refcount {self.refcount[b]}, in free queue: {b in self.free_queue}"
                )
            h = self.block_hash[b]
            if h is not None and self.index.get(h) != b:
                problems.append(f"{pid}: I3 block {b} carries a hash the index does not map to it")
        problems += self._group_problems()
        for h, b in self.index.items():
            if not 0 <= b < self.num_blocks or self.block_hash[b] != h:
                problems.append(f"{pid}: I3 index entry {h.hex()} names block {b} whose hash differs")
        for b, open_for in self._open_blocks().items():
            holders = self.refcount[b] if 0 <= b < self.num_blocks else len(open_for)
            if (problem := _written_ahead_problem(b, open_for, holders)) is not None:
                problems.append(f"{pid}: I4 {problem}")
        seen_cached = False
        last_stamp = -1
        for b in self.free_queue:
            if self.block_hash[b] is None:
                if seen_cached:
                    problems.append(f"{pid}: I5 uncached free block {b} sits behind a cached one")
            else:
                seen_cached = True
                if self.stamp[b] < last_stamp:
                    problems.append(f"{pid}: I5 cached free block {b} is out of LRU order")
                last_stamp = self.stamp[b]
        if self.tiers is not None:
            problems += self.tiers.check()
        return problems
