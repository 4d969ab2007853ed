"""Continuous batching: which sequences run this step, with how many tokens, and what blockd must do first.

A step is planned in two halves around its one blockd round trip:

`plan()` writes the step's `StepPlan`: one list of `PlannedOp`s, each a blockd op with the sequence it is for and
its `Purpose`, in an order that makes every op valid when blockd reaches it: commits (computed blocks into the
prefix index), forks (n > 1 choices), frees (finished, aborted, preempted), appends (room for each decoding
sequence's last sampled token), admits (waiting sequences, oldest first). This executor is the pool's only user,
so it knows exactly how many blocks are free: the pool client mirrors blockd's block tables and counts each
block's holders (`BlockView`), and `blockd.block_rule.growth` (the rule blockd grants by) says what each op
takes. Appends are planned to fit, preempting the most recently admitted sequences (recompute: they go back to
the head of the queue) until they do, so an append never fails. Admits are tried only while their worst case (no
prefix hit) fits above a small watermark; blockd answers with what was actually cached.

`apply()` takes in blockd's answers entry by entry, by purpose; `schedule()` then hands out the token budget: one
token to every decoding sequence, then prefill chunks to the others in admission order (chunked prefill), newly
admitted ones last.
"""

from __future__ import annotations

import enum
import itertools
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from blockd import protocol as p
from blockd.block_rule import growth
from blockd.client import MirroredSequence
from blockd.errors import ErrorCode
from common.tokens import pack_tokens
from executor.sequence import Sequence, Status


class BlockView(Protocol):
    """blockd's view of this pool as of the last step: what `blockd.client.PoolClient` mirrors."""

    @property
    def seqs(self) -> Mapping[str, MirroredSequence]: ...

    @property
    def refcount(self) -> list[int]: ...  # how many live tables hold each block

    @property
    def free_blocks(self) -> int: ...


@dataclass
class Chunk:
    """Tokens [start, start + len(token_ids)) of one sequence, computed this step."""

    seq: Sequence
    start: int
    token_ids: list[int]

    @property
    def samples(self) -> bool:  # the chunk reaches the sequence's end, so its last row's logits are sampled
        return self.start + len(self.token_ids) == len(self.seq.tokens)

    @property
    def scored_positions(self) -> range:
        """Positions of this chunk whose logits score the next prompt token for prompt logprobs (empty unless
        the request asks and they are not scored yet)."""
        request = self.seq.request
        done = request.prompt_logprobs
        if done is None:
            return range(0)
        return range(max(self.start, len(done)), min(self.start + len(self.token_ids), len(request.prompt) - 1))


class Purpose(enum.Enum):
    """What a planned op is for; `Scheduler.apply` takes in its answer by this."""

    COMMIT = "commit"  # computed full blocks into the prefix index
    FORK = "fork"  # a new choice starts sharing its parent's blocks
    FREE = "free"  # finished or aborted: its blocks go back
    PREEMPT = "preempt"  # its blocks go back; it is already queued again, to be recomputed
    APPEND = "append"  # room for the tokens sampled since the last step
    ADMIT = "admit"  # a waiting sequence gets blocks for all its tokens


@dataclass(frozen=True, slots=True)
class PlannedOp:
    """One op of a step, with the sequence it is for and why."""

    purpose: Purpose
    seq: Sequence
    op: p.StepOp


@dataclass
class StepPlan:
    """A step's blockd ops, in the order blockd applies them."""

    entries: list[PlannedOp] = field(default_factory=list)

    @property
    def ops(self) -> list[p.StepOp]:
        return [entry.op for entry in self.entries]

    def add(self, purpose: Purpose, seq: Sequence, op: p.StepOp) -> None:
        self.entries.append(PlannedOp(purpose, seq, op))

    def drop(self, seq: Sequence) -> None:
        """Take every op of `seq` out again."""
        self.entries = [entry for entry in self.entries if entry.seq is not seq]


@dataclass
class StepOutcome:
    admitted: list[Sequence] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst) before attention
    failed: list[tuple[Sequence, p.OpError]] = field(default_factory=list)  # ops blockd refused (not admits)


class Scheduler:
    """The waiting queue, the running batch and each step's plan; see the module docstring.

    It keeps no block accounting of its own: free blocks and who holds what come from `blocks`, the pool
    client's mirror of blockd, which changes only when a step's answers arrive (before `apply`).
    """

    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        blocks: BlockView,
        watermark_blocks: int | None = None,
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.watermark = watermark_blocks if watermark_blocks is not None else max(1, num_blocks // 100)
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.to_free: list[Sequence] = []  # finished or aborted, still holding blocks in blockd
        self.to_fork: list[Sequence] = []  # choices sampled from their parent's prompt, not yet forked
        self.to_preempt: list[Sequence] = []  # blockd refused their append after all: preempted next step
        self._order = itertools.count()
        self.num_preemptions = 0

    # ----------------------------------------------------------------------------------------- state

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.to_free or self.to_fork or self.to_preempt)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark a sequence done; its blocks go back at the next step (after its last commit)."""
        if seq.status is Status.FINISHED:
            return
        if seq.status is Status.WAITING:
            if seq in self.waiting:
                self.waiting.remove(seq)
        else:
            if seq in self.to_preempt:
                self.to_preempt.remove(seq)
            else:
                self.running.remove(seq)
            if seq in self.to_fork:  # never reached blockd: nothing to free
                self.to_fork.remove(seq)
            else:
                self.to_free.append(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """A choice sampled from its parent's prompt logits: it shares the parent's blocks from the next step."""
        child.status = Status.RUNNING
        child.admitted_order = next(self._order)
        child.fork_parent = parent.seq_id
        self.running.append(child)
        self.to_fork.append(child)

    # ----------------------------------------------------------------------------------------- planning

    def _commit(self, plan: StepPlan, seq: Sequence) -> None:
        if seq.num_computed // self.block_size > seq.committed_tokens // self.block_size:
            plan.add(Purpose.COMMIT, seq, p.Commit(seq.seq_id, seq.num_computed))
            seq.committed_tokens = seq.num_computed

    def _append_need(self, seq: Sequence) -> int:
        """Blocks an append of the sequence's unregistered tokens takes (new blocks, plus a copy-on-write)."""
        table = self.blocks.seqs[seq.fork_parent or seq.seq_id].blocks
        # An unforked child's tail is shared with its parent by the time its append reaches blockd.
        shared = seq.fork_parent is not None or self.blocks.refcount[table[-1]] > 1
        added = len(seq.tokens) - seq.num_registered
        return growth(self.block_size, seq.num_registered, added, len(table), last_block_shared=shared).blocks

    def plan(self) -> StepPlan:
        plan = StepPlan()
        while self.to_preempt:
            self._preempt(plan, self.to_preempt.pop())
        for seq in self.running:
            if seq.fork_parent is None:
                self._commit(plan, seq)
        for seq in self.to_free:
            self._commit(plan, seq)
        for child in self.to_fork:
            plan.add(Purpose.FORK, child, p.Fork(child.fork_parent, child.seq_id))
        for seq in self.to_free:
            plan.add(Purpose.FREE, seq, p.Free(seq.seq_id))
        free = self.blocks.free_blocks + sum(self._releases(s) for s in self.to_free)

        # Appends must all fit: preempt the newest sequences until they do.
        growing = [s for s in self.running if len(s.tokens) > s.num_registered]
        while True:
            need = sum(self._append_need(s) for s in growing)
            if need <= free or not self.running:
                break
            victim = self._victim()
            free += self._releases(victim)
            self._preempt(plan, victim)
            growing = [s for s in growing if s is not victim]
        for seq in growing:
            plan.add(Purpose.APPEND, seq, p.Append(seq.seq_id, pack_tokens(seq.tokens[seq.num_registered :])))
        free -= need

        budget = self.max_num_batched_tokens
        for seq in self.running:
            budget -= min(len(seq.tokens) - seq.num_computed, budget)
        free_slots = self.max_num_seqs - len(self.running)
        pending = self._uncommitted_prefixes() if self.waiting else {}
        for seq in self.waiting:
            if free_slots <= 0 or budget <= 0:
                break
            worst = growth(self.block_size, 0, len(seq.tokens), 0).blocks
            if worst > free - self.watermark:
                break  # first come, first served: nobody overtakes the head of the queue
            request = seq.request
            # A prompt still to be scored for prompt logprobs is computed whole: a cached prefix has no logits.
            reuse = not request.prompt_logprobs_pending
            key = self._prefix_key(seq)
            if reuse and key is not None:
                owner = pending.get(key)
                if owner is not None and self._shared_tokens(seq, owner) > owner.committed_tokens:
                    continue  # its prefix is being computed for another: admitted once that is committed, a hit
                pending.setdefault(key, seq)
            plan.add(Purpose.ADMIT, seq, p.Admit(seq.seq_id, pack_tokens(seq.tokens), request.cache_salt, reuse))
            free -= worst
            free_slots -= 1
            budget -= 1
        return plan

    # Requests that share a prefix often arrive together (one system prompt, n-shot examples), but blockd indexes
    # a block only once it is computed and committed. Admitted in the same step, each would compute (and hold)
    # its own copy of the prefix; so a waiting request whose first full block is in a prompt admitted but not yet
    # committed waits for that commit (a step or two) and is then admitted with the prefix as a cache hit.

    def _prefix_key(self, seq: Sequence) -> tuple[str | None, tuple[int, ...]] | None:
        if len(seq.tokens) <= self.block_size:
            return None  # no full block before the token that is always computed
        return seq.request.cache_salt, tuple(seq.tokens[: self.block_size])

    def _uncommitted_prefixes(self) -> dict[tuple[str | None, tuple[int, ...]], Sequence]:
        """First-block key -> a running sequence whose prompt is not yet all committed to the prefix index."""
        pending: dict[tuple[str | None, tuple[int, ...]], Sequence] = {}
        for seq in self.running:
            if seq.committed_tokens < seq.prompt_len - seq.prompt_len % self.block_size and seq.fork_parent is None:
                key = self._prefix_key(seq)
                if key is not None:
                    pending.setdefault(key, seq)
        return pending

    def _shared_tokens(self, seq: Sequence, owner: Sequence) -> int:
        """Tokens in the full blocks `seq` shares with `owner`'s prompt (at most `seq`'s prompt, less one token)."""
        bs, limit = self.block_size, min(len(seq.tokens) - 1, owner.prompt_len)
        shared = 0
        while shared + bs <= limit and seq.tokens[shared : shared + bs] == owner.tokens[shared : shared + bs]:
            shared += bs
        return shared

    def _releases(self, seq: Sequence) -> int:
        """Blocks that freeing `seq` would return to the pool."""
        if seq.fork_parent is not None:
            return 0
        refcount = self.blocks.refcount
        return sum(1 for b in self.blocks.seqs[seq.seq_id].blocks if refcount[b] == 1)

    def _victim(self) -> Sequence:
        return max(self.running, key=lambda s: s.admitted_order)

    def _preempt(self, plan: StepPlan, seq: Sequence) -> None:
        """Recompute later: release the blocks now, keep the tokens, queue it first."""
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.to_fork:  # never reached blockd
            self.to_fork.remove(seq)
            plan.drop(seq)
            seq.fork_parent = None
        else:
            self._commit(plan, seq)
            plan.add(Purpose.PREEMPT, seq, p.Free(seq.seq_id))
        seq.status = Status.WAITING
        seq.num_computed = seq.num_registered = seq.committed_tokens = 0
        seq.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # ----------------------------------------------------------------------------------------- results

    def apply(self, plan: StepPlan, results: list[p.StepOpResult]) -> StepOutcome:
        """Take in blockd's answers (the pool client has already mirrored the block tables)."""
        outcome = StepOutcome()
        for entry, result in zip(plan.entries, results, strict=True):
            seq = entry.seq
            if type(result) is p.OpError:
                self._refused(entry, result, outcome)
                continue
            match entry.purpose:
                case Purpose.ADMIT:
                    assert type(result) is p.AdmitResult
                    self.waiting.remove(seq)
                    seq.status = Status.RUNNING
                    seq.admitted_order = next(self._order)
                    seq.num_registered = len(seq.tokens)
                    seq.num_computed = seq.committed_tokens = result.num_cached_tokens
                    if seq.preemptions == 0 and seq.index == 0:
                        seq.request.num_cached_tokens = result.num_cached_tokens
                    self.running.append(seq)
                    outcome.admitted.append(seq)
                case Purpose.APPEND:
                    assert type(result) is p.AppendResult
                    outcome.copies.extend(result.copies)
                    seq.num_registered = len(seq.tokens)
                case Purpose.FORK:
                    seq.fork_parent = None
                    self.to_fork.remove(seq)
                case Purpose.FREE:
                    if seq in self.to_free:
                        self.to_free.remove(seq)
                case Purpose.COMMIT | Purpose.PREEMPT:
                    pass  # nothing to take in: the sequence's state already moved when it was planned
        for seq, _error in outcome.failed:
            self.finish(seq, "error")
        return outcome

    def _refused(self, entry: PlannedOp, error: p.OpError, outcome: StepOutcome) -> None:
        """blockd refused an op; nothing of it happened there."""
        out_of_blocks = error.code == ErrorCode.OUT_OF_BLOCKS
        if entry.purpose is Purpose.ADMIT and out_of_blocks:
            return  # out of blocks after all (the estimate was stale): it stays at the head of the queue
        if entry.purpose is Purpose.APPEND and out_of_blocks:
            # The free-block estimate was wrong after all: recompute the sequence later.
            self.running.remove(entry.seq)
            self.to_preempt.append(entry.seq)
            return
        outcome.failed.append((entry.seq, error))

    def schedule(self, outcome: StepOutcome) -> list[Chunk]:
        """Hand out the token budget: decodes first, then prefill chunks in admission order."""
        budget = self.max_num_batched_tokens
        chunks: list[Chunk] = []
        newly = set(map(id, outcome.admitted))
        ordered = [s for s in self.running if id(s) not in newly and s.fork_parent is None]
        ordered.sort(key=lambda s: len(s.tokens) - s.num_computed > 1)  # decodes (one token) first, stable
        for seq in ordered + outcome.admitted:
            if budget <= 0:
                break
            remaining = len(seq.tokens) - seq.num_computed
            take = min(remaining, budget)
            if take <= 0:
                continue
            chunks.append(Chunk(seq, seq.num_computed, seq.tokens[seq.num_computed : seq.num_computed + take]))
            budget -= take
        return chunks
