"""Continuous batching: which sequences run each step, with how many tokens, and what blockd must do first.

`plan()` / `plan_ahead()` write a step's blockd ops (`StepPlan`), `apply()` takes in blockd's answers, and
`schedule()` hands out the token budget as chunks. It keeps no block ledger: free blocks and who holds what come
from the pool client's mirror of blockd. The design (op order, registration a block at a time, steps without a
round trip, plans made ahead) is in docs/architecture.md, "A step".
"""

from __future__ import annotations

import enum
import itertools
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from blockd import protocol as p
from blockd.block_rule import dead_blocks, growth, reservable, shared_blocks, to_block_end, trimmed_blocks
from blockd.client import MirroredSequence
from blockd.errors import ErrorCode
from blockd.pool import HOLE, group_suffix
from blockd.tiers import TierOp
from common.tokens import TOKEN_BYTES, pack_tokens
from executor.sequence import Sequence, Status
from executor.step_budget import StepBudget


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
    # Speculative decoding: tokens proposed to follow, computed as more query positions of the same pass into
    # slots blockd holds reserved, and verified from their logits (executor/speculative.py). Only on a decode.
    draft: list[int] = field(default_factory=list)

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
    SLIDE = "slide"  # blocks past every query's sliding window go back
    FORK = "fork"  # a new choice starts sharing its parent's blocks
    FREE = "free"  # finished or aborted: its blocks go back
    TRIM = "trim"  # short of blocks: speculation's spare reserved room goes back
    PREEMPT = "preempt"  # its blocks go back; it is already queued again, to be recomputed
    APPEND = "append"  # register tokens, and reserve room for the next ones
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
    tier_ops: list[TierOp] = field(default_factory=list)  # saves and loads (blockd.tiers), before everything else


#: Steps in a row that may go without a round trip while commits or frees wait.
QUIET_STEPS = 16


def window_blocks(block_size: int, window: int) -> int:
    """Most blocks one decoding sequence of a sliding-window pool holds: its window's, the block its slides lag
    by (they count committed tokens, a commit is due a block at a time and may wait QUIET_STEPS steps), and its
    open block's room reserved past it (blockd.block_rule.reservable)."""
    return -(-(window + QUIET_STEPS) // block_size) + 4


def longest_sequence(room: int, block_size: int, windows: list[int | None], max_model_len: int, ahead: int = 0) -> int:
    """The most tokens one sequence can hold alone in `room` blocks, its tables' windows `windows` (one per layer
    group): a global table takes a block per `block_size` tokens, a sliding one only its window's blocks (and
    `ahead` tokens more: a prompt's step held past what is computed), so with no global table it is limited by
    the model alone."""
    full = sum(1 for w in windows if w is None)
    sliding = [w for w in windows if w is not None]
    held = sum(window_blocks(block_size, w + ahead) for w in sliding)
    if sliding and held <= room:
        return max(max_model_len, room * block_size) if not full else (room - held) // full * block_size
    return room // len(windows) * block_size


class Scheduler:
    """The waiting queue, the running batch and each step's plan. `blocks` (the pool client's mirror) changes
    only when a step's answers arrive, before `apply`."""

    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        blocks: BlockView,
        watermark_blocks: int | None = None,
        sliding_window: int | None = None,
        groups: tuple[bool, ...] = (),
        max_step_ms: float | None = None,
        policy: str = "fcfs",
    ) -> None:
        self.block_size = block_size
        # "fcfs": the waiting queue in arrival order, the newest admitted preempted first; "priority" (vLLM's):
        # ordered by (priority, arrival), the worst of those preempted first, also to admit a better one.
        self.policy = policy
        self.sliding_window = sliding_window  # the pool's: blocks no query of a sliding table reads any more go back
        # Layer groups (executor.layer_groups): every sequence has a table per group, and every op is for all of
        # them (blockd applies it to each); its growth is summed over them, and only sliding groups' tables slide.
        self.windows = [sliding_window if slides else None for slides in groups] or [sliding_window]
        self.suffixes = [group_suffix(g) for g in range(len(self.windows))]
        self.num_blocks = num_blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # The token budget of a step, sized by its measured cost to last about max_step_ms (None: the cap alone).
        # At least every decode and a block of prefill, so that waiting requests are admitted however slow a step.
        self.step_budget = StepBudget(max_num_batched_tokens, max_step_ms, min_tokens=max_num_seqs + block_size)
        self.step_tokens = max_num_batched_tokens  # the budget of the step planned last (its plan and chunks)
        self.watermark = watermark_blocks if watermark_blocks is not None else max(1, num_blocks // 100)
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.to_free: list[Sequence] = []  # finished or aborted, still holding blocks in blockd
        self.to_fork: list[Sequence] = []  # choices sampled from their parent's prompt, not yet forked
        self.to_preempt: list[Sequence] = []  # blockd refused their append after all: preempted next step
        self._order = itertools.count()
        self.num_preemptions = 0
        self.arrived = False  # a sequence was added since admissions were last planned
        self.quiet_steps = 0  # steps planned in a row without a round trip
        self._computed: dict[int, int] = {}  # while a plan is made ahead: tokens computed once the step running ends
        self._slid: dict[str, int] = {}  # tables this plan slides -> the leading blocks they hand back
        # Speculative decoding: room a decoding sequence keeps held past its next token (its next draft's).
        self.lookahead = 0

    # ----------------------------------------------------------------------------------------- state

    def add(self, seq: Sequence) -> None:
        if self.policy == "priority":
            self._queue_by_priority(seq)
        else:
            self.waiting.append(seq)
        self.arrived = True

    @staticmethod
    def _rank(seq: Sequence) -> tuple[int, float]:
        """Under the priority policy, who goes first (and who is preempted last): lower is sooner."""
        return seq.params.priority, seq.request.arrival_s

    def _queue_by_priority(self, seq: Sequence) -> None:
        """Into the waiting queue behind every sequence ranked as well or better (a preempted one among equals
        first, as fcfs queues it)."""
        rank = self._rank(seq)
        at = next((i for i, other in enumerate(self.waiting) if self._rank(other) > rank), len(self.waiting))
        if seq.preemptions:
            at = next((i for i, other in enumerate(self.waiting) if self._rank(other) >= rank), at)
        self.waiting.insert(at, seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.to_free or self.to_fork or self.to_preempt)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark a sequence done; its blocks go back at the next step (after its last commit)."""
        if seq.status is Status.FINISHED:
            return
        self._stop_loading(seq)
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

    @staticmethod
    def _stop_loading(seq: Sequence) -> None:
        """Its blocks go back while loads are landing in them: those loads are abandoned (their tickets are no
        longer any running sequence's: executor.tier_store.TierStore.land throws their bytes away), and it counts
        as computed only what it had from the device, so no registration or commit covers the rest."""
        if seq.loading:
            seq.loading.clear()
            seq.num_computed = seq.committed_tokens

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """A choice sampled from its parent's prompt logits: it shares the parent's blocks from the next step."""
        child.status = Status.RUNNING
        child.admitted_order = next(self._order)
        child.fork_parent = parent.seq_id
        self.running.append(child)
        self.to_fork.append(child)

    def registered(self, seq: Sequence) -> int:
        """Tokens of the sequence blockd holds (registered), as of the last step's answers: the mirror's. A choice
        not forked yet counts its parent's, which it will share; a sequence blockd does not hold, 0."""
        mirrored = self.blocks.seqs.get(seq.fork_parent or seq.seq_id)
        return 0 if mirrored is None else len(mirrored.tokens) // TOKEN_BYTES

    # ----------------------------------------------------------------------------------------- planning

    def _commit_due(self, seq: Sequence, registered: int | None = None) -> int | None:
        """The tokens a commit would cover, if that fills a block past the last commit; else None (always while
        lower-tier loads are landing in its blocks: the prefix index must not offer them before they are there)."""
        if seq.loading:
            return None
        # Tokens computed into reserved slots are not registered yet: blockd can hash only registered tokens.
        done = min(seq.num_computed, self.registered(seq) if registered is None else registered)
        return done if done // self.block_size > seq.committed_tokens // self.block_size else None

    def _commit(self, plan: StepPlan, seq: Sequence, registered: int | None = None) -> None:
        done = self._commit_due(seq, registered)
        if done is not None:
            plan.add(Purpose.COMMIT, seq, p.Commit(seq.seq_id, done))
            seq.committed_tokens = done

    def _tables(self, seq_id: str) -> list[tuple[str, MirroredSequence]]:
        """The sequence's tables, one per layer group, with their ids."""
        seqs = self.blocks.seqs
        return [(seq_id + suffix, seqs[seq_id + suffix]) for suffix in self.suffixes]

    def _slide(self, plan: StepPlan, seq: Sequence) -> int:
        """After its commit: hand back the blocks no query of the sequence reads any more (its sliding groups'
        tables); returns how many go back to the pool. Counted from its committed tokens (computed and
        registered), so every block handed back is in the prefix index first."""
        done = seq.committed_tokens
        dying: list[tuple[str, MirroredSequence, int]] = []
        for (table_id, mirrored), window in zip(self._tables(seq.seq_id), self.windows, strict=True):
            dead = dead_blocks(self.block_size, window, done)
            if dead > mirrored.holes:
                dying.append((table_id, mirrored, dead))
        if not dying:
            return 0
        plan.add(Purpose.SLIDE, seq, p.Slide(seq.seq_id, done))
        for table_id, _, dead in dying:
            self._slid[table_id] = dead
        if any(child.fork_parent == seq.seq_id for child in self.to_fork):
            return 0  # a choice forked from it first (forks go first) holds them on
        refcount = self.blocks.refcount
        return sum(1 for _, m, dead in dying for b in m.blocks[m.holes : dead] if refcount[b] == 1)

    def _register_computed(self, plan: StepPlan, seq: Sequence) -> None:
        """Before a sequence's blocks go back: register its computed tokens that fill a block, and commit, so
        that its full blocks stay prefix hits. They lie in its reserved slots: no block is taken."""
        registered = self.registered(seq)
        if seq.num_computed // self.block_size > registered // self.block_size:
            tokens = pack_tokens(seq.tokens[registered : seq.num_computed])
            plan.add(Purpose.APPEND, seq, p.Append(seq.seq_id, tokens))
            registered = seq.num_computed
        self._commit(plan, seq, registered)

    def _held(self, seq: Sequence) -> int:
        """Token slots blockd holds for the sequence: registered or reserved."""
        return self.registered(seq) + self.blocks.seqs[seq.fork_parent or seq.seq_id].reserved

    def _hold_end(self, seq: Sequence) -> int:
        """How far an append holds the sequence's tokens: every token known; with a sliding window, a prompt only
        through what the next step can compute of it, so that its later blocks are taken as its prefill reaches
        them while the earlier ones slide out."""
        if self.sliding_window is None:
            return len(seq.tokens)
        reach = self._computed.get(id(seq), seq.num_computed) + self.max_num_batched_tokens
        return max(min(len(seq.tokens), reach), self.registered(seq))

    def _room_left(self, seq: Sequence, sampling: set[int]) -> int:
        """Token slots blockd holds for the sequence (registered or reserved) past its known tokens and the one it
        is sampling (a prompt held in part: past what the next step can compute of it): below 0, the next step's
        tokens do not fit."""
        end = self._hold_end(seq)
        if end < len(seq.tokens):
            return self._held(seq) - end
        return self._held(seq) - len(seq.tokens) - (id(seq) in sampling)

    def _append_need(self, seq: Sequence, reserve: int, forking: set[str]) -> int:
        """Blocks the sequence's append takes (new blocks, plus a copy-on-write): it registers every token known
        and keeps `reserve` slots reserved past them. `forking`: parents of the choices forked in this plan."""
        bs = self.block_size
        n = self.registered(seq)
        end = self._hold_end(seq)
        if seq.fork_parent is not None:  # not forked yet: it will hold its parent's blocks of its tokens, shared
            need = growth(bs, n, end - n, shared_blocks(bs, n), open_block_shared=True, reserve=reserve).blocks
            return need * len(self.suffixes)
        need = 0
        for _, mirrored in self._tables(seq.seq_id):
            table, reserved = len(mirrored.blocks), mirrored.reserved
            shared = n % bs != 0 and (self.blocks.refcount[mirrored.blocks[n // bs]] > 1 or seq.seq_id in forking)
            need += growth(bs, n, end - n, table, open_block_shared=shared, reserved=reserved, reserve=reserve).blocks
        return need

    def _reserve(self, seq: Sequence, wide: bool) -> int:
        """Slots an append keeps reserved past the sequence's known tokens: to the end of the block after the
        next token's (`wide`), or only to the end of the next token's block when blocks run short; none for a
        prompt held in part."""
        if self._hold_end(seq) < len(seq.tokens):
            return 0
        return (reservable if wide else to_block_end)(self.block_size, len(seq.tokens))

    def plan(self) -> StepPlan:
        """The next step's ops, with every sampled token known."""
        plan = self._plan(None)
        assert plan is not None
        return plan

    def plan_ahead(self, chunks: list[Chunk]) -> StepPlan | None:
        """The next step's ops while `chunks` still run (docs/architecture.md, "A step"); None if that plan would need
        a preemption."""
        if self.to_preempt or self._priority_preemption_due():
            return None
        return self._plan(chunks)

    def _priority_preemption_due(self) -> bool:
        """Under the priority policy: the head of the queue does not fit and a worse-ranked sequence runs (so the
        plan that preempts it is made after sampling, as every preemption is)."""
        if self.policy != "priority" or not self.waiting:
            return False
        head = self.waiting[0]
        if growth(self.block_size, 0, len(head.tokens), 0).blocks <= self.blocks.free_blocks - self.watermark:
            return False
        return any(s.params.priority > head.params.priority for s in self.running)

    def observe_step(self, tokens: int, seconds: float) -> None:
        """A step computed `tokens` tokens in `seconds`: what the budget of the steps planned after it is sized by."""
        self.step_budget.observe(tokens, seconds)

    def _plan(self, ahead: list[Chunk] | None) -> StepPlan | None:
        plan = StepPlan()
        self.step_tokens = self.step_budget.tokens()  # fixed for this step: its admissions and its chunks
        # A sequence sampling in the step now running (a plan made ahead) needs room for one more token, not
        # known yet.
        sampling = set() if ahead is None else {id(c.seq) for c in ahead if c.samples}
        computed = {} if ahead is None else {id(c.seq): c.start + len(c.token_ids) for c in ahead}
        self._computed = computed  # (tokens computed once the step now running ends, where it runs them)
        self._slid = {}
        self._trimmed: dict[str, int] = {}  # sequences this plan trims -> the tail blocks they hand back
        # Room for every token the next step computes. Most decode steps fit in the slots reserved before; where
        # they do not, an append registers the tokens known and reserves room past them.
        growing = [s for s in self.running if self._needs_room(s, sampling)]
        if self._quiet(growing):
            self.quiet_steps += 1
            return plan
        self.quiet_steps = 0
        # Forks first: a new choice starts from its parent's prompt, before any op registers the parent's
        # tokens past it.
        for child in self.to_fork:
            plan.add(Purpose.FORK, child, p.Fork(child.fork_parent, child.seq_id))
        while self.to_preempt:
            self._preempt(plan, self.to_preempt.pop())
        slid = 0
        for seq in self.running:
            if seq.fork_parent is None:
                self._commit(plan, seq)
                if self.sliding_window is not None:
                    slid += self._slide(plan, seq)
        for seq in self.to_free:
            self._register_computed(plan, seq)
        for seq in self.to_free:
            plan.add(Purpose.FREE, seq, p.Free(seq.seq_id))
        free = self.blocks.free_blocks + slid + sum(self._releases(s) for s in self.to_free)

        forking = {child.fork_parent for child in self.to_fork if child.fork_parent is not None}
        wide = True
        while True:
            need = sum(self._append_need(s, self._reserve(s, wide), forking) for s in growing)
            if need <= free or not self.running:
                break
            if wide:
                wide = False  # short of blocks: reserve less before preempting anyone
                if ahead is None:  # (nothing is being computed into reserved slots now)
                    free += self._trim_room(plan, growing)
                continue
            if ahead is not None:
                return None  # preempting a sequence while it runs: left to the plan made after sampling
            victim = self._victim()
            free += self._releases(victim)
            self._preempt(plan, victim)
            growing = [s for s in growing if s is not victim]
        for seq in growing:
            self._append(plan, seq, self._reserve(seq, wide))
        free -= need

        # The token budget left once the running sequences have what they still need after this step.
        budget = self.step_tokens
        for seq in self.running:
            left = len(seq.tokens) + (id(seq) in sampling) - computed.get(id(seq), seq.num_computed)
            budget -= min(left, budget)
        free = self._admit(plan, free, budget, preempt=ahead is None)
        if wide and plan.entries:
            self._renew(plan, free, growing, sampling, forking)
        return plan

    def _trim_room(self, plan: StepPlan, growing: list[Sequence]) -> int:
        """Speculative decoding's spare room goes back before anyone is preempted: each decoding sequence keeps
        its reserved slots through the block of its last known token, and blockd's `trim` hands back the blocks
        past them (block_rule.trimmed_blocks: reserved slots only, where rejected drafts were computed). Returns
        the blocks that go back."""
        if not self.lookahead:
            return 0
        grown = set(map(id, growing))
        bs = self.block_size
        released = 0
        for seq in self.running:
            if id(seq) in grown or seq.fork_parent is not None:
                continue
            mirrored = self.blocks.seqs[seq.seq_id]
            n = len(mirrored.tokens) // TOKEN_BYTES
            keep = min(mirrored.reserved, max(-(-len(seq.tokens) // bs) * bs - n, 0))
            count = trimmed_blocks(bs, n, keep, len(mirrored.blocks))
            if count:
                plan.add(Purpose.TRIM, seq, p.Trim(seq.seq_id, keep))
                self._trimmed[seq.seq_id] = count
                released += count
        return released

    def _needs_room(self, seq: Sequence, sampling: set[int]) -> bool:
        """Whether the sequence must append before the next step: its tokens (and the one it is sampling) do not
        fit in the room blockd holds for it, or it is a new choice, whose first token must not be written into
        the block it shares with its parent."""
        lookahead = self.lookahead if seq.num_generated > 0 else 0
        return seq.fork_parent is not None or self._room_left(seq, sampling) < lookahead

    def _quiet(self, growing: list[Sequence]) -> bool:
        """Whether the next step can go without a round trip (docs/architecture.md, "A step"). `growing`: the
        sequences that must append first (new choices among them)."""
        if growing or self.to_preempt or not self.running:
            return False  # (with nothing running, finished sequences' blocks go back now)
        if self.waiting and len(self.running) < self.max_num_seqs:
            return False  # an admission, and the frees and commits before it
        bs = self.block_size
        waiting_ops = bool(self.to_free)
        for seq in self.running:
            if self._commit_due(seq) is not None:
                if seq.committed_tokens < seq.prompt_len - seq.prompt_len % bs:
                    return False  # a prompt's blocks: new requests, and the gateway's routing, look for them now
                waiting_ops = True
        return not (waiting_ops and self.quiet_steps >= QUIET_STEPS)

    def _append(self, plan: StepPlan, seq: Sequence, reserve: int) -> None:
        tokens = pack_tokens(seq.tokens[self.registered(seq) : self._hold_end(seq)])
        plan.add(Purpose.APPEND, seq, p.Append(seq.seq_id, tokens, reserve))

    def _renew(self, plan: StepPlan, free: int, growing: list[Sequence], sampling: set[int], forking: set[str]) -> None:
        """In a round trip that goes anyway, renew the running sequences with less than a block of room left,
        while blocks stay above the watermark."""
        grown = set(map(id, growing))
        for seq in self.running:
            if id(seq) in grown:
                continue
            if self._room_left(seq, sampling) >= self.block_size:
                continue
            reserve = self._reserve(seq, True)
            need = self._append_need(seq, reserve, forking)
            if need > free - self.watermark:
                break
            self._append(plan, seq, reserve)
            free -= need

    def plan_arrivals(self) -> StepPlan:
        """Admits alone, for requests that arrived after the step now starting was planned ahead: sent before
        it is scheduled, they join this step instead of the next. The running sequences' room is held already."""
        plan = StepPlan()
        budget = self.step_tokens
        for seq in self.running:
            budget -= min(len(seq.tokens) - seq.num_computed, budget)
        self._admit(plan, self.blocks.free_blocks, budget)
        return plan

    def _admit(self, plan: StepPlan, free: int, budget: int, preempt: bool = False) -> int:
        """Admits for the waiting sequences, in queue order, while blocks (`free`, above the watermark), sequence
        slots and the token budget allow; returns the blocks still free after them (worst case). With `preempt`
        under the priority policy, running sequences of a worse priority are preempted to make room."""
        self.arrived = False
        free_slots = self.max_num_seqs - len(self.running)
        pending = self._uncommitted_prefixes() if self.waiting else {}
        for seq in list(self.waiting):  # (a preemption below queues its victim behind `seq`)
            if free_slots <= 0 or budget <= 0:
                break
            hold = None
            whole = growth(self.block_size, 0, len(seq.tokens), 0).blocks
            worst = whole * len(self.windows)
            if worst > free - self.watermark and self.sliding_window is not None:
                # A window: its prompt is held a step's tokens past its cached prefix at first, the later blocks
                # taken as its prefill reaches them (`_hold_end`).
                hold = self.max_num_batched_tokens
                # Fresh blocks for those tokens, and the cached-free blocks a hit takes back from the free queue:
                # for a sliding table at most those the first query past the hit reads (blockd.pool's
                # valid_prefix_lengths), for a global one its whole prompt's.
                reclaimed = max(1, -(-(self.sliding_window - 1) // self.block_size))
                held = growth(self.block_size, 0, min(len(seq.tokens), hold), 0).blocks
                worst = sum(held + reclaimed if w is not None else whole for w in self.windows)
            if worst > free - self.watermark and preempt and self.policy == "priority":
                while worst > free - self.watermark:
                    worse = [s for s in self.running if s.params.priority > seq.params.priority]
                    if not worse:
                        break
                    victim = max(worse, key=lambda s: (*self._rank(s), s.admitted_order))
                    free += self._releases(victim)
                    self._preempt(plan, victim)
                    free_slots += 1
            if worst > free - self.watermark:
                break  # nobody overtakes the head of the queue
            request = seq.request
            # A prompt still to be scored for prompt logprobs is computed whole: a cached prefix has no logits.
            reuse = not request.prompt_logprobs_pending
            key = self._prefix_key(seq)
            if reuse and key is not None:
                owner = pending.get(key)
                if owner is not None and self._shared_tokens(seq, owner) > owner.committed_tokens:
                    continue  # its prefix is being computed for another: admitted once that is committed, a hit
                pending.setdefault(key, seq)
            admit = p.Admit(seq.seq_id, pack_tokens(seq.tokens), request.cache_salt, reuse, hold)
            plan.add(Purpose.ADMIT, seq, admit)
            free -= worst
            free_slots -= 1
            budget -= 1
        return free

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
        if any(child.fork_parent == seq.seq_id for child in self.to_fork):
            return 0  # a choice forked from it in the same step (forks go first) holds every block it had
        refcount = self.blocks.refcount
        trimmed = self._trimmed.get(seq.seq_id, 0)  # (a trim counted those: speculation has one layer group)
        return sum(
            1
            for table_id, mirrored in self._tables(seq.seq_id)
            for b in mirrored.blocks[self._slid.get(table_id, 0) : len(mirrored.blocks) - trimmed]  # (a slide too)
            if b != HOLE and refcount[b] == 1
        )

    def _victim(self) -> Sequence:
        if self.policy == "priority":
            return max(self.running, key=lambda s: (*self._rank(s), s.admitted_order))
        return max(self.running, key=lambda s: s.admitted_order)

    def _preempt(self, plan: StepPlan, seq: Sequence) -> None:
        """Recompute later: release the blocks now, keep the tokens, queue it first."""
        self._stop_loading(seq)
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.to_fork:  # never reached blockd
            self.to_fork.remove(seq)
            plan.drop(seq)
            seq.fork_parent = None
        else:
            self._register_computed(plan, seq)
            plan.add(Purpose.PREEMPT, seq, p.Free(seq.seq_id))
        seq.status = Status.WAITING
        seq.num_computed = seq.committed_tokens = 0
        seq.preemptions += 1
        self.num_preemptions += 1
        if self.policy == "priority":
            self._queue_by_priority(seq)
        else:
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
                    seq.num_computed = result.num_cached_tokens
                    # Blocks loaded from a lower tier are not in the index yet: the next commit enters them.
                    seq.committed_tokens = result.num_cached_tokens - result.loaded_tokens
                    outcome.tier_ops.extend(result.tier_ops)
                    if seq.preemptions == 0 and seq.index == 0:
                        seq.request.num_cached_tokens = result.num_cached_tokens
                    self.running.append(seq)
                    outcome.admitted.append(seq)
                case Purpose.APPEND:
                    assert type(result) is p.AppendResult
                    outcome.copies.extend(result.copies)
                    outcome.tier_ops.extend(result.tier_ops)
                    for group in result.groups:  # (layer groups: every table's copies, into the same pairs)
                        outcome.copies.extend(group.copies)
                case Purpose.FORK:
                    seq.fork_parent = None
                    self.to_fork.remove(seq)
                case Purpose.FREE:
                    if seq in self.to_free:
                        self.to_free.remove(seq)
                case Purpose.COMMIT:
                    assert type(result) is p.CommitResult
                    outcome.tier_ops.extend(result.tier_ops)  # writes to the shared tier (blockd.tiers)
                case Purpose.SLIDE | Purpose.PREEMPT | Purpose.TRIM:
                    pass  # nothing to take in: the sequence's state already moved when it was planned
        for seq, _error in outcome.failed:
            self.finish(seq, "error")
        return outcome

    def _refused(self, entry: PlannedOp, error: p.OpError, outcome: StepOutcome) -> None:
        """blockd refused an op; nothing of it happened there."""
        out_of_blocks = error.code == ErrorCode.OUT_OF_BLOCKS
        if entry.purpose is Purpose.TRIM:
            return  # the room stays held: nothing changed
        if entry.purpose is Purpose.ADMIT and out_of_blocks:
            return  # out of blocks after all (the estimate was stale): it stays at the head of the queue
        if entry.seq.status is not Status.RUNNING and entry.purpose is not Purpose.ADMIT:
            # Its blocks go back in this step (finished, aborted, preempted): a registration or a commit refused
            # costs a prefix-index entry at most, and a refused free leaves nothing to free again.
            if entry.purpose is Purpose.FREE and entry.seq in self.to_free:
                self.to_free.remove(entry.seq)
            return
        if entry.purpose is Purpose.APPEND and out_of_blocks:
            # The free-block estimate was wrong after all: recompute the sequence later.
            self.running.remove(entry.seq)
            self.to_preempt.append(entry.seq)
            return
        outcome.failed.append((entry.seq, error))

    def schedule(self, outcome: StepOutcome) -> list[Chunk]:
        """Hand out the step's token budget: decodes first, then prefill chunks in admission order."""
        budget = self.step_tokens
        chunks: list[Chunk] = []
        newly = set(map(id, outcome.admitted))
        ordered = [s for s in self.running if id(s) not in newly and s.fork_parent is None]
        ordered.sort(key=lambda s: len(s.tokens) - s.num_computed > 1)  # decodes (one token) first, stable
        admitted = [s for s in outcome.admitted if s.status is Status.RUNNING]  # (not aborted since)
        for seq in ordered + admitted:
            if budget <= 0:
                break
            if seq.loading:
                continue  # its loads land first (StepLoop._land_loads)
            remaining = len(seq.tokens) - seq.num_computed
            if self.sliding_window is not None:  # a prompt may be held in part (`_hold_end`)
                remaining = min(remaining, self._held(seq) - seq.num_computed)
            take = min(remaining, budget)
            if take <= 0:
                continue
            chunks.append(Chunk(seq, seq.num_computed, seq.tokens[seq.num_computed : seq.num_computed + take]))
            budget -= take
            if remaining == 1 and self.lookahead:  # a decode's draft is budgeted with it, before any prefill
                budget -= min(self.lookahead - 1, budget)
        return chunks
