"""Continuous batching: which sequences run this step, with how many tokens, and what blockd must do first.

A step is planned in two halves around its one blockd round trip:

`plan()` writes the step's blockd ops, in an order that makes every op valid when blockd reaches it:
commits (computed blocks into the prefix index), forks (n > 1 choices), frees (finished, aborted, preempted),
appends (room for each decoding sequence's last sampled token), admits (waiting sequences, oldest first).
This executor is the pool's only user, so it knows exactly how many blocks are free (`BlockLedger`); appends
are planned to fit, preempting the most recently admitted sequences (recompute: they go back to the head of the
queue) until they do, so an append never fails. Admits are tried only while their worst case (no prefix hit)
fits above a small watermark; blockd answers with what was actually cached.

`schedule()` then hands out the token budget: one token to every decoding sequence, then prefill chunks to
the others in admission order (chunked prefill), newly admitted ones last.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from blockd import protocol as p
from blockd.client import MirroredSequence
from blockd.errors import ErrorCode
from common.tokens import pack_tokens
from executor.sequence import Sequence, Status


class BlockLedger:
    """How many live sequences hold each block; the rest of the pool is free (cached or not)."""

    def __init__(self, num_blocks: int) -> None:
        self.refs = [0] * num_blocks
        self.in_use = 0

    @property
    def free(self) -> int:
        return len(self.refs) - self.in_use

    def hold(self, blocks: list[int] | tuple[int, ...]) -> None:
        refs = self.refs
        for b in blocks:
            if refs[b] == 0:
                self.in_use += 1
            refs[b] += 1

    def release(self, blocks: list[int] | tuple[int, ...]) -> int:
        """Drop one reference from each; returns how many became free."""
        refs, freed = self.refs, 0
        for b in blocks:
            refs[b] -= 1
            if refs[b] == 0:
                freed += 1
        self.in_use -= freed
        return freed


@dataclass
class Chunk:
    """Tokens [start, start + len(token_ids)) of one sequence, computed this step."""

    seq: Sequence
    start: int
    token_ids: list[int]

    @property
    def samples(self) -> bool:  # the chunk reaches the sequence's end, so its last row's logits are sampled
        return self.start + len(self.token_ids) == len(self.seq.tokens)


@dataclass
class StepPlan:
    ops: list[p.StepOp] = field(default_factory=list)
    #: what each op is for, op by op: ("commit"|"fork"|"free"|"append"|"admit", sequence)
    purposes: list[tuple[str, Sequence]] = field(default_factory=list)
    released_tables: dict[str, list[int]] = field(default_factory=dict)  # block tables of the freed, as planned
    forked_tables: dict[str, list[int]] = field(default_factory=dict)  # a fork's parent's table, as planned

    def add(self, purpose: str, seq: Sequence, op: p.StepOp) -> None:
        self.ops.append(op)
        self.purposes.append((purpose, seq))


@dataclass
class StepOutcome:
    admitted: list[Sequence] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst) before attention
    failed: list[tuple[Sequence, p.OpError]] = field(default_factory=list)  # ops blockd refused (not admits)


class Scheduler:
    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        tables: Mapping[str, MirroredSequence],
        watermark_blocks: int | None = None,
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.watermark = watermark_blocks if watermark_blocks is not None else max(1, num_blocks // 100)
        self.ledger = BlockLedger(num_blocks)
        self.tables = tables  # blockd's view of every live sequence, as the pool client mirrors it
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

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

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
            plan.add("commit", seq, p.Commit(seq.seq_id, seq.num_computed))
            seq.committed_tokens = seq.num_computed

    def _append_need(self, seq: Sequence) -> int:
        """Blocks an append of the sequence's unregistered tokens takes (new blocks, plus a copy-on-write)."""
        table = self.tables[seq.fork_parent or seq.seq_id].blocks
        new = self.blocks_needed(len(seq.tokens)) - len(table)
        shared_tail = seq.num_registered % self.block_size != 0 and (
            seq.fork_parent is not None or self.ledger.refs[table[-1]] > 1
        )
        return max(new, 0) + shared_tail

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
            plan.add("fork", child, p.Fork(child.fork_parent, child.seq_id))
            plan.forked_tables[child.seq_id] = list(self.tables[child.fork_parent].blocks)
        for seq in self.to_free:
            self._free(plan, seq)
        free = self.ledger.free + sum(self._releases(s) for s in self.to_free)

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
            plan.add("append", seq, p.Append(seq.seq_id, pack_tokens(seq.tokens[seq.num_registered :])))
        free -= need

        budget = self.max_num_batched_tokens
        for seq in self.running:
            budget -= min(len(seq.tokens) - seq.num_computed, budget)
        free_slots = self.max_num_seqs - len(self.running)
        for seq in self.waiting:
            if free_slots <= 0 or budget <= 0:
                break
            worst = self.blocks_needed(len(seq.tokens))
            if worst > free - self.watermark:
                break  # first come, first served: nobody overtakes the head of the queue
            plan.add("admit", seq, p.Admit(seq.seq_id, pack_tokens(seq.tokens), seq.request.cache_salt))
            free -= worst
            free_slots -= 1
            budget -= 1
        return plan

    def _releases(self, seq: Sequence) -> int:
        """Blocks that freeing `seq` would return to the pool."""
        if seq.fork_parent is not None:
            return 0
        refs = self.ledger.refs
        return sum(1 for b in self.tables[seq.seq_id].blocks if refs[b] == 1)

    def _victim(self) -> Sequence:
        return max(self.running, key=lambda s: s.admitted_order)

    def _preempt(self, plan: StepPlan, seq: Sequence) -> None:
        """Recompute later: release the blocks now, keep the tokens, queue it first."""
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.to_fork:  # never reached blockd
            self.to_fork.remove(seq)
            plan.ops = [op for op in plan.ops if not (type(op) is p.Fork and op.child_id == seq.seq_id)]
            plan.purposes = [(k, s) for k, s in plan.purposes if s is not seq]
            seq.fork_parent = None
        else:
            self._commit(plan, seq)
            self._free(plan, seq)
        seq.status = Status.WAITING
        seq.num_computed = seq.num_registered = seq.committed_tokens = 0
        seq.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _free(self, plan: StepPlan, seq: Sequence) -> None:
        plan.add("free", seq, p.Free(seq.seq_id))
        plan.released_tables[seq.seq_id] = list(self.tables[seq.seq_id].blocks)

    # ----------------------------------------------------------------------------------------- results

    def apply(self, plan: StepPlan, results: list[p.StepOpResult]) -> StepOutcome:
        """Take in blockd's answers (the pool client has already mirrored the block tables)."""
        outcome = StepOutcome()
        for (purpose, seq), _op, result in zip(plan.purposes, plan.ops, results, strict=True):
            failed = type(result) is p.OpError
            if purpose == "admit":
                if failed:  # out of blocks after all (the estimate was stale): it stays at the head of the queue
                    if result.code != ErrorCode.OUT_OF_BLOCKS:
                        outcome.failed.append((seq, result))
                    continue
                self.waiting.remove(seq)
                seq.status = Status.RUNNING
                seq.admitted_order = next(self._order)
                seq.num_registered = len(seq.tokens)
                seq.num_computed = seq.committed_tokens = result.num_cached_tokens
                if seq.preemptions == 0 and seq.index == 0:
                    seq.request.num_cached_tokens = result.num_cached_tokens
                self.ledger.hold(result.blocks)
                self.running.append(seq)
                outcome.admitted.append(seq)
            elif failed and purpose == "append" and result.code == ErrorCode.OUT_OF_BLOCKS:
                # The free-block estimate was wrong after all: nothing changed in blockd; recompute it later.
                self.running.remove(seq)
                self.to_preempt.append(seq)
            elif failed:
                outcome.failed.append((seq, result))
            elif purpose == "fork":
                self.ledger.hold(plan.forked_tables[seq.seq_id])  # the mirror already shows later appends
                seq.fork_parent = None
                self.to_fork.remove(seq)
            elif purpose == "free":
                self.ledger.release(plan.released_tables[seq.seq_id])
                if seq in self.to_free:
                    self.to_free.remove(seq)
            elif purpose == "append":
                for src, dst in result.copies:
                    self.ledger.release([src])
                    self.ledger.hold([dst])
                    outcome.copies.append((src, dst))
                self.ledger.hold(result.blocks)
                seq.num_registered = len(seq.tokens)
        for seq, _error in outcome.failed:
            self.finish(seq, "error")
        return outcome

    def schedule(self, plan: StepPlan, outcome: StepOutcome) -> list[Chunk]:
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
