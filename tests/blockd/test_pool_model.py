"""Stateful property test: a real BlockPool against a deliberately naive reference model.

The model knows nothing about hashes: its prefix index is keyed by (cache salt, tuple(full token prefix)), it keeps
the free queue as a plain Python list (head = index 0) and does every lookup with a linear scan. It implements the
same allocation policy as the pool (uncached free blocks first, then least recently freed cached blocks; a freed
sequence releases its blocks tail first), so the two must agree exactly after every step: results, error codes,
missing_blocks, granted block ids, generations, copy instructions, refcounts, free-queue order and the index.

Every failing operation must leave the pool's state untouched (I6), and after each step the invariants I1-I5 are
checked both by `pool.check()` and independently here. A `restart` step re-syncs a fresh pool from the executor's
view (adopt_generations + restore_sequence + restore_index, possibly from a stale persisted snapshot) and checks
that no restored index entry names a block whose KV no longer holds that prefix.
"""

from __future__ import annotations

import os
from typing import Any

import msgspec
from hypothesis import HealthCheck, Phase, event, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from blockd.errors import BlockdError, ErrorCode
from blockd.hashing import chain_hashes
from blockd.pool import HOLE, BlockPool, PoolSpec
from tests.blockd.pool_state import index_view, pool_state

SEQ_IDS = ["a", "b", "c", "d", "e"]
SALTS = [None, "t1", "t2"]
TOKENS = st.integers(0, 2)  # a tiny alphabet, so prefixes collide and prefix hits happen
PROMPTS = st.lists(TOKENS, min_size=1, max_size=12)

Key = tuple[Any, tuple[int, ...]]  # (cache salt, full token prefix up to the end of a block)


class ModelError(Exception):
    def __init__(self, code: ErrorCode, missing_blocks: int = 0) -> None:
        super().__init__(code)
        self.code = code
        self.missing_blocks = missing_blocks


class ModelSeq:
    def __init__(
        self, tokens: list[int], table: list[int], committed: int, salt: str | None, reserved: int = 0
    ) -> None:
        self.tokens = tokens
        self.table = table
        self.committed = committed
        self.salt = salt
        self.reserved = reserved  # slots held past the tokens for a token still being sampled


class Model:
    """The naive reference: plain lists, linear scans, no hashing.

    Its block arithmetic (admit, append, copy-on-write) is its own on purpose, not blockd.block_rule's: an
    independent reference is what lets this test catch a wrong rule.
    """

    def __init__(self, num_blocks: int, block_size: int, window: int | None = None) -> None:
        self.n = num_blocks
        self.bs = block_size
        self.window = window
        self.refcount = [0] * num_blocks
        self.generation = [0] * num_blocks
        self.key: list[Key | None] = [None] * num_blocks  # what the index says each block holds
        self.free: list[int] = list(range(num_blocks))  # head (index 0) is allocated next
        self.index: list[tuple[Key, int]] = []  # insertion order, like a dict
        self.seqs: dict[str, ModelSeq] = {}
        self.freed: set[str] = set()
        self.counters = dict(
            queried_tokens=0,
            hit_tokens=0,
            queried_blocks=0,
            hit_blocks=0,
            granted_blocks=0,
            freed_blocks=0,
            evictions=0,
            copies_on_write=0,
            admits=0,
            admit_failures=0,
        )
        # The full-block content each block's KV actually holds (None: unknown/partial); survives freeing.
        self.content: list[Key | None] = [None] * num_blocks

    # ---- helpers

    def seq(self, sid: str) -> ModelSeq:
        for s, seq in self.seqs.items():
            if s == sid:
                return seq
        if sid in self.freed:
            raise ModelError(ErrorCode.DOUBLE_FREE)
        raise ModelError(ErrorCode.UNKNOWN_SEQUENCE)

    def block_key(self, salt: str | None, tokens: list[int], i: int) -> Key:
        return (salt, tuple(tokens[: (i + 1) * self.bs]))

    def find(self, key: Key) -> int | None:
        for k, b in self.index:
            if k == key:
                return b
        return None

    def allocate(self, count: int) -> list[int]:
        granted = []
        for _ in range(count):
            b = self.free.pop(0)
            if self.key[b] is not None:
                self.index = [(k, x) for k, x in self.index if x != b]
                self.key[b] = None
                self.counters["evictions"] += 1
            self.generation[b] += 1
            self.refcount[b] = 1
            self.content[b] = None
            granted.append(b)
        return granted

    def refresh_content(self) -> None:
        for seq in self.seqs.values():
            for i in range(len(seq.tokens) // self.bs):
                if seq.table[i] != HOLE:
                    self.content[seq.table[i]] = self.block_key(seq.salt, seq.tokens, i)

    # ---- operations

    def admit(
        self, sid: str, tokens: list[int], salt: str | None, hold: int | None = None
    ) -> tuple[list[int], list[int], int]:
        if sid in self.seqs:
            raise ModelError(ErrorCode.SEQUENCE_EXISTS)
        n = len(tokens)
        if n == 0 or any(not 0 <= t < 2**32 for t in tokens):
            raise ModelError(ErrorCode.INVALID_REQUEST)
        if (n if hold is None else hold) > self.n * self.bs:  # more than the whole pool holds: refused at once
            self.counters["admit_failures"] += 1
            raise ModelError(ErrorCode.TOO_MANY_TOKENS)
        hits = self.hits(tokens, salt)
        if hold is not None and len(hits) * self.bs + hold < n:  # only `hold` tokens past the hit registered
            tokens = tokens[: len(hits) * self.bs + max(hold, 1)]
            n = len(tokens)
        needed = -(-n // self.bs) - len(hits)
        available = len(self.free) - len([b for b in hits if b != HOLE and self.refcount[b] == 0])
        if needed > available:
            self.counters["admit_failures"] += 1
            raise ModelError(ErrorCode.OUT_OF_BLOCKS, needed - available)
        for b in hits:
            if b == HOLE:
                continue
            if self.refcount[b] == 0:
                self.free.remove(b)
            self.refcount[b] += 1
        table = hits + self.allocate(needed)
        self.seqs[sid] = ModelSeq(list(tokens), table, len(hits), salt)
        c = self.counters
        c["admits"] += 1
        c["queried_blocks"] += n // self.bs
        c["hit_blocks"] += len(hits)
        c["queried_tokens"] += n
        c["hit_tokens"] += len(hits) * self.bs
        c["granted_blocks"] += needed
        return table, [0 if b == HOLE else self.generation[b] for b in table], len(hits) * self.bs

    def dead(self, num_computed: int, limit: int) -> int:
        """Leading blocks (at most `limit`) whose last slot a query at `num_computed` no longer sees."""
        dead = 0
        while dead < limit and self.window is not None and num_computed - ((dead + 1) * self.bs - 1) >= self.window:
            dead += 1
        return dead

    def hits(self, tokens: list[int], salt: str | None) -> list[int]:
        """The longest cached prefix's table: every block the first query after it still reads is indexed (all of
        them, without a window); the ones before are holes."""
        for cached in range((len(tokens) - 1) // self.bs if tokens else 0, 0, -1):
            holes = self.dead(cached * self.bs, cached - 1)  # its last block is always indexed
            found = [self.find(self.block_key(salt, tokens, i)) for i in range(holes, cached)]
            if None not in found:
                return [HOLE] * holes + found
        return []

    def append(self, sid: str, tokens: list[int], reserve: int = 0) -> tuple[tuple, tuple, tuple, tuple]:
        seq = self.seq(sid)
        n_old = len(seq.tokens)
        n_new = n_old + len(tokens)
        # A reservation may end at most one block past the block its first slot is in.
        if not 0 <= reserve <= 2 * self.bs - n_new % self.bs or any(not 0 <= t < 2**32 for t in tokens):
            raise ModelError(ErrorCode.INVALID_REQUEST)
        # Tokens fill the reserved slot first; a reservation not filled stays.
        left = seq.reserved - min(seq.reserved, len(tokens))
        keep = max(reserve, left)
        new_blocks = -(-(n_old + len(tokens) + keep) // self.bs) - len(seq.table)
        # The block of the last token, when it has room, is the only one a fork can have shared with the writer.
        # It is written by a token (the first lands there), or by a slot newly reserved in it: new reserved slots
        # start where the old ones end.
        last = (n_old - 1) // self.bs
        end_of_last = (last + 1) * self.bs
        writes = bool(tokens) or (keep > seq.reserved and n_old + seq.reserved < end_of_last)
        cow = writes and end_of_last > n_old and self.refcount[seq.table[last]] > 1
        if new_blocks <= 0 and not cow:
            seq.tokens.extend(tokens)
            seq.reserved = keep
            return (), (), (), ()
        needed = max(new_blocks, 0) + int(cow)
        if needed > len(self.free):
            raise ModelError(ErrorCode.OUT_OF_BLOCKS, needed - len(self.free))
        seq.tokens.extend(tokens)
        seq.reserved = keep
        self.counters["granted_blocks"] += needed
        copies: tuple = ()
        copy_gens: tuple = ()
        if cow:
            src = seq.table[last]
            (dst,) = self.allocate(1)
            self.refcount[src] -= 1
            seq.table[last] = dst
            copies, copy_gens = ((src, dst),), (self.generation[dst],)
            self.counters["copies_on_write"] += 1
        grown = self.allocate(new_blocks) if new_blocks > 0 else []
        seq.table.extend(grown)
        return tuple(grown), tuple(self.generation[b] for b in grown), copies, copy_gens

    def commit(self, sid: str, num_computed: int) -> int:
        seq = self.seq(sid)
        if num_computed < 0 or num_computed > len(seq.tokens):
            raise ModelError(ErrorCode.INVALID_REQUEST)
        full = num_computed // self.bs
        added = 0
        for i in range(seq.committed, full):
            key = self.block_key(seq.salt, seq.tokens, i)
            if self.find(key) is not None:
                continue  # the first copy stays the hit
            b = seq.table[i]
            if b == HOLE or self.key[b] is not None:
                continue
            self.index.append((key, b))
            self.key[b] = key
            added += 1
        seq.committed = max(seq.committed, full)
        return added

    def fork(self, parent: str, child: str) -> None:
        p = self.seq(parent)
        if child in self.seqs:
            raise ModelError(ErrorCode.SEQUENCE_EXISTS)
        # The child takes the blocks that hold a token, and none of the parent's reserved-only ones.
        shared = [b for i, b in enumerate(p.table) if i * self.bs < len(p.tokens)]
        for b in shared:
            if b != HOLE:
                self.refcount[b] += 1
        self.seqs[child] = ModelSeq(list(p.tokens), shared, p.committed, p.salt)
        self.freed.discard(child)

    def release(self, blocks: list[int]) -> int:
        held = [b for b in blocks if b != HOLE]
        for b in reversed(held):
            self.refcount[b] -= 1
            if self.refcount[b] == 0:
                if self.key[b] is None:
                    self.free.insert(0, b)  # holds nothing worth keeping: reused first
                else:
                    self.free.append(b)  # most recently freed cached block: evicted last
        self.counters["freed_blocks"] += len(held)
        return len(held)

    def free_seq(self, sid: str) -> int:
        seq = self.seq(sid)
        del self.seqs[sid]
        self.freed.add(sid)
        return self.release(seq.table)

    def slide(self, sid: str, num_computed: int) -> int:
        if self.window is None:
            raise ModelError(ErrorCode.INVALID_REQUEST)
        seq = self.seq(sid)
        if not 0 <= num_computed <= len(seq.tokens):
            raise ModelError(ErrorCode.INVALID_REQUEST)
        # A block is dead when its last slot is: the first query still to come (at num_computed) no longer sees it.
        dead = self.dead(num_computed, len(seq.table))
        released = self.release(seq.table[:dead])
        seq.table[:dead] = [HOLE] * dead
        return released

    def trim(self, sid: str, reserve: int) -> int:
        seq = self.seq(sid)
        if not 0 <= reserve <= seq.reserved:
            raise ModelError(ErrorCode.INVALID_REQUEST)
        seq.reserved = reserve
        # A block stays when a slot of it holds a token or a kept reserved slot; the others (all at the tail).
        keep = len({slot // self.bs for slot in range(len(seq.tokens) + reserve)})
        released, seq.table = seq.table[keep:], seq.table[:keep]
        return self.release(released)

    def lookup(self, tokens: list[int], salt: str | None) -> int:
        if any(not 0 <= t < 2**32 for t in tokens):
            raise ModelError(ErrorCode.INVALID_REQUEST)
        return len(self.hits(tokens, salt)) * self.bs

    def reset(self) -> int:
        dropped = len(self.index)
        for _, b in self.index:
            self.key[b] = None
            if self.refcount[b] == 0:
                self.free.remove(b)
                self.free.insert(0, b)
        self.index = []
        return dropped


class PoolMachine(RuleBasedStateMachine):
    pool: BlockPool
    model: Model

    @initialize(
        num_blocks=st.one_of(st.integers(4, 10), st.integers(4, 24)),
        block_size=st.integers(2, 4),
        window=st.one_of(st.none(), st.integers(1, 9)),
    )
    def setup(self, num_blocks: int, block_size: int, window: int | None) -> None:
        self.spec = PoolSpec("p0", num_blocks, block_size, "model-x", 1, window)
        self.journal: dict = {}
        self.pool = BlockPool(self.spec, journal=self.journal)
        self.model = Model(num_blocks, block_size, window)
        self.slid: dict[str, int] = {}  # the furthest slide of each live sequence (its executor's computed tokens)
        # (tokens, salt) seen so far, to build prompts that share prefixes with them
        self.history: list[tuple[list[int], str | None]] = []
        self.persisted: list[dict] = []  # index snapshots taken earlier (what Redis may still hold)

    # ---- the comparison harness

    def both(self, desc: str, pool_op, model_op, *, mutating: bool = True) -> Any:
        """Run the same operation on pool and model; they must agree on success/failure, code and result."""
        note(f"pool.{desc}")
        before = pool_state(self.pool)
        try:
            got = pool_op()
        except BlockdError as exc:
            try:
                model_op()
            except ModelError as mexc:
                assert exc.code == mexc.code, (exc, mexc.code)
                assert exc.missing_blocks == mexc.missing_blocks, (exc, mexc.missing_blocks)
            else:
                raise AssertionError(f"pool failed ({exc}) where the model succeeded") from None
            assert pool_state(self.pool) == before, f"I6: failed operation changed the pool ({exc})"
            event(f"failure: {exc.code}")
            return exc
        try:
            want = model_op()
        except ModelError as mexc:
            raise AssertionError(f"model failed ({mexc.code}) where the pool succeeded with {got!r}") from None
        if not mutating:
            assert pool_state(self.pool) == before, "a read-only operation changed the pool"
        self.model.refresh_content()
        return got, want

    # ---- the one rule: a weighted choice of operation
    #
    # Hypothesis' own rule selection (swarm-disabled rules, a strong bias to the first rule) left most runs with
    # almost no prefix hits or evictions; a weighted dispatch keeps every run busy with the interesting mix.

    OPS: tuple[tuple[str, int], ...] = (
        # Hypothesis favours the first choice: a prompt sharing a prefix with an earlier one (prefix hits).
        ("admit_sharing_prefix", 22),
        ("admit", 14),
        ("free", 16),
        ("append", 12),
        ("commit_all_computed", 10),
        ("commit", 6),
        ("fork", 8),
        ("slide", 8),
        ("trim", 6),
        ("lookup", 3),
        ("on_dead_sequence", 3),
        ("reset_prefix_cache", 2),
        ("persist", 4),
        ("restart", 4),
    )
    NEEDS_LIVE = frozenset({"append", "commit_all_computed", "commit", "free", "fork", "slide", "trim"})

    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        weighted = [name for name, weight in self.OPS for _ in range(weight)]
        name = data.draw(st.sampled_from(weighted), label="op")
        if (name in self.NEEDS_LIVE and not self.model.seqs) or (name == "admit_sharing_prefix" and not self.history):
            name = "admit"
        getattr(self, "op_" + name)(data)

    def live(self) -> list[str]:
        return [s for s in SEQ_IDS if s in self.model.seqs]

    def draw_new_id(self, data: st.DataObject) -> str:
        """Mostly an id that is not live (the op can succeed), sometimes a live one (SEQUENCE_EXISTS)."""
        dead = [s for s in SEQ_IDS if s not in self.model.seqs]
        if not dead or data.draw(st.integers(0, 9)) == 9:
            return data.draw(st.sampled_from(SEQ_IDS))
        return data.draw(st.sampled_from(dead))

    def _lookup(self, tokens: list[int], salt: str | None) -> int | None:
        out = self.both(
            f"lookup({tokens}, {salt!r})",
            lambda: self.pool.lookup(tokens, salt),
            lambda: self.model.lookup(tokens, salt),
            mutating=False,
        )
        if isinstance(out, BlockdError):
            return None
        got, want = out
        assert got == want
        return got

    def _admit(self, sid: str, tokens: list[int], salt: str | None, hold: int | None = None) -> None:
        expected_hit = self._lookup(tokens, salt)  # lookup reports what admit will hit
        free_before = set(self.pool.free_queue)
        out = self.both(
            f"admit({sid!r}, {tokens}, {salt!r}, hold={hold})",
            lambda: self.pool.admit(sid, tokens, salt, hold=hold),
            lambda: self.model.admit(sid, tokens, salt, hold),
        )
        if isinstance(out, tuple):
            self.slid.pop(sid, None)
            got, (table, gens, cached) = out
            assert got.blocks == table
            assert got.generations == gens
            assert got.num_cached_tokens == cached == expected_hit
            assert cached <= len(tokens) - 1
            if cached:
                event("admit: prefix hit")
                if free_before & set(got.blocks[: cached // self.pool.block_size]):
                    event("admit: hit on a cached-free block")
            self.history.append((self.model.seqs[sid].tokens[:], salt))
        elif out.code == ErrorCode.INVALID_REQUEST:
            event("admit: invalid request")

    def op_admit(self, data: st.DataObject) -> None:
        tokens = data.draw(PROMPTS)
        salt = data.draw(st.sampled_from(SALTS))
        if data.draw(st.integers(0, 19)) == 19:  # now and then an id out of range, anywhere in the prompt
            tokens[data.draw(st.integers(0, len(tokens) - 1))] = data.draw(st.sampled_from([-1, 2**32, 2**40]))
        elif data.draw(st.integers(0, 29)) == 29:
            tokens = []
        # Now and then a prompt held in part (a sliding window's long prompt: the rest is appended later).
        hold = data.draw(st.sampled_from([None, None, None, 0, 1, 3]))
        self._admit(self.draw_new_id(data), tokens, salt, hold)

    def op_admit_sharing_prefix(self, data: st.DataObject) -> None:
        """A prompt that shares a prefix with an indexed one or one seen before, usually under the same salt."""
        if self.model.index and data.draw(st.integers(0, 2)) < 2:
            salt, prefix = data.draw(st.sampled_from([key for key, _ in self.model.index]))
            base = list(prefix)
        else:
            base, salt = data.draw(st.sampled_from(self.history))
        cut = data.draw(st.one_of(st.just(len(base)), st.integers(1, len(base))))
        suffix = data.draw(st.lists(TOKENS, max_size=4))
        if data.draw(st.integers(0, 5)) == 5:
            salt = data.draw(st.sampled_from(SALTS))
        self._admit(self.draw_new_id(data), base[:cut] + suffix, salt)

    def op_append(self, data: st.DataObject, sid: str | None = None) -> None:
        if sid is None:
            sid = data.draw(st.sampled_from(self.live()))
        # A reservation: room for tokens computed before they are registered (the engine's decode steps), to
        # the end of the next token's block or of the block after it; now and then one reaching further.
        tokens = data.draw(st.lists(TOKENS, min_size=0, max_size=5))
        n_new = len(self.model.seqs[sid].tokens) + len(tokens) if sid in self.model.seqs else len(tokens)
        block_end = self.model.bs - n_new % self.model.bs
        most = block_end + self.model.bs
        reserve = data.draw(st.sampled_from([0, 0, 1, block_end, block_end, most, most, most + 1]))
        if tokens and data.draw(st.integers(0, 19)) == 19:  # now and then an id out of range
            tokens[data.draw(st.integers(0, len(tokens) - 1))] = data.draw(st.sampled_from([-1, 2**32]))
        out = self.both(
            f"append({sid!r}, {tokens}, reserve={reserve})",
            lambda: self.pool.append(sid, tokens, reserve),
            lambda: self.model.append(sid, tokens, reserve),
        )
        if isinstance(out, tuple):
            got, (blocks, gens, copies, copy_gens) = out
            assert got.blocks == blocks
            assert got.generations == gens
            assert got.copies == copies
            assert got.copy_generations == copy_gens
            if copies:
                event("append: copy-on-write")
            if reserve and not tokens:
                event("append: a reservation alone")
            self.history.append((list(self.model.seqs[sid].tokens), self.model.seqs[sid].salt))

    def op_commit_all_computed(self, data: st.DataObject) -> None:
        """Every live sequence reports all its tokens computed (the executor's usual step)."""
        for sid in self.live():
            n = len(self.model.seqs[sid].tokens)
            got, want = self.both(
                f"commit({sid!r}, {n})",
                lambda sid=sid, n=n: self.pool.commit(sid, n),
                lambda sid=sid, n=n: self.model.commit(sid, n),
            )
            assert got == want
        self.persisted.append(self.pool.block_records())  # a write-behind flush that may go stale later

    def op_commit(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(self.live()))
        n = len(self.model.seqs[sid].tokens)
        num_computed = data.draw(st.one_of(st.integers(0, n), st.sampled_from([-1, n + 1])))
        out = self.both(
            f"commit({sid!r}, {num_computed})",
            lambda: self.pool.commit(sid, num_computed),
            lambda: self.model.commit(sid, num_computed),
        )
        if isinstance(out, tuple):
            got, want = out
            assert got == want

    def op_slide(self, data: st.DataObject) -> None:
        """A step hands back the blocks past every query's window (mostly after computing all its tokens)."""
        sid = data.draw(st.sampled_from(self.live()))
        n = len(self.model.seqs[sid].tokens)
        num_computed = data.draw(st.one_of(st.just(n), st.integers(0, n), st.sampled_from([-1, n + 1])))
        out = self.both(
            f"slide({sid!r}, {num_computed})",
            lambda: self.pool.slide(sid, num_computed),
            lambda: self.model.slide(sid, num_computed),
        )
        if isinstance(out, tuple):
            got, want = out
            assert got == want
            self.slid[sid] = max(self.slid.get(sid, 0), num_computed)
            if got:
                event("slide: blocks handed back")

    def op_trim(self, data: st.DataObject) -> None:
        """Speculative decoding's rollback: some of the reserved room goes back (now and then more than held)."""
        sid = data.draw(st.sampled_from(self.live()))
        reserved = self.model.seqs[sid].reserved
        reserve = data.draw(st.one_of(st.integers(0, reserved), st.sampled_from([0, reserved, reserved + 1, -1])))
        out = self.both(
            f"trim({sid!r}, {reserve})",
            lambda: self.pool.trim(sid, reserve),
            lambda: self.model.trim(sid, reserve),
        )
        if isinstance(out, tuple):
            got, want = out
            assert got == want
            if got:
                event("trim: blocks handed back")

    def op_fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(self.live()))
        child = self.draw_new_id(data)
        out = self.both(
            f"fork({parent!r}, {child!r})",
            lambda: self.pool.fork(parent, child),
            lambda: self.model.fork(parent, child),
        )
        if isinstance(out, tuple):
            assert out == (None, None)
            self.slid[child] = self.slid.get(parent, 0)
            if data.draw(st.booleans()):  # usually one of them writes next: copy-on-write if the tail is partial
                self.op_append(data, sid=data.draw(st.sampled_from([parent, child])))

    def _op_on_dead(self, sid: str, data: st.DataObject) -> None:
        """Any op on a freed id answers DOUBLE_FREE, on a never-seen id UNKNOWN_SEQUENCE; nothing changes."""
        expected = ErrorCode.DOUBLE_FREE if sid in self.model.freed else ErrorCode.UNKNOWN_SEQUENCE
        op = data.draw(st.sampled_from(["free", "append", "commit", "fork"]))
        pool_op = {
            "free": lambda: self.pool.free(sid),
            "append": lambda: self.pool.append(sid, [1]),
            "commit": lambda: self.pool.commit(sid, 0),
            "fork": lambda: self.pool.fork(sid, "child-of-dead"),
        }[op]
        model_op = {
            "free": lambda: self.model.free_seq(sid),
            "append": lambda: self.model.append(sid, [1]),
            "commit": lambda: self.model.commit(sid, 0),
            "fork": lambda: self.model.fork(sid, "child-of-dead"),
        }[op]
        exc = self.both(f"{op}({sid!r}, ...)", pool_op, model_op)
        assert isinstance(exc, BlockdError) and exc.code == expected, exc

    def op_free(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(self.live()))
        got, want = self.both(f"free({sid!r})", lambda: self.pool.free(sid), lambda: self.model.free_seq(sid))
        assert got == want
        self.slid.pop(sid, None)
        if data.draw(st.integers(0, 3)) == 3:  # sometimes free it again (or use it) right away
            self._op_on_dead(sid, data)

    def op_lookup(self, data: st.DataObject) -> None:
        if self.history and data.draw(st.booleans()):
            tokens, salt = data.draw(st.sampled_from(self.history))
        else:
            tokens, salt = data.draw(st.lists(TOKENS, max_size=12)), data.draw(st.sampled_from(SALTS))
        self._lookup(tokens, salt)

    def op_on_dead_sequence(self, data: st.DataObject) -> None:
        dead = [s for s in [*SEQ_IDS, "never-admitted"] if s not in self.model.seqs]
        self._op_on_dead(data.draw(st.sampled_from(dead)), data)

    def op_reset_prefix_cache(self, data: st.DataObject) -> None:
        got, want = self.both("reset_prefix_cache()", self.pool.reset_prefix_cache, self.model.reset)
        assert got == want
        if got:
            event("reset: dropped entries")

    def op_persist(self, data: st.DataObject) -> None:
        """What a persistence writer would have put in Redis at this moment."""
        note("persist: block_records()")
        self.persisted.append(self.pool.block_records())

    def op_restart(self, data: st.DataObject) -> None:
        """Re-sync a fresh pool from the executor's view; the live pool itself is left as it is."""
        use_stale = not data.draw(st.booleans())  # mostly the stale snapshot: the write-behind race
        note(f"restart(use_stale={use_stale})")
        pool, bs = self.pool, self.pool.block_size
        fresh = pool.block_records()
        snap = fresh
        if use_stale and self.persisted:  # the oldest snapshot is the most likely one to be stale
            snap = self.persisted[data.draw(st.integers(0, len(self.persisted) - 1))]
        executor_generations = list(pool.generation)
        p2 = BlockPool(self.spec)
        p2.adopt_generations(executor_generations)
        for sid, seq in pool.seqs.items():
            salt = next(s for s in SALTS if pool.extra_for(s) == seq.extra)
            computed = max(seq.committed * bs, self.slid.get(sid, 0))  # what its executor's mirror sends
            p2.restore_sequence(sid, pool.token_ids(sid), seq.table, computed, salt, seq.reserved)
        p2.restore_index(snap.items(), executor_generations)
        assert p2.check() == []
        assert p2.refcount == pool.refcount
        assert set(p2.free_queue) == set(pool.free_queue)
        # Every restored entry names a block whose KV really holds that prefix (never a stale hit).
        truth = set()
        for b, key in enumerate(self.model.content):
            if key is not None:
                salt, prefix = key
                truth.add((chain_hashes(list(prefix), bs, pool.root, pool.extra_for(salt))[-1], b))
        if len(p2.index) < len(snap):
            event("restart: entries dropped")
        for h, b in p2.index.items():
            assert (h, b) in truth, f"restored index entry names block {b}, which no longer holds that prefix"
        if snap is fresh:  # nothing was lost: every current prefix hit is still a hit after the re-sync
            assert set(pool.index) <= set(p2.index)
            for tokens, _ in self.history[-5:]:
                for salt in SALTS:
                    assert p2.lookup(tokens, salt) >= pool.lookup(tokens, salt)

    # ---- invariants

    @invariant()
    def pool_check_passes(self) -> None:
        assert self.pool.check() == []

    @invariant()
    def agrees_with_model(self) -> None:
        pool, model = self.pool, self.model
        assert pool.refcount == model.refcount
        assert pool.generation == model.generation
        assert list(pool.free_queue) == model.free
        bs = pool.block_size

        def h(key: Key) -> bytes:
            salt, prefix = key
            return chain_hashes(list(prefix), bs, pool.root, pool.extra_for(salt))[-1]

        assert list(pool.index.items()) == [(h(k), b) for k, b in model.index]
        assert pool.block_hash == [None if k is None else h(k) for k in model.key]
        assert set(pool.seqs) == set(model.seqs)
        for sid, seq in pool.seqs.items():
            m = model.seqs[sid]
            assert (pool.token_ids(sid), seq.table, seq.committed, seq.reserved) == (
                m.tokens,
                m.table,
                m.committed,
                m.reserved,
            ), sid
            assert seq.extra == pool.extra_for(m.salt)
        assert msgspec.structs.asdict(pool.counters) == model.counters
        if pool.counters.evictions:
            event("evictions happened")

    @invariant()
    def invariants_hold_independently(self) -> None:
        pool = self.pool
        # I1: the free queue is exactly the unreferenced blocks.
        assert len(pool.free_queue) == len(set(pool.free_queue))
        assert set(pool.free_queue) == {b for b in range(pool.num_blocks) if pool.refcount[b] == 0}
        # I2: refcounts add up to the block tables.
        assert sum(pool.refcount) == sum(len(s.table) - s.table.count(HOLE) for s in pool.seqs.values())
        referenced = {b for s in pool.seqs.values() for b in s.table} - {HOLE}
        assert not referenced & set(pool.free_queue), "a block is both free and referenced"
        assert all(pool.refcount[b] > 0 for b in referenced)
        # I3: every index entry names a block carrying that hash.
        for hsh, b in pool.index.items():
            assert pool.block_hash[b] == hsh
        assert sum(x is not None for x in pool.block_hash) == len(pool.index)
        # I4: block counts, committed blocks, and reserved-only blocks held alone.
        for sid, s in pool.seqs.items():
            assert 0 <= s.reserved <= 2 * pool.block_size - pool.num_tokens(sid) % pool.block_size
            assert len(s.table) == -(-(pool.num_tokens(sid) + s.reserved) // pool.block_size)
            holding_tokens = -(-pool.num_tokens(sid) // pool.block_size)
            assert all(pool.refcount[b] == 1 for b in s.table[holding_tokens:]), "a reserved-only block is shared"
            assert s.committed <= pool.num_tokens(sid) // pool.block_size
            # Holes: leading only, and only where no query from the last registered token on reads.
            holes = s.table.count(HOLE)
            assert s.table[:holes] == [HOLE] * holes
            w = pool.spec.sliding_window
            assert not holes or (w is not None and holes * pool.block_size - 1 <= pool.num_tokens(sid) - w)
        # I4: a sequence's reserved slots in its open block are written ahead, so every other holder of that
        # block has it open too (at its next token's position), reserves nothing and holds no more tokens there.
        bs = pool.block_size
        for sid, s in pool.seqs.items():
            n = pool.num_tokens(sid)
            if s.reserved and n % bs:
                for other_id, other in pool.seqs.items():
                    m = pool.num_tokens(other_id)
                    for position, b in enumerate(other.table):
                        if b == s.table[n // bs] and other_id != sid:
                            assert position == m // bs and 0 < m % bs <= n % bs and not other.reserved
        # I5: uncached free blocks first, then cached ones in least-recently-freed order.
        cached = [pool.block_hash[b] is not None for b in pool.free_queue]
        assert cached == sorted(cached)
        stamps = [pool.stamp[b] for b in pool.free_queue if pool.block_hash[b] is not None]
        assert stamps == sorted(stamps)

    @invariant()
    def journal_replays_to_the_index(self) -> None:
        """The journal's block records, validated by the current generations as a re-sync would, restore the
        current index exactly (blocks and generations); the LRU stamp a record carries (last commit or reuse)
        is never later than the block's in-memory one."""
        records = {b: r for b, r in self.journal.items() if r is not None}
        fresh = BlockPool(self.spec)
        fresh.adopt_generations(self.pool.generation)
        fresh.restore_index(records.items(), self.pool.generation)
        current = index_view(self.pool)
        assert {h: e[:2] for h, e in index_view(fresh).items()} == {h: e[:2] for h, e in current.items()}
        for b, (h, _, stamp) in records.items():
            if h in current and current[h][0] == b and self.pool.refcount[b] == 0:
                assert stamp <= current[h][2]


# Shrinking this machine runs at ~20 examples/s and could take Hypothesis' full 300 s shrink budget, longer than the
# pytest timeout. By default a failure is reported at once, with every pool call of the run as a note; set
# BLOCKD_MODEL_SHRINK=1 to get a minimal example instead (slow).
_PHASES = [Phase.explicit, Phase.reuse, Phase.generate, Phase.target]
if os.environ.get("BLOCKD_MODEL_SHRINK"):
    _PHASES.append(Phase.shrink)

PoolMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("BLOCKD_MODEL_EXAMPLES", "300")),
    stateful_step_count=50,
    derandomize=True,  # the same runs every time: stable in CI
    database=None,
    deadline=None,
    phases=_PHASES,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestPoolAgainstModel = PoolMachine.TestCase
