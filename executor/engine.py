"""The engine: requests in, token deltas out, one scheduler step at a time.

A step is: its blockd round trip's answers -> copy-on-write block copies -> one forward pass over every scheduled
chunk -> sampling -> deltas. The round trip is off the critical path: once a step's chunks are scheduled, the
next step is planned (`Scheduler.plan_ahead`: a slot reserved for each token being sampled) and sent
(`PoolClient.submit_step`) before the forward pass, and its answers are collected (`finish_step`) when the next
step starts, so blockd works while the model does. A step with nothing sent ahead (the first, one after a
failed round trip, one whose plan needs a preemption) is planned after sampling and sent synchronously; requests
that arrived after a step was planned get one extra round trip (admits alone) before it is scheduled, so that
they start in it rather than a step later. The engine is single-threaded and owns everything it touches; the
server drives it and carries its deltas to gateways.

A request with structured output (`params.structured`) has its grammar compiled off the step's thread
(executor.structured: cached per spec); it enters the scheduler once that is done, and a spec that does not
compile comes out of a later step as `Rejected`. Its sequences each advance a grammar matcher with every token,
and finish ("stop") when the matcher terminates.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from concurrent import futures
from dataclasses import dataclass

import structlog
import torch

from blockd.client import BlockdClient, BlockdUnavailable, PoolClient
from common.auth import ClientCurve
from executor import protocol as ep
from executor.params import SamplingParams
from executor.runner import LoadedModel, ModelRunner
from executor.sampling import Sampler, SampleRow, choice_generator
from executor.scheduler import Chunk, Scheduler, StepOutcome, StepPlan
from executor.sequence import Request, Sequence, Status
from executor.structured import GrammarRejected, Grammars, new_matcher
from executor.threads import ThreadGovernor
from kernels import cpu_native
from kernels.dispatch import Backend

log = structlog.get_logger("executor")


class RequestRejected(ValueError):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class EngineLimits:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048


class Engine:
    def __init__(
        self,
        runner: ModelRunner,
        pool: PoolClient,
        limits: EngineLimits = EngineLimits(),
        *,
        seed: int | None = None,
        adapt_threads: bool = True,
        pin_threads: bool = False,
    ) -> None:
        if limits.max_num_batched_tokens < limits.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be at least max_num_seqs (every decode needs a token)")
        self.runner = runner
        self.pool = pool
        self.config = runner.config
        self.limits = limits
        self.scheduler = Scheduler(
            num_blocks=runner.num_blocks,
            block_size=runner.block_size,
            max_num_seqs=limits.max_num_seqs,
            max_num_batched_tokens=limits.max_num_batched_tokens,
            blocks=pool,
        )
        self.sampler = Sampler(runner.device, seed, eos_token_ids=self.config.eos_token_ids)
        # The longest a sequence can grow, alone in the cache above the admission watermark.
        self.max_seq_tokens = (self.scheduler.num_blocks - self.scheduler.watermark) * runner.block_size
        self.requests: dict[str, Request] = {}
        self.eos = frozenset(self.config.eos_token_ids)
        self.steps = 0
        self.generated_tokens = 0
        # The next step's plan once made: sent ahead (in flight: its answers are collected by the next step() call),
        # or, after its blockd call failed for good, to be sent again (after a re-sync) by the next step() call;
        # meanwhile the caller keeps serving, and aborts wait for it (they would change its plan).
        self._pending: StepPlan | None = None
        self._pending_ahead = False  # it was planned while the step before ran (sent or not: it may have no ops)
        self._resync_first = False
        self._deferred_aborts: list[tuple[str, int | None]] = []
        self.blockd_reachable = True
        # Structured output: the compiled-grammar cache (made for the first such request), and the requests
        # whose grammar is still compiling, kept out of the scheduler until it is ready.
        self.grammars: Grammars | None = None
        self._compiling: dict[str, tuple[Sequence, futures.Future]] = {}
        # On the CPU, torch's thread team shrinks while other processes keep cores busy (executor.threads).
        cpu = runner.device.type == "cpu"
        self.threads = ThreadGovernor(torch.get_num_threads()) if cpu and adapt_threads else None
        # ... and its worker threads stay each on one core (kernels.cpu_native.pin_workers).
        lib = cpu_native.library() if cpu and pin_threads else None
        if lib is not None:
            log.info("worker_threads_pinned", cpus=cpu_native.pin_workers(lib, torch.get_num_threads()))

    @classmethod
    def assemble(
        cls,
        loaded: LoadedModel,
        blockd_endpoint: str,
        *,
        pool_id: str,
        num_blocks: int,
        block_size: int,
        limits: EngineLimits = EngineLimits(),
        backend: Backend = "auto",
        seed: int | None = None,
        timeout_s: float = 2.0,
        retry_for_s: float = 30.0,
        curve: ClientCurve | None = None,
        adapt_threads: bool = True,
        pin_threads: bool = False,
    ) -> Engine:
        """The KV cache for a loaded model, its pool client (not yet registered with blockd), the engine."""
        runner = ModelRunner(loaded, num_blocks=num_blocks, block_size=block_size, backend=backend)
        pool = PoolClient(
            BlockdClient(blockd_endpoint, timeout_s=timeout_s, curve=curve),
            pool_id=pool_id,
            num_blocks=num_blocks,
            block_size=block_size,
            model_id=loaded.config.model_id,
            retry_for_s=retry_for_s,
        )
        return cls(runner, pool, limits, seed=seed, adapt_threads=adapt_threads, pin_threads=pin_threads)

    # ------------------------------------------------------------------------------------------ requests

    def add_request(
        self, request_id: str, prompt: Seq[int], params: SamplingParams, cache_salt: str | None = None
    ) -> None:
        """Queue a request, or raise RequestRejected (nothing else is affected)."""
        if request_id in self.requests:
            raise RequestRejected("duplicate_request", f"request {request_id!r} is already in progress")
        problem = params.validate(self.config.vocab_size)
        if problem:
            raise RequestRejected("invalid_request", problem)
        prompt = list(prompt)
        if not prompt:
            raise RequestRejected("invalid_request", "the prompt is empty")
        vocab = self.config.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise RequestRejected("invalid_request", f"prompt token ids must be in [0, {vocab})")
        limit = self.config.max_model_len
        if len(prompt) >= limit:
            raise RequestRejected(
                "context_length_exceeded",
                f"the prompt has {len(prompt)} tokens; this model's context is {limit} tokens, "
                "including at least one to generate",
            )
        capacity = self.max_seq_tokens
        if len(prompt) + 1 > capacity:
            raise RequestRejected(
                "capacity_exceeded",
                f"the prompt has {len(prompt)} tokens; this executor's KV cache holds at most {capacity} "
                "tokens for one sequence",
            )
        request = Request(request_id, params, prompt, cache_salt, time.monotonic())
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = []
        first = Sequence(f"{request_id}#0", request, 0, list(prompt), choice_generator(params, 0, self.runner.device))
        request.sequences.append(first)
        self.requests[request_id] = request
        if params.structured is not None:
            if self.grammars is None:
                self.grammars = Grammars(
                    getattr(self.runner, "model_dir", None), self.config.vocab_size, self.config.eos_token_ids
                )
            future = self.grammars.compile(params.structured)
            if not future.done():
                self._compiling[request_id] = (first, future)
                return
            if future.exception() is not None:  # a spec seen before, and refused then
                del self.requests[request_id]
                raise RequestRejected(*_grammar_rejection(future.exception()))
            request.grammar = future.result()  # a cache hit: no step to wait for
            first.matcher = new_matcher(request.grammar)
        self.scheduler.add(first)

    def _admit_compiled(self) -> list[ep.Delta | ep.Rejected]:
        """Requests whose grammar is compiled go to the scheduler; those whose grammar failed are rejected."""
        out: list[ep.Delta | ep.Rejected] = []
        for request_id, (seq, future) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[request_id]
            request = seq.request
            error = future.exception()
            if error is not None:
                self.requests.pop(request_id, None)
                seq.status, seq.finish_reason = Status.FINISHED, "abort"
                code, message = _grammar_rejection(error)
                out.append(ep.Rejected(request_id=request_id, code=code, message=message))
                continue
            request.grammar = future.result()
            seq.matcher = new_matcher(request.grammar)
            self.scheduler.add(seq)
        return out

    def abort(self, request_id: str, index: int | None = None) -> list[ep.Delta]:
        """Stop a request, or only its choice `index`; blocks are freed at the next step. Unknown (or already
        finished) ids and choices: no-op."""
        if self._pending is not None:
            self._deferred_aborts.append((request_id, index))
            return []
        request = self.requests.get(request_id)
        if request is None:
            return []
        self._compiling.pop(request_id, None)
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

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._compiling) or self._pending is not None

    def load(self) -> ep.LoadReport:
        s = self.scheduler
        return ep.LoadReport(
            pool_id=self.pool.pool_id,
            running=len(s.running),
            waiting=len(s.waiting),
            free_blocks=self.pool.free_blocks,
            num_blocks=s.num_blocks,
            kv_utilization=self.pool.blocks_in_use / s.num_blocks,
            preemptions=s.num_preemptions,
            steps=self.steps,
            blockd_reachable=self.blockd_reachable,
        )

    # ------------------------------------------------------------------------------------------ the step

    def step(self) -> list[ep.Delta | ep.Rejected]:
        """Run one step; raises BlockdUnavailable (the step stays pending, nothing is lost) if blockd is away.
        Besides deltas, it returns `Rejected` for requests whose structured-output grammar did not compile."""
        scheduler = self.scheduler
        if self._pending is None:
            self._pending = scheduler.plan()
        plan, planned_ahead = self._pending, self._pending_ahead
        results = self._round_trip(plan.ops) if plan.entries else []
        self._pending, self._pending_ahead = None, False
        outcome = scheduler.apply(plan, results)
        self.runner.copy_blocks(outcome.copies)
        deltas = self._failed(outcome)
        for request_id, index in self._take_deferred_aborts():  # before scheduling: an aborted choice never runs
            deltas += self.abort(request_id, index)
        if planned_ahead and scheduler.arrived:
            late = self._admit_arrivals()
            outcome.admitted += late.admitted
            deltas += self._failed(late)
        chunks = scheduler.schedule(outcome)
        if chunks:
            self.steps += 1
            if self.threads is not None:
                self.threads.step()
            self._send_ahead(chunks)
            logits = self.runner.execute(chunks, self.pool.seqs)
            sampled = sum(1 for c in chunks if c.samples)
            if logits.shape[0] > sampled:
                self._score_prompts(chunks, logits[sampled:])
            deltas += self._sample(chunks, logits[:sampled])
        if self._compiling:  # admitted here, after the step's blockd call: a rejection is never lost to its failure
            if not chunks:  # nothing else to do: wait a little for a grammar rather than spin
                futures.wait(
                    [f for _, f in self._compiling.values()], timeout=0.01, return_when=futures.FIRST_COMPLETED
                )
            return [*deltas, *self._admit_compiled()]
        return deltas

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

    def _take_deferred_aborts(self) -> list[tuple[str, int | None]]:
        taken, self._deferred_aborts = self._deferred_aborts, []
        return taken

    def _send_ahead(self, chunks: list[Chunk]) -> None:
        """Plan the next step while `chunks` run and send it, so that blockd answers during the forward pass."""
        if self._resync_first:
            return  # blockd was away: the next step re-syncs, then plans and sends as it used to
        plan = self.scheduler.plan_ahead(chunks)
        if plan is None:
            return
        self._pending, self._pending_ahead = plan, True
        if plan.entries:
            try:
                self.pool.submit_step(plan.ops)
            except BlockdUnavailable:
                return  # not sent: the next step sends it (pending, not in flight)

    def _round_trip(self, ops: list) -> list:
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

    def _score_prompts(self, chunks: list[Chunk], logits: torch.Tensor) -> None:
        """Prompt logprobs from the rows of each chunk's `scored_positions` (in chunk order): one batched
        log-softmax, gather and top-k for the whole step."""
        spans = [(c.seq.request, c.scored_positions) for c in chunks]
        spans = [(request, span) for request, span in spans if span]
        targets = [request.prompt[pos + 1] for request, span in spans for pos in span]
        logprobs = torch.log_softmax(logits, dim=-1)
        index = torch.tensor(targets, dtype=torch.int64, device=logits.device)
        chosen_t = logprobs.gather(1, index[:, None])
        ranks = ((logprobs > chosen_t).sum(dim=1) + 1).tolist()
        chosen = chosen_t.squeeze(1).tolist()
        k = max(request.params.prompt_logprobs for request, _ in spans)
        top_values: list[list[float]] = [[]] * len(targets)
        top_ids: list[list[int]] = [[]] * len(targets)
        if k:
            values, ids = torch.topk(logprobs, k, dim=-1)
            top_values, top_ids = values.tolist(), ids.tolist()
        row = 0
        for request, span in spans:
            assert len(request.prompt_logprobs) == span.start, "prompt logprobs must be scored without a gap"
            keep = request.params.prompt_logprobs
            for _ in span:
                top = list(zip(top_ids[row][:keep], top_values[row][:keep], strict=True))
                request.prompt_logprobs.append(ep.TokenLogprob(targets[row], chosen[row], top, ranks[row]))
                row += 1

    def _sample(self, chunks: list[Chunk], logits: torch.Tensor) -> list[ep.Delta]:
        for chunk in chunks:
            chunk.seq.num_computed = chunk.start + len(chunk.token_ids)
        sampling = [c.seq for c in chunks if c.samples]
        deltas = []
        for seq in sampling:
            if seq.params.max_tokens == 0:  # the prompt only (echo): computed, nothing generated
                self.scheduler.finish(seq, "length")
                deltas.append(self._delta(seq, [], None))
                self._forget_if_done(seq.request)
        rows: list[SampleRow] = []
        row_of: list[int] = []  # logits row of each sample row
        choices: list[tuple[Sequence, int | None]] = []  # (sequence, index of a new choice or None)
        for i, seq in enumerate(sampling):
            if seq.params.max_tokens == 0:
                continue
            rows.append(SampleRow(seq.params, seq.generator, seq.tokens, seq.prompt_len, seq.matcher))
            row_of.append(i)
            choices.append((seq, None))
            request = seq.request
            if seq.index == 0 and len(request.sequences) == 1 and request.params.n > 1 and seq.num_generated == 0:
                for index in range(1, request.params.n):  # the other choices start from the same prompt logits
                    generator = choice_generator(seq.params, index, self.runner.device)
                    matcher = None if request.grammar is None else new_matcher(request.grammar)
                    rows.append(SampleRow(seq.params, generator, seq.tokens, seq.prompt_len, matcher))
                    row_of.append(i)
                    choices.append((seq, index))
        if not rows:
            return deltas
        whole = row_of == list(range(len(sampling)))
        picked = logits if whole else logits[torch.tensor(row_of, device=logits.device)]
        sampled = self.sampler(picked, rows)
        for (seq, new_index), row, token, logprob in zip(
            choices, rows, sampled.token_ids, sampled.logprobs, strict=False
        ):
            if new_index is not None:
                parent = seq
                seq = Sequence(
                    f"{parent.request.request_id}#{new_index}",
                    parent.request,
                    new_index,
                    list(parent.request.prompt),
                    row.generator,
                )
                seq.num_computed = seq.num_registered = seq.committed_tokens = parent.prompt_len
                seq.matcher = row.matcher
                parent.request.sequences.append(seq)
            seq.tokens.append(token)
            self.generated_tokens += 1
            if seq.matcher is not None and not seq.matcher.accept_token(token):
                # Only when other processing banned every token the grammar allows (min_tokens past its end...)
                log.warning("grammar_rejected_token", request_id=seq.request.request_id, token=token)
                reason: str | None = "error"
            else:
                reason = self._finish_reason(seq, token)
            if new_index is not None and reason is None:
                self.scheduler.fork(parent, seq)
            elif new_index is not None:
                seq.status, seq.finish_reason = Status.FINISHED, reason  # never needs blocks of its own
            elif reason is not None:
                self.scheduler.finish(seq, reason)
            deltas.append(self._delta(seq, [token], logprob))
            self._forget_if_done(seq.request)
        return deltas

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        if (token in self.eos and not params.ignore_eos) or token in params.stop_token_ids:
            return "stop"
        if seq.matcher is not None and seq.matcher.is_terminated():
            return "stop"
        if seq.num_generated >= params.max_tokens or len(seq.tokens) >= self.config.max_model_len:
            return "length"
        if len(seq.tokens) >= self.max_seq_tokens:
            return "length"  # it could not grow any further even alone in the cache
        return None

    def _forget_if_done(self, request: Request) -> None:
        if request.finished:
            self.requests.pop(request.request_id, None)

    def _delta(self, seq: Sequence, tokens: list[int], logprob) -> ep.Delta:
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
            logprobs=None if logprob is None else [ep.TokenLogprob(tokens[0], logprob[0], logprob[1])],
            finish_reason=seq.finish_reason,
            prompt_tokens=len(request.prompt),
            completion_tokens=seq.num_generated,
            cached_tokens=request.num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
        )


def _grammar_rejection(error: BaseException) -> tuple[str, str]:
    """(code, message) of the Rejected for a grammar that did not compile."""
    return ("invalid_grammar" if isinstance(error, GrammarRejected) else "structured_output_unavailable", str(error))
