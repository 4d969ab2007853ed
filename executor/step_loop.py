"""The step loop: one engine step without the model, which the engine runs and the scheduler's tests drive.

It owns the requests in progress, the blockd round trip (sent a step ahead, re-synced after a failure), aborts
and what the sampled tokens do to sequences; the forward pass and sampling are a `StepModel` it is given. The
design of a step is in docs/architecture.md ("A step").
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import structlog

from blockd import protocol as p
from blockd.client import BlockdUnavailable, PoolClient
from blockd.tiers import TierOp
from executor import protocol as ep
from executor.scheduler import Chunk, Scheduler, StepOutcome, StepPlan, longest_sequence
from executor.sequence import Request, Sequence, Status
from executor.speculative import Speculator
from executor.tier_store import Landed, Moved

if TYPE_CHECKING:
    import torch

log = structlog.get_logger("executor")

#: Lower-tier loads still reading when a step is scheduled: it waits for them up to this long (helping with local
#: files: executor.tier_store.TierStore._wait), so that reads that finish soon (the page cache, a fast disk) join
#: their sequences to this step as if read in it, and slow ones (a busy disk, a network volume) let the others go.
JOIN_WAIT_S = 0.05
#: When a step has nothing to run but sequences whose lower-tier loads are reading, how long it waits for them
#: before it returns (and the server loop calls it again).
LOAD_WAIT_S = 0.25

#: Per sampled token: None, or (its logprob, [(token, logprob) of the top alternatives]).
Logprob = tuple[float, list[tuple[int, float]]] | None


@dataclass(frozen=True, slots=True)
class Draw:
    """The token sampled for one choice."""

    token: int
    logprob: Logprob = None
    # Speculative decoding: the draft's tokens accepted before `token` (each drawn from its own row, equal to the
    # draft's), which go into the sequence first.
    before: tuple[Draw, ...] = ()
    beam_logprobs: torch.Tensor | None = None  # a beam search's row: its next-token logprobs, nothing drawn


class StepModel(Protocol):
    """The model half of a step, which the loop calls."""

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block src's K/V into block dst, for each (src, dst), before the step's forward pass."""

    def move_tiers(self, ops: list[TierOp]) -> Moved:
        """The lower KV tiers' moves (blockd.tiers), in order, before the step's copies and forward pass; returns
        the device blocks whose load failed (a block file found corrupt: dropped, its tokens to be recomputed)
        and the loads still reading (their tickets). Only a pool registered with tiers gets any."""
        ...

    def land_loads(self, keep: Collection[int], wait_s: float = 0.0) -> Landed:
        """Copy in the reads finished of the loads whose ticket is in `keep` (waiting up to `wait_s` for them);
        the others' bytes are thrown away."""
        ...

    def new_choice(self, request: Request, index: int) -> Sequence:
        """Choice `index` of `request`, at its prompt, with its own sampling state."""

    def run(self, chunks: list[Chunk], rows: list[tuple[Sequence, Chunk]]) -> list[Draw]:
        """Compute the chunks (K/V into the cache, the prompt logprobs they score) and draw one token per row:
        for the row's sequence, from the logits of the last position of the row's chunk (a new choice draws
        from its parent's)."""


@dataclass
class StepReport:
    """What one step did: the plan whose answers it took in, their outcome, the chunks it ran, its deltas."""

    plan: StepPlan
    outcome: StepOutcome
    chunks: list[Chunk]
    deltas: list[ep.Delta] = field(default_factory=list)


class StepLoop:
    """Steps, one at a time, with the requests in progress; the caller adds requests (and their first choice
    to the scheduler), and `step()` and `abort()` do the rest."""

    def __init__(
        self,
        scheduler: Scheduler,
        pool: PoolClient,
        model: StepModel,
        *,
        eos_token_ids: Iterable[int],
        max_model_len: int,
        plan_ahead: bool = True,
        clock: Callable[[], float] = time.perf_counter,
        speculator: Speculator | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.speculator = speculator  # speculative decoding: drafts on the decoding chunks (the model verifies)
        if speculator is not None:
            scheduler.lookahead = speculator.lookahead
        self.clock = clock  # times each forward pass, which sizes the steps after it (--max-step-ms)
        self.pool = pool
        self.model = model
        self.eos = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.plan_ahead = plan_ahead  # False: every step planned after sampling and sent synchronously
        # The longest a sequence can grow, alone in the cache above the admission watermark; with a sliding
        # window, as long as the model allows if its window's blocks fit (the blocks behind it go back as it runs).
        # With layer groups, a global group's table takes the sequence's every block, a sliding one its window's.
        room = scheduler.num_blocks - scheduler.watermark
        bs, windows = scheduler.block_size, scheduler.windows
        self.max_seq_tokens = longest_sequence(room, bs, windows, max_model_len)
        # A prompt held in part as its prefill goes (Scheduler._hold_end) needs its window and a step's tokens.
        ahead = scheduler.max_num_batched_tokens
        self.max_prompt_tokens = longest_sequence(room, bs, windows, max_model_len, ahead)
        self.requests: dict[str, Request] = {}  # in progress, by id
        self.steps = 0  # steps that ran a forward pass
        self.blockd_reachable = True
        # The next step's plan once made: sent ahead (in flight: its answers are collected by the next step() call),
        # or, after its blockd call failed for good, to be sent again (after a re-sync) by the next step() call;
        # meanwhile the caller keeps serving, and aborts wait for it (they would change its plan).
        self._pending: StepPlan | None = None
        self._pending_ahead = False  # it was planned while the step before ran (sent or not: it may have no ops)
        self._resync_first = False  # a round trip failed for good: re-sync before the next one is sent
        self._deferred_aborts: list[tuple[str, int | None]] = []  # came while a plan was pending: once it is in
        self._reads_out = False  # lower-tier loads may still be reading (StepLoop._land_loads)

    @property
    def pending(self) -> StepPlan | None:
        """The next step's plan, if made already: sent ahead, or to be sent again after a failed round trip."""
        return self._pending

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._pending is not None

    # ------------------------------------------------------------------------------------------ aborts

    def abort(self, request_id: str, index: int | None = None) -> list[ep.Delta]:
        """Stop a request, or only its choice `index`; blocks are freed at the next step. Unknown (or already
        finished) ids and choices: no-op."""
        if self._pending is not None:
            self._deferred_aborts.append((request_id, index))
            return []
        request = self.requests.get(request_id)
        if request is None:
            return []
        if request.beam is not None:  # its beams are no choices: the whole search stops
            del self.requests[request_id]
            return request.beam.abort(self.scheduler)
        if index is not None and request.params.n > 1:
            return self._abort_choice(request, index)
        del self.requests[request_id]
        deltas = []
        for seq in request.sequences:
            if seq.status is not Status.FINISHED:
                self.scheduler.finish(seq, "abort")
                deltas.append(self._delta(seq, [], None))
        for unforked in range(len(request.sequences), request.params.n):  # choices never forked
            deltas.append(
                ep.Delta(
                    request_id=request_id,
                    index=unforked,
                    token_ids=[],
                    finish_reason="abort",
                    prompt_tokens=len(request.prompt),
                    cached_tokens=request.num_cached_tokens,
                )
            )
        return deltas

    def _abort_choice(self, request: Request, index: int) -> list[ep.Delta]:
        # A choice that has not been forked yet has produced nothing a gateway could have stopped on.
        seq = next((s for s in request.sequences if s.index == index), None)
        if seq is None or seq.status is Status.FINISHED:
            return []
        self.scheduler.finish(seq, "abort")
        delta = self._delta(seq, [], None)
        self._forget_if_done(request)
        return [delta]

    def _take_deferred_aborts(self) -> list[tuple[str, int | None]]:
        taken, self._deferred_aborts = self._deferred_aborts, []
        return taken

    # ------------------------------------------------------------------------------------------ the step

    def step(self) -> StepReport:
        """Run one step; raises BlockdUnavailable (the step stays pending, nothing is lost) if blockd is away."""
        scheduler = self.scheduler
        if self._pending is None:
            self._pending = scheduler.plan()
        plan, planned_ahead = self._pending, self._pending_ahead
        results = self._round_trip(plan.ops) if plan.entries else []
        self._pending, self._pending_ahead = None, False
        outcome = scheduler.apply(plan, results)
        self._move_tiers(outcome)
        self.model.copy_blocks(outcome.copies)
        deltas = self._failed(outcome)
        for request_id, index in self._take_deferred_aborts():  # before scheduling: an aborted choice never runs
            deltas += self.abort(request_id, index)
        if planned_ahead and scheduler.arrived:
            late = self._admit_arrivals()
            self._move_tiers(late)
            outcome.admitted += late.admitted
            deltas += self._failed(late)
        self._land_loads(wait_s=JOIN_WAIT_S)
        chunks = scheduler.schedule(outcome)
        if not chunks and self._land_loads(wait_s=LOAD_WAIT_S):  # nothing else to run: wait for them, not spin
            chunks = scheduler.schedule(outcome)
        if chunks:
            self.steps += 1
            if self.speculator is not None:
                left = scheduler.step_tokens - sum(len(c.token_ids) for c in chunks)
                self.speculator.propose(chunks, self.pool.seqs, left)
            self._send_ahead(chunks)
            started = self.clock()
            deltas += self._run(chunks)
            computed = sum(len(c.token_ids) + len(c.draft) for c in chunks)
            scheduler.observe_step(computed, self.clock() - started)
        return StepReport(plan, outcome, chunks, deltas)

    def _move_tiers(self, outcome: StepOutcome) -> None:
        """Run the tier moves before anything writes or reads a block. A disk or shared load reads on while the
        step runs the other sequences: its sequence waits (`Sequence.loading`) until `_land_loads` has copied
        it in. A sequence whose load failed computes its tokens from that block on instead (the blocks are its
        own: nothing else reads them before they are committed)."""
        if not outcome.tier_ops:
            return
        moved = self.model.move_tiers(outcome.tier_ops)
        if not (moved.failed or moved.reading):
            return
        self._reads_out = self._reads_out or bool(moved.reading)
        failed = set(moved.failed)
        for seq in outcome.admitted:
            mirrored = self.pool.seqs.get(seq.seq_id)
            if mirrored is None:
                continue
            seq.loading.update((moved.reading[b], b) for b in mirrored.blocks if b in moved.reading)
            first = next((i for i, b in enumerate(mirrored.blocks) if b in failed), None)
            if first is not None:
                self._recompute_from(seq, first)

    def _land_loads(self, wait_s: float = 0.0) -> bool:
        """Copy in the disk and shared loads read since the last look (those of sequences no longer running are
        thrown away), waiting up to `wait_s` for the running ones'. A failed one makes its sequence compute from
        that block on; a sequence whose loads have all landed is scheduled again. Returns whether any has."""
        loading = [s for s in self.scheduler.running if s.loading]
        if not loading and not self._reads_out:
            return False
        keep = {t for s in loading for t in s.loading}
        landed = self.model.land_loads(keep, wait_s if loading else 0.0)
        self._reads_out = landed.in_flight > 0
        failed = set(landed.failed)
        ready = False
        for seq in loading:
            bad = [b for t, b in seq.loading.items() if t in failed]
            if bad:
                blocks = self.pool.seqs[seq.seq_id].blocks
                self._recompute_from(seq, min(blocks.index(b) for b in bad))
            for ticket in (*landed.loaded, *landed.failed):
                seq.loading.pop(ticket, None)
            ready = ready or not seq.loading
        return ready

    def _recompute_from(self, seq: Sequence, first: int) -> None:
        """A load into the sequence's block `first` (of its table) failed: it computes from there, and its loads
        past there are abandoned."""
        bs = self.scheduler.block_size
        mirrored = self.pool.seqs[seq.seq_id]
        if first * bs < seq.num_computed:
            seq.num_computed = first * bs
            mirrored.num_computed_tokens = min(mirrored.num_computed_tokens, first * bs)
            seq.committed_tokens = min(seq.committed_tokens, first * bs)
            if seq.preemptions == 0 and seq.index == 0:
                seq.request.num_cached_tokens = first * bs
        past = set(mirrored.blocks[first:])
        for ticket, block in list(seq.loading.items()):
            if block in past:
                del seq.loading[ticket]

    def _admit_arrivals(self) -> StepOutcome:
        """Requests that arrived after this step was planned (ahead) get one more round trip, admits alone, so
        that they start in this step rather than wait a step for the next plan: a first token one step sooner."""
        arrivals = self.scheduler.plan_arrivals()
        if not arrivals.entries:
            return StepOutcome()
        try:
            results = self._round_trip(arrivals.ops)
        except BlockdUnavailable:
            # They wait for the next plan, which re-syncs first (undoing what blockd may have applied of these
            # admits); this step goes on with what it has.
            return StepOutcome()
        return self.scheduler.apply(arrivals, results)

    def _failed(self, outcome: StepOutcome) -> list[ep.Delta]:
        """Deltas for the sequences whose ops blockd refused (they ended with "error")."""
        for seq, _ in outcome.failed:
            self._forget_if_done(seq.request)
        return [self._delta(seq, [], None) for seq, _ in outcome.failed]

    def _send_ahead(self, chunks: list[Chunk]) -> None:
        """Plan the next step while `chunks` run and send it, so that blockd answers during the forward pass."""
        if not self.plan_ahead or self._resync_first:
            return  # (after blockd was away, the next step re-syncs, then plans and sends as it used to)
        if any(request.beam is not None for request in self.requests.values()):
            return  # a beam search forks its beams once this step's logprobs are in: the next plan must see them
        plan = self.scheduler.plan_ahead(chunks)
        if plan is None:
            return
        self._pending, self._pending_ahead = plan, True
        if plan.entries:
            try:
                self.pool.submit_step(plan.ops)
            except BlockdUnavailable:
                return  # not sent: the next step sends it (pending, not in flight)

    def _round_trip(self, ops: list[p.StepOp]) -> list[p.StepOpResult]:
        """The step's one blockd call, or the answers to the one sent ahead (the pool client retries for its
        retry window). After a call that failed for good, re-sync first: that undoes whatever blockd had applied
        of the step before it is sent again."""
        try:
            if self.pool.step_in_flight:  # sent ahead: its answers
                results = self.pool.finish_step()
            else:
                if self._resync_first:
                    self.pool.resync()
                    self._resync_first = False
                results = self.pool.step(ops)
        except BlockdUnavailable:
            self._resync_first = True
            if self.blockd_reachable:
                log.warning("blockd_unreachable", pool_id=self.pool.pool_id, pending_ops=len(ops))
            self.blockd_reachable = False
            raise
        if not self.blockd_reachable:
            log.info("blockd_reachable_again", pool_id=self.pool.pool_id)
        self.blockd_reachable = True
        return results

    # ------------------------------------------------------------------------------------------ sampled tokens

    def _run(self, chunks: list[Chunk]) -> list[ep.Delta]:
        """The model computes the chunks and draws a token for each sampling sequence (the first draw of a
        request with n > 1 choices starts the other choices too); the draws go into the sequences."""
        rows: list[tuple[Sequence, Chunk]] = []
        for chunk in chunks:
            seq = chunk.seq
            if not chunk.samples or seq.params.max_tokens == 0:
                continue
            rows.append((seq, chunk))
            request = seq.request
            first = seq.index == 0 and len(request.sequences) == 1 and seq.num_generated == 0
            if first and request.params.n > 1 and request.beam is None:
                for index in range(1, request.params.n):  # the other choices start from the same prompt logits
                    rows.append((self.model.new_choice(request, index), chunk))
        draws = self.model.run(chunks, rows)
        for chunk in chunks:
            chunk.seq.num_computed = chunk.start + len(chunk.token_ids)
        deltas = []
        for chunk in chunks:
            seq = chunk.seq
            if chunk.samples and seq.params.max_tokens == 0:  # the prompt only (echo): computed, nothing generated
                self.scheduler.finish(seq, "length")
                deltas.append(self._delta(seq, [], None))
                self._forget_if_done(seq.request)
        for (seq, chunk), draw in zip(rows, draws, strict=True):
            if draw.beam_logprobs is not None:
                deltas += seq.request.beam.take(seq, draw.beam_logprobs, self.scheduler)
                self._forget_if_done(seq.request)
                continue
            if draw.before:
                deltas.append(self._take_accepted(seq, draw))
            else:
                deltas.append(self._take(seq, chunk.seq, draw))
        return deltas

    def _take_accepted(self, seq: Sequence, draw: Draw) -> ep.Delta:
        """A verified draft: its accepted tokens (K/V computed this step) and the token drawn after them go into
        the sequence, up to the first that finishes it; one delta carries them all."""
        taken: list[Draw] = []
        for one in (*draw.before, draw):
            taken.append(one)
            seq.tokens.append(one.token)
            reason = self._finish_reason(seq, one.token)
            if reason is not None:
                self.scheduler.finish(seq, reason)
                break
        seq.num_computed += min(len(taken), len(draw.before))  # the accepted draft tokens' K/V are in the cache
        logprobs = [ep.TokenLogprob(d.token, d.logprob[0], d.logprob[1]) for d in taken if d.logprob is not None]
        delta = self._delta(seq, [d.token for d in taken], None, logprobs or None)
        self._forget_if_done(seq.request)
        return delta

    def _take(self, seq: Sequence, sampled: Sequence, draw: Draw) -> ep.Delta:
        """`draw` goes into `seq`, drawn from `sampled`'s logits: `seq` itself, or the parent of a new choice."""
        new = seq is not sampled
        if new:
            # It shares its parent's prompt: computed, and committed, as far as the parent's is.
            seq.num_computed = seq.committed_tokens = seq.prompt_len
            seq.request.sequences.append(seq)
        token = draw.token
        seq.tokens.append(token)
        if seq.matcher is not None and not seq.matcher.accept_token(token):
            # Only when other processing banned every token the grammar allows (min_tokens past its end...)
            log.warning("grammar_rejected_token", request_id=seq.request.request_id, token=token)
            reason: str | None = "error"
        else:
            reason = self._finish_reason(seq, token)
        if new and reason is None:
            self.scheduler.fork(sampled, seq)
        elif new:
            seq.status, seq.finish_reason = Status.FINISHED, reason  # never needs blocks of its own
        elif reason is not None:
            self.scheduler.finish(seq, reason)
        delta = self._delta(seq, [token], draw.logprob)
        self._forget_if_done(seq.request)
        return delta

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        if (token in self.eos and not params.ignore_eos) or token in params.stop_token_ids:
            return "stop"
        if seq.matcher is not None and seq.matcher.is_terminated():
            return "stop"
        if seq.num_generated >= params.max_tokens or len(seq.tokens) >= self.max_model_len:
            return "length"
        if len(seq.tokens) >= self.max_seq_tokens:
            return "length"  # it could not grow any further even alone in the cache
        return None

    def _forget_if_done(self, request: Request) -> None:
        if request.finished:
            self.requests.pop(request.request_id, None)

    def _delta(
        self, seq: Sequence, tokens: list[int], logprob: Logprob, logprobs: list[ep.TokenLogprob] | None = None
    ) -> ep.Delta:
        request = seq.request
        prompt_logprobs = None
        # Prompt logprobs are sent once, complete, in the request's first delta.
        if (
            request.prompt_logprobs is not None
            and not request.prompt_logprobs_sent
            and not request.prompt_logprobs_pending
        ):
            prompt_logprobs = request.prompt_logprobs
            request.prompt_logprobs_sent = True
        return ep.Delta(
            request_id=request.request_id,
            index=seq.index,
            token_ids=tokens,
            logprobs=logprobs if logprob is None else [ep.TokenLogprob(tokens[0], logprob[0], logprob[1])],
            finish_reason=seq.finish_reason,
            prompt_tokens=len(request.prompt),
            completion_tokens=seq.num_generated,
            cached_tokens=request.num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
        )
