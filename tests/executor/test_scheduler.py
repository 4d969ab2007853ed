"""The scheduler, run by the engine's own step loop against blockd's BlockManager in this process: no model.

`FakeModel` is the model half of a step without a model: every scheduled chunk counts as computed, and each
sampling sequence draws a made-up token. `pipelined=True` runs the loop as the engine does (the next step planned
ahead and sent before the chunks are computed); `False` plans every step after sampling. After every step
blockd's pool passes its invariant check, and whenever a step's answers are in, the pool client's mirror counts
exactly blockd's refcounts. Every slot a chunk writes is checked: never in a block the prefix index names, never
one another live sequence reads; every append sent continues the tokens blockd holds with the sequence's own.
"""

from __future__ import annotations

import os
import random
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import pytest

from blockd import protocol as p
from blockd.client import MirroredSequence, PoolClient
from blockd.inprocess import InProcessBlockd
from blockd.pool import BlockPool
from common.tokens import unpack_tokens
from executor.params import SamplingParams
from executor.scheduler import QUIET_STEPS, Chunk, Purpose, Scheduler, StepOutcome, StepPlan
from executor.sequence import Request, Sequence, Status
from executor.step_loop import Draw, StepLoop, StepReport

POOL = "pool"
#: Random workloads per mode; PAGEDKV_SCHEDULER_SEEDS=3000 for a long soak (3,000 passed in both modes).
RANDOM_SEEDS = int(os.environ.get("PAGEDKV_SCHEDULER_SEEDS", "12"))
STOP = 0  # the stop token (made-up tokens are 1..50)


@dataclass
class StepRecord:
    report: StepReport

    @property
    def plan(self) -> StepPlan:
        return self.report.plan

    @property
    def outcome(self) -> StepOutcome:
        return self.report.outcome

    @property
    def chunks(self) -> list[Chunk]:
        return self.report.chunks

    def admitted(self) -> list[str]:
        return [s.seq_id for s in self.outcome.admitted]

    def scheduled(self) -> list[tuple[str, int, int]]:
        """(sequence, first position, tokens) of every chunk, in batch order."""
        return [(c.seq.seq_id, c.start, len(c.token_ids)) for c in self.chunks]


class FakeModel:
    """The model half of a step, with no model: nothing to compute, made-up tokens (now and then the stop token,
    when `stops` is given). Before the chunks "run", the harness checks the slots they write."""

    def __init__(self, harness: Harness, stops: random.Random | None) -> None:
        self.harness = harness
        self.stops = stops

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        pass  # no K/V to copy

    def new_choice(self, request: Request, index: int) -> Sequence:
        return Sequence(f"{request.request_id}#{index}", request, index, list(request.prompt), None)

    def run(self, chunks: list[Chunk], rows: list[tuple[Sequence, Chunk]]) -> list[Draw]:
        self.harness.check_writes(chunks)
        return [Draw(self._token(seq)) for seq, _ in rows]

    def _token(self, seq: Sequence) -> int:
        if self.stops is not None and self.stops.random() < 0.1:
            return STOP
        return (31 * len(seq.tokens) + seq.index) % 50 + 1


class CheckedScheduler(Scheduler):
    """The scheduler, checked each time it takes in a step's answers (blockd and the mirror agree then)."""

    harness: Harness

    def apply(self, plan: StepPlan, results: list[p.StepOpResult]) -> StepOutcome:
        outcome = super().apply(plan, results)
        h = self.harness
        assert h.pool.refcount == h.blockd_pool.refcount
        assert not (h.exact and self.to_preempt), "blockd refused an append the plan said would fit"
        return outcome


class Harness:
    def __init__(
        self,
        *,
        num_blocks: int = 16,
        block_size: int = 4,
        max_num_seqs: int = 8,
        max_num_batched_tokens: int = 64,
        watermark_blocks: int = 0,
        pipelined: bool = False,
        stops: random.Random | None = None,
        sliding_window: int | None = None,
        policy: str = "fcfs",
    ) -> None:
        self.stops = stops  # when given, a sampled token now and then is a stop token
        self.blockd = InProcessBlockd()
        self.pool = PoolClient(
            self.blockd,
            pool_id=POOL,
            num_blocks=num_blocks,
            block_size=block_size,
            model_id="model",
            epoch=1,
            sliding_window=sliding_window,
        )
        self.pool.register()
        self._submit_step = self.pool.submit_step
        self.pool.submit_step = self._checked_submit  # type: ignore[method-assign]
        self.scheduler = CheckedScheduler(
            num_blocks=num_blocks,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            blocks=self.pool,
            watermark_blocks=watermark_blocks,
            sliding_window=sliding_window,
            policy=policy,
        )
        self.scheduler.harness = self
        self.loop = StepLoop(
            self.scheduler,
            self.pool,
            FakeModel(self, stops),
            eos_token_ids=(),
            max_model_len=10**9,
            plan_ahead=pipelined,
        )
        self.requests: list[Request] = []
        self.aborted: set[str] = set()
        self.exact = True  # the scheduler sees blockd's true free blocks: its appends must never be refused

    @property
    def blockd_pool(self) -> BlockPool:
        return self.blockd.manager.pools[POOL]

    @property
    def ahead(self) -> StepPlan | None:
        """The step planned ahead (pipelined), once this one ran."""
        return self.loop.pending

    def in_blockd(self, seq: Sequence) -> bool:
        return seq.seq_id in self.blockd_pool.seqs

    def submit(
        self,
        name: str,
        prompt_len: int,
        *,
        max_tokens: int = 4,
        n: int = 1,
        prompt: list[int] | None = None,
        cache_salt: str | None = None,
        prompt_logprobs: int | None = None,
        priority: int = 0,
    ) -> Sequence:
        salt = len(self.requests)  # distinct prompts: no prefix hits unless a test wants them
        prompt = prompt if prompt is not None else [(7 * i + salt) % 50 + 1 for i in range(prompt_len)]
        stop_ids = (STOP,) if self.stops is not None else ()
        params = SamplingParams(
            max_tokens=max_tokens, n=n, prompt_logprobs=prompt_logprobs, stop_token_ids=stop_ids, priority=priority
        )
        request = Request(name, params, prompt, cache_salt, 0.0)
        if prompt_logprobs is not None:
            request.prompt_logprobs = []  # as the engine starts it: scored during the prefill
        seq = Sequence(f"{name}#0", request, 0, list(prompt), None)
        request.sequences.append(seq)
        self.requests.append(request)
        self.loop.requests[name] = request
        self.scheduler.add(seq)
        return seq

    def abort(self, request: Request) -> None:
        """The engine's abort: every choice so far ends, the rest never start (after a step in flight)."""
        self.aborted.add(request.request_id)
        self.loop.abort(request.request_id)

    def step(self) -> StepRecord:
        record = StepRecord(self.loop.step())
        assert self.blockd_pool.check() == []
        return record

    def check_writes(self, chunks: list[Chunk]) -> None:
        """No slot the chunks write (by the tables the forward pass uses: the mirror's) is indexed as a prefix
        or read by another live sequence; the step's token budget holds."""
        assert sum(len(c.token_ids) for c in chunks) <= self.scheduler.max_num_batched_tokens
        bs = self.scheduler.block_size
        tables = self.pool.seqs
        read: dict[tuple[int, int], str] = {}  # (block, slot) -> a sequence whose computed tokens are there
        for seq in self.scheduler.running:
            if seq.fork_parent is None:
                table = tables[seq.seq_id].blocks
                for pos in range(seq.num_computed):
                    read[table[pos // bs], pos % bs] = seq.seq_id
        for chunk in chunks:
            table = tables[chunk.seq.seq_id].blocks
            for pos in range(chunk.start, chunk.start + len(chunk.token_ids)):
                block = table[pos // bs]
                assert self.blockd_pool.block_hash[block] is None, (
                    f"{chunk.seq.seq_id} writes into block {block}, which the prefix index names"
                )
                reader = read.get((block, pos % bs))
                assert reader is None, f"{chunk.seq.seq_id} writes slot {pos % bs} of block {block}, read by {reader}"

    def _checked_submit(self, ops: Seq[p.StepOp]) -> None:
        """Every append sent continues the tokens blockd will hold for the sequence with the sequence's own (a
        commit hashes what blockd holds: a wrong token there is a wrong prefix hit later)."""
        seqs = {s.seq_id: s for r in self.requests for s in r.sequences}
        held = {seq_id: m.token_ids() for seq_id, m in self.pool.seqs.items()}
        for op in ops:
            if type(op) is p.Admit:
                held[op.seq_id] = unpack_tokens(op.tokens)
            elif type(op) is p.Fork:
                held[op.child_id] = list(held[op.parent_id])
            elif type(op) is p.Append:
                tokens = held[op.seq_id] + unpack_tokens(op.tokens)
                assert tokens == seqs[op.seq_id].tokens[: len(tokens)], f"{op.seq_id}: blockd would hold other tokens"
                held[op.seq_id] = tokens
        self._submit_step(ops)

    def run(self, max_steps: int = 500) -> list[StepRecord]:
        records = []
        while self.loop.has_work():
            records.append(self.step())
            assert len(records) < max_steps, "the scheduler did not finish"
        return records

    def assert_all_done(self) -> None:
        """Every choice of every request ended, the unaborted ones with all their tokens; blockd holds nothing."""
        for request in self.requests:
            if request.request_id in self.aborted:
                assert all(s.status is Status.FINISHED for s in request.sequences), request.request_id
                continue
            assert request.finished, request.request_id
            for seq in request.sequences:
                assert seq.finish_reason in ("length", "stop", "abort"), (seq.seq_id, seq.finish_reason)  # not "error"
                if seq.finish_reason == "length":
                    assert seq.num_generated == request.params.max_tokens, seq.seq_id
        assert not self.blockd_pool.seqs
        assert len(self.blockd_pool.free_queue) == self.blockd_pool.num_blocks
        assert self.pool.blocks_in_use == 0


# ------------------------------------------------------------------------------------------------ admission


def test_admission_is_first_come_first_served_within_max_num_seqs() -> None:
    h = Harness(max_num_seqs=2)
    a, b, c = (h.submit(name, 4, max_tokens=3) for name in ("a", "b", "c"))
    assert h.step().admitted() == ["a#0", "b#0"]
    assert list(h.scheduler.waiting) == [c] and not h.in_blockd(c)
    for _ in range(10):
        slots_taken = sum(s.status is Status.RUNNING for s in (a, b))
        record = h.step()
        if record.admitted():
            break
    assert record.admitted() == ["c#0"] and slots_taken < 2  # only once a slot came free
    h.run()
    h.assert_all_done()


def test_nobody_overtakes_the_head_of_the_queue() -> None:
    h = Harness(num_blocks=8, block_size=4)
    h.submit("big", 20, max_tokens=4)  # 5 blocks, 6 at its end
    head = h.submit("next", 16, max_tokens=2)  # 4 blocks: does not fit beside it
    small = h.submit("small", 4, max_tokens=2)  # 1 block: would fit, but must wait its turn
    assert h.step().admitted() == ["big#0"]
    for _ in range(2):
        h.step()
        assert list(h.scheduler.waiting) == [head, small]
    records = h.run()
    order = [sid for r in records for sid in r.admitted()]
    assert order.index("next#0") < order.index("small#0")
    h.assert_all_done()


def test_the_watermark_keeps_free_blocks_back_from_admission() -> None:
    h = Harness(num_blocks=10, block_size=4, watermark_blocks=2)
    h.submit("a", 24, max_tokens=2)  # 6 blocks
    b = h.submit("b", 12, max_tokens=2)  # 3 blocks: blockd has 4 free, but only 2 are above the watermark
    assert h.step().admitted() == ["a#0"]
    assert len(h.blockd_pool.free_queue) == 4
    assert list(h.scheduler.waiting) == [b]
    h.run()
    h.assert_all_done()


def test_a_prompt_that_fits_only_below_the_watermark_waits() -> None:
    h = Harness(num_blocks=10, block_size=4, watermark_blocks=2)
    h.submit("too-big", 33, max_tokens=1)  # 9 blocks > 10 - 2
    record = h.step()
    assert record.admitted() == [] and not record.plan.entries
    fits = Harness(num_blocks=10, block_size=4, watermark_blocks=2)
    fits.submit("fits", 32, max_tokens=1)  # 8 blocks
    assert fits.step().admitted() == ["fits#0"]


# ---------------------------------------------------------------------------------------------- preemption


def test_the_most_recently_admitted_is_preempted_to_the_head_of_the_queue() -> None:
    h = Harness(num_blocks=8, block_size=4, max_num_seqs=2)
    older = h.submit("older", 8, max_tokens=20)
    newer = h.submit("newer", 8, max_tokens=20)
    queued = h.submit("queued", 4, max_tokens=2)
    assert h.step().admitted() == ["older#0", "newer#0"]
    for _ in range(50):
        tokens_before = list(newer.tokens)
        h.step()
        if h.scheduler.num_preemptions:
            break
    assert h.scheduler.num_preemptions == 1
    assert newer.status is Status.WAITING and newer.preemptions == 1 and not h.in_blockd(newer)
    assert newer.tokens == tokens_before  # kept, to be recomputed
    assert newer.num_computed == 0
    assert list(h.scheduler.waiting) == [newer, queued]  # the head, ahead of what was already waiting
    assert older.status is Status.RUNNING and older.preemptions == 0 and h.in_blockd(older)
    h.run()
    h.assert_all_done()
    assert older.preemptions == 0


def test_an_append_blockd_refuses_preempts_the_sequence_and_it_still_finishes() -> None:
    class Optimistic:
        """The pool client's view, claiming more free blocks than there are."""

        def __init__(self, pool: PoolClient) -> None:
            self.pool = pool

        @property
        def seqs(self) -> Mapping[str, MirroredSequence]:
            return self.pool.seqs

        @property
        def refcount(self) -> list[int]:
            return self.pool.refcount

        @property
        def free_blocks(self) -> int:
            return self.pool.free_blocks + 4

    h = Harness(num_blocks=6, block_size=4)
    h.scheduler.blocks = Optimistic(h.pool)
    h.exact = False
    seqs = [h.submit(name, 4, max_tokens=8) for name in ("a", "b", "c")]
    refused = []
    while h.scheduler.has_work():
        h.step()
        refused += [s.seq_id for s in h.scheduler.to_preempt]
    assert refused, "blockd never refused an append"
    assert sum(s.preemptions for s in seqs) >= 1
    h.assert_all_done()


# ------------------------------------------------------------------------------------------ chunked prefill


def test_decodes_go_first_then_prefill_chunks_in_admission_order() -> None:
    h = Harness(num_blocks=32, max_num_batched_tokens=8)
    h.submit("d", 3, max_tokens=10)
    assert h.step().scheduled() == [("d#0", 0, 3)]
    h.submit("p1", 20, max_tokens=2)
    h.submit("p2", 20, max_tokens=2)
    steps = [h.step() for _ in range(4)]
    assert steps[0].admitted() == ["p1#0", "p2#0"]
    assert [s.scheduled() for s in steps] == [
        [("d#0", 3, 1), ("p1#0", 0, 7)],  # the new arrivals share what the decode leaves; p2 gets none yet
        [("d#0", 4, 1), ("p1#0", 7, 7)],
        [("d#0", 5, 1), ("p1#0", 14, 6), ("p2#0", 0, 1)],  # p1's prompt is done: p2 starts
        [("d#0", 6, 1), ("p1#0", 20, 1), ("p2#0", 1, 6)],  # p1 decodes now, ahead of p2's prefill
    ]
    h.run()
    h.assert_all_done()


def test_a_one_token_remainder_goes_ahead_of_longer_prefills_admitted_before_it() -> None:
    h = Harness(num_blocks=32, max_num_batched_tokens=8)
    h.submit("long", 30, max_tokens=2)
    h.submit("one", 1, max_tokens=3)  # its whole prompt is one token: it runs like a decode
    first = h.step()
    assert first.admitted() == ["long#0", "one#0"]
    assert first.scheduled() == [("long#0", 0, 8)]
    assert h.step().scheduled() == [("one#0", 0, 1), ("long#0", 8, 7)]
    h.run()
    h.assert_all_done()


# ------------------------------------------------------------------------------------------------- forks


def test_choices_share_the_prompt_blocks_and_copy_the_partly_filled_last_one() -> None:
    h = Harness(num_blocks=16, block_size=4)
    parent = h.submit("r", 6, max_tokens=5, n=3)  # block 0 full, block 1 holds 2 of 4 tokens
    h.step()
    request = parent.request
    assert [s.seq_id for s in request.sequences] == ["r#0", "r#1", "r#2"]
    assert [h.in_blockd(s) for s in request.sequences] == [True, False, False]  # forked at the next step
    record = h.step()
    tables = [h.blockd_pool.seqs[s.seq_id].table for s in request.sequences]
    assert len({t[0] for t in tables}) == 1  # the full prompt block is shared
    assert len({t[1] for t in tables}) == 3  # each writes its own copy of the partial one
    assert len(record.outcome.copies) == 2  # the last writer keeps the original
    assert sorted(record.scheduled()) == [("r#0", 6, 1), ("r#1", 6, 1), ("r#2", 6, 1)]
    h.run()
    h.assert_all_done()
    assert [s.num_generated for s in request.sequences] == [5, 5, 5]


# ------------------------------------------------------------------------------------------------- aborts


def test_an_aborted_sequence_frees_its_blocks_for_the_next_in_the_same_step() -> None:
    h = Harness(num_blocks=8, block_size=4)
    running = h.submit("running", 24, max_tokens=8)  # 6 blocks
    waiting = h.submit("waiting", 16, max_tokens=2)  # 4 blocks: fits only once the first is gone
    h.step()
    assert h.in_blockd(running) and list(h.scheduler.waiting) == [waiting]
    h.scheduler.finish(running, "abort")
    record = h.step()
    assert not h.in_blockd(running) and running.finish_reason == "abort"
    assert record.admitted() == ["waiting#0"]
    h.run()
    h.assert_all_done()


def test_an_aborted_waiting_sequence_never_reaches_blockd() -> None:
    h = Harness(max_num_seqs=1)
    h.submit("first", 4, max_tokens=3)
    second = h.submit("second", 4, max_tokens=3)
    h.step()
    h.scheduler.finish(second, "abort")
    assert not h.scheduler.waiting
    records = h.run()
    assert all("second#0" not in r.admitted() for r in records)
    h.assert_all_done()


def test_a_choice_aborted_before_its_fork_never_reaches_blockd() -> None:
    h = Harness(num_blocks=16, block_size=4)
    parent = h.submit("r", 6, max_tokens=4, n=3)
    h.step()
    aborted = parent.request.sequences[1]
    h.scheduler.finish(aborted, "abort")
    record = h.step()
    assert all(entry.seq is not aborted for entry in record.plan.entries)
    assert not h.in_blockd(aborted)
    assert h.in_blockd(parent.request.sequences[2])
    h.run()
    h.assert_all_done()


# ------------------------------------------------------------------------------------------------- mixed


def test_requests_sharing_a_prefix_wait_for_its_first_computation_then_hit_the_cache() -> None:
    harness = Harness(num_blocks=32, block_size=4, max_num_batched_tokens=64)
    shared = [5, 9, 2, 7, 1, 1, 3, 8, 6, 4, 2, 9]  # three full blocks
    first = harness.submit("first", 0, prompt=[*shared, 11, 12])
    second = harness.submit("second", 0, prompt=[*shared, 21])
    other_salt = harness.submit("salted", 0, prompt=[*shared, 31], cache_salt="tenant-b")
    scored = harness.submit("scored", 0, prompt=[*shared, 41], prompt_logprobs=1)
    harness.submit("unrelated", 6)
    step1 = harness.step()
    # The second waits for the prefix the first computes; another salt cannot share it, a prompt scored for
    # logprobs computes its prompt whole anyway, and an unrelated prompt is not held back.
    assert step1.admitted() == ["first#0", "salted#0", "scored#0", "unrelated#0"]
    assert second.status is Status.WAITING
    step2 = harness.step()  # the first's prompt is committed in this step's round trip, before the admit
    assert step2.admitted() == ["second#0"]
    assert second.request.num_cached_tokens == 12
    assert harness.pool.seqs["second#0"].blocks[:3] == harness.pool.seqs["first#0"].blocks[:3]
    assert first.request.num_cached_tokens == 0 and other_salt.request.num_cached_tokens == 0
    assert scored.request.num_cached_tokens == 0  # computed whole, for its logprobs
    harness.run()


def test_a_sharer_is_not_held_once_the_prefix_is_committed_or_its_owner_is_gone() -> None:
    harness = Harness(num_blocks=32, block_size=4, max_num_batched_tokens=64)
    shared = [5, 9, 2, 7, 1, 1, 3, 8]
    owner = harness.submit("owner", 0, prompt=[*shared, 1], max_tokens=8)
    harness.step()
    harness.step()  # computed and committed: a later request with the prefix is admitted at once, a hit
    late = harness.submit("late", 0, prompt=[*shared, 2])
    assert harness.step().admitted() == ["late#0"] and late.request.num_cached_tokens == 8
    first = harness.submit("first", 0, prompt=[3, 3, 3, 3, 4, 4, 4, 4, 5])
    sharer = harness.submit("sharer", 0, prompt=[3, 3, 3, 3, 4, 4, 4, 4, 6])
    assert harness.step().admitted() == ["first#0"]
    harness.abort(first.request)  # gone before its prefix was committed: the sharer is not held for it
    assert "sharer#0" in harness.step().admitted() and sharer.status is Status.RUNNING
    assert owner.status is not Status.WAITING
    harness.run()


@pytest.mark.parametrize("pipelined", [False, True], ids=["planned-after", "planned-ahead"])
def test_random_workloads_finish_with_every_block_back(pipelined: bool) -> None:
    hits = 0
    for seed in range(RANDOM_SEEDS):
        rng = random.Random(seed)
        h = Harness(
            num_blocks=rng.randint(8, 16),
            block_size=rng.choice([2, 4]),
            max_num_seqs=4,
            pipelined=pipelined,
            stops=random.Random(seed) if seed % 2 else None,
        )
        capacity = h.scheduler.num_blocks * h.scheduler.block_size
        live: list[Sequence] = []
        for step in range(300):
            if step < 40 and rng.random() < 0.3:
                prompt_len = rng.randint(1, capacity // 3)
                prompt = None
                if live and rng.random() < 0.5:  # a follow-up: an earlier sequence's tokens, and more (prefix hits)
                    earlier = rng.choice(live).tokens
                    prompt = earlier[: rng.randint(1, len(earlier))] + [rng.randint(1, 50) for _ in range(3)]
                    prompt = prompt[: capacity // 3]
                n = rng.randint(1, 3)
                live.append(h.submit(f"r{step}", prompt_len, max_tokens=rng.randint(1, 8), n=n, prompt=prompt))
            if live and rng.random() < 0.05:
                h.abort(rng.choice(live).request)
            if step >= 40 and not h.scheduler.has_work():
                break
            h.step()
        h.run()
        h.assert_all_done()
        hits += sum(r.num_cached_tokens for r in h.requests)
    assert hits > 0


# ------------------------------------------------------------------------------- registration, planned ahead


@pytest.mark.parametrize("pipelined", [False, True], ids=["planned-after", "planned-ahead"])
def test_a_decoding_sequence_is_registered_a_block_at_a_time_and_its_blocks_stay_hits(pipelined: bool) -> None:
    h = Harness(num_blocks=16, block_size=4, pipelined=pipelined)
    seq = h.submit("long", 4, max_tokens=20)
    records = h.run()
    appends = [e for r in records for e in r.plan.entries if e.seq is seq and e.purpose is Purpose.APPEND]
    # 20 decode steps, one append each one to two blocks of them (an append reserves to the end of the block
    # after the next token's; the prompt's own block is taken at admission), not one a token.
    assert 3 <= len(appends) <= 5, len(appends)
    assert seq.finish_reason == "length"
    # Its computed tokens (all but the last sampled one) were registered and committed before its blocks went
    # back: a follow-up prompt finds every full block of them cached.
    follow = h.submit("follow", 0, prompt=[*seq.tokens, 7])
    h.run()
    assert follow.request.num_cached_tokens == (len(seq.tokens) - 1) // 4 * 4 == 20


def test_a_plan_made_ahead_leaves_a_preemption_to_the_plan_made_after_sampling() -> None:
    h = Harness(num_blocks=6, block_size=4, pipelined=True)
    older = h.submit("older", 11, max_tokens=12)  # 3 blocks
    newer = h.submit("newer", 11, max_tokens=12)  # 3 blocks: the pool is full once both grow past 12 tokens
    ahead_none = 0
    while h.scheduler.has_work():
        h.step()
        ahead_none += h.ahead is None and h.scheduler.has_work()
    assert h.scheduler.num_preemptions >= 1 and ahead_none >= 1
    assert older.preemptions == 0 and newer.preemptions >= 1
    h.assert_all_done()


# ------------------------------------------------------------------------------- steps without a round trip


@pytest.mark.parametrize("pipelined", [False, True], ids=["planned-after", "planned-ahead"])
def test_decode_steps_mostly_go_without_a_round_trip(pipelined: bool) -> None:
    h = Harness(num_blocks=256, block_size=4, max_num_seqs=12, max_num_batched_tokens=256, pipelined=pipelined)
    for i in range(12):  # prompts of staggered lengths: the sequences reach their blocks' ends in different steps
        h.submit(f"r{i}", 3 + i, max_tokens=30)
    records = h.run()
    h.assert_all_done()
    assert h.scheduler.num_preemptions == 0
    decoding = [r for r in records if r.chunks and all(len(c.token_ids) == 1 for c in r.chunks)]
    with_trip = [r for r in decoding if r.plan.entries]
    # One append each time a sequence runs out of room would be a round trip nearly every step; renewing every
    # sequence low on room in the round trip that goes anyway leaves each at least a block (4 steps) of room.
    assert len(decoding) >= 25 and len(with_trip) <= len(decoding) // 3, (len(with_trip), len(decoding))


def test_frees_and_generated_tokens_commits_wait_a_bounded_number_of_steps() -> None:
    h = Harness(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=256)
    short = h.submit("short", 4, max_tokens=2)
    h.submit("long", 5, max_tokens=3 * QUIET_STEPS)
    steps_held = 0
    while short.status is not Status.FINISHED:
        h.step()
    while h.in_blockd(short):
        h.step()
        steps_held += 1
    assert 1 <= steps_held <= QUIET_STEPS + 1
    records = h.run()
    # Nothing runs after the long one: its blocks go back in the very next step.
    assert records[-1].plan.entries and all(e.purpose is Purpose.FREE for e in records[-1].plan.entries[-1:])
    h.assert_all_done()


def test_a_prompts_blocks_are_committed_in_the_step_after_it_is_computed() -> None:
    h = Harness(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=256)
    seq = h.submit("a", 9, max_tokens=20)
    h.step()  # admitted and its prompt computed
    committed = h.step().plan
    assert [e.purpose for e in committed.entries if e.seq is seq][:1] == [Purpose.COMMIT]
    assert len(h.blockd_pool.index) == 2  # both full blocks of the prompt are prefix hits now


def test_short_of_blocks_appends_reserve_to_the_block_end_instead_of_preempting() -> None:
    # Two prompts of one block each, four blocks: reserving into a second block past the next token's would
    # take four more, reserving to the next token's block end takes two, and both sequences still fit.
    h = Harness(num_blocks=4, block_size=4, max_num_seqs=2)
    h.submit("a", 4, max_tokens=4)
    h.submit("b", 4, max_tokens=4)
    h.run()
    assert h.scheduler.num_preemptions == 0
    h.assert_all_done()


def test_a_request_waiting_for_a_sequence_slot_does_not_make_every_step_a_round_trip() -> None:
    h = Harness(num_blocks=64, block_size=4, max_num_seqs=2, max_num_batched_tokens=256)
    for i in range(3):
        h.submit(f"r{i}", 5, max_tokens=20)
    quiet_while_waiting = 0
    while h.scheduler.has_work():
        waiting = bool(h.scheduler.waiting) and len(h.scheduler.running) == 2
        record = h.step()
        quiet_while_waiting += waiting and not record.plan.entries
    assert quiet_while_waiting >= 10
    h.assert_all_done()
