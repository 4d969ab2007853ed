"""The engine: requests in, token deltas out, one step at a time.

It checks and queues requests, compiles structured-output grammars off the step's thread (a request enters the
scheduler once its grammar is ready; one that does not compile comes out of a later step as `Rejected`), and
runs the step loop (executor.step_loop) with the model half (executor.model_step). Single-threaded: the server
drives it and carries its deltas to gateways.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence as Seq
from concurrent import futures
from dataclasses import dataclass

import structlog
import torch

from blockd.client import BlockdClient, PoolClient
from common.auth import ClientCurve
from executor import protocol as ep
from executor.beam import BeamSearch
from executor.draft import DraftModelProposer
from executor.layer_groups import layer_groups
from executor.model_step import ModelStep
from executor.params import SamplingParams
from executor.runner import LoadedModel, ModelRunner
from executor.sampling import Sampler
from executor.scheduler import Scheduler
from executor.sequence import Request, Sequence, Status
from executor.speculative import NgramProposer, Proposer, SpeculativeConfig, SpeculativeConfigError, Speculator
from executor.step_loop import StepLoop
from executor.structured import GrammarRejected, Grammars, new_matcher
from executor.threads import ThreadGovernor
from pagedkv_kernels import cpu_native
from pagedkv_kernels.dispatch import Backend

log = structlog.get_logger("executor")


class RequestRejected(ValueError):
    def __init__(self, code: ep.RejectCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class EngineLimits:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_step_ms: float | None = None  # a step's target duration, which sizes its token budget; None: the cap only
    scheduling_policy: str = "fcfs"  # or "priority" (vLLM's): requests' priority orders the queue and preemption
    speculative: SpeculativeConfig | None = None  # --speculative-config (executor/speculative.py)


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
        if pool.num_groups != runner.groups.num_groups:
            raise ValueError(
                f"the pool has {pool.num_groups} layer group(s), the model's KV cache {runner.groups.num_groups}"
            )
        self.runner = runner
        self.pool = pool
        self.config = runner.config
        self.limits = limits
        # On the CPU, torch's thread team shrinks while other processes keep cores busy (executor.threads).
        cpu = runner.device.type == "cpu"
        threads = ThreadGovernor(torch.get_num_threads()) if cpu and adapt_threads else None
        self._threads = threads
        # ... and its worker threads stay each on one core (pagedkv_kernels.cpu_native.pin_workers).
        lib = cpu_native.library() if cpu and pin_threads else None
        if lib is not None:
            log.info("worker_threads_pinned", cpus=cpu_native.pin_workers(lib, torch.get_num_threads()))
        speculator = None
        if limits.speculative is not None:
            limits.speculative.check_block_size(runner.block_size)
            if runner.groups.num_groups > 1:  # (blockd's trim gives one table's room back, not a group's)
                raise SpeculativeConfigError(
                    "speculative decoding is not supported yet for a model mixing sliding-window and global layers"
                )
            speculator = _speculator(limits.speculative, runner)
        self.speculator = speculator
        self.model_step = ModelStep(
            runner,
            Sampler(runner.device, seed, eos_token_ids=self.config.eos_token_ids),
            pool.seqs,
            threads,
            speculator,
        )
        scheduler = Scheduler(
            num_blocks=runner.num_blocks,
            block_size=runner.block_size,
            max_num_seqs=limits.max_num_seqs,
            max_num_batched_tokens=limits.max_num_batched_tokens,
            blocks=pool,
            sliding_window=pool.sliding_window,
            groups=pool.groups,
            max_step_ms=limits.max_step_ms,
            policy=limits.scheduling_policy,
        )
        self.loop = StepLoop(
            scheduler,
            pool,
            self.model_step,
            eos_token_ids=self.config.eos_token_ids,
            max_model_len=self.config.max_model_len,
            speculator=speculator,
        )
        # Structured output: the compiled-grammar cache (made for the first such request), and the requests
        # whose grammar is still compiling, kept out of the scheduler until it is ready.
        self.grammars: Grammars | None = None
        self._compiling: dict[str, tuple[Sequence, futures.Future]] = {}
        self._beam_active: Request | None = None  # the beam search running: the others wait in _beam_queue
        self._beam_queue: deque[Sequence] = deque()  # their first beams

    @property
    def scheduler(self) -> Scheduler:
        return self.loop.scheduler

    @property
    def requests(self) -> dict[str, Request]:
        """The requests in progress, by id."""
        return self.loop.requests

    @property
    def steps(self) -> int:
        return self.loop.steps

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
        runner: ModelRunner | None = None,
    ) -> Engine:
        """The KV cache for a loaded model (or `runner`, one made already: a tensor-parallel group's rank 0), its
        pool client (not yet registered with blockd), the engine."""
        if runner is None:
            runner = ModelRunner(loaded, num_blocks=num_blocks, block_size=block_size, backend=backend)
        groups = layer_groups(loaded.config)
        pool = PoolClient(
            BlockdClient(blockd_endpoint, timeout_s=timeout_s, curve=curve),
            pool_id=pool_id,
            num_blocks=num_blocks,
            block_size=block_size,
            model_id=loaded.pool_model_id,
            retry_for_s=retry_for_s,
            sliding_window=groups.window,
            groups=groups.pool_groups,
        )
        return cls(runner, pool, limits, seed=seed, adapt_threads=adapt_threads, pin_threads=pin_threads)

    # ------------------------------------------------------------------------------------------ requests

    def add_request(
        self, request_id: str, prompt: Seq[int], params: SamplingParams, cache_salt: str | None = None
    ) -> None:
        """Queue a request, or raise RequestRejected (nothing else is affected)."""
        if request_id in self.requests:
            raise RequestRejected(ep.RejectCode.DUPLICATE_REQUEST, f"request {request_id!r} is already in progress")
        problem = params.validate(self.config.vocab_size)
        if problem:
            raise RequestRejected(ep.RejectCode.INVALID_REQUEST, problem)
        if params.priority != 0 and self.scheduler.policy != "priority":
            raise RequestRejected(
                ep.RejectCode.INVALID_REQUEST,
                "priority: this executor serves first come, first served (--scheduling-policy fcfs): leave priority "
                "at 0, or start the executors with --scheduling-policy priority",
            )
        prompt = list(prompt)
        if not prompt:
            raise RequestRejected(ep.RejectCode.INVALID_REQUEST, "the prompt is empty")
        vocab = self.config.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise RequestRejected(ep.RejectCode.INVALID_REQUEST, f"prompt token ids must be in [0, {vocab})")
        limit = self.config.max_model_len
        if len(prompt) >= limit:
            raise RequestRejected(
                ep.RejectCode.CONTEXT_LENGTH_EXCEEDED,
                f"the prompt has {len(prompt)} tokens; this model's context is {limit} tokens, "
                "including at least one to generate",
            )
        capacity = self.loop.max_prompt_tokens
        if len(prompt) + 1 > capacity:
            raise RequestRejected(
                ep.RejectCode.CAPACITY_EXCEEDED,
                f"the prompt has {len(prompt)} tokens; this executor's KV cache holds at most {capacity} "
                "tokens for one sequence",
            )
        request = Request(request_id, params, prompt, cache_salt, time.monotonic())
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = []
        first = self.model_step.new_choice(request, 0)  # (its grammar matcher comes once the grammar is compiled)
        request.sequences.append(first)
        if params.beam_search:
            limit = min(len(prompt) + params.max_tokens, self.loop.max_model_len, self.loop.max_seq_tokens)
            self._check_beam_room(params.beam_width, limit)
            stop = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.loop.eos)
            request.beam = BeamSearch.start(request, first, stop, limit)
            self.requests[request_id] = request
            self._beam_queue.append(first)  # one beam search at a time (docs/architecture.md, "Beam search")
            self._start_next_beam()
            return
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

    def _check_beam_room(self, width: int, limit: int) -> None:
        """A beam waits for its siblings' logprobs while holding its blocks: the search can always go on only if
        all its beams fit at once, unshared, at their longest (each with its reserved room)."""
        s = self.scheduler
        need = width * (-(-limit // s.block_size) + 2)
        if need > s.num_blocks - s.watermark:
            raise RequestRejected(
                ep.RejectCode.CAPACITY_EXCEEDED,
                f"beam search of width {width} over up to {limit} tokens needs up to {need} blocks; this executor's "
                f"KV cache holds {s.num_blocks - s.watermark}: fewer beams or max_tokens",
            )

    def _start_next_beam(self) -> None:
        """Once the running beam search is over, the next one queued starts (aborted ones are skipped)."""
        active = self._beam_active
        if active is not None and self.requests.get(active.request_id) is active and not active.beam.done:
            return
        self._beam_active = None
        while self._beam_queue:
            first = self._beam_queue.popleft()
            request = first.request
            if self.requests.get(request.request_id) is request and not request.beam.done:
                self._beam_active = request
                self.scheduler.add(first)
                return

    def abort(self, request_id: str, index: int | None = None) -> list[ep.Delta]:
        """Stop a request, or only its choice `index` (executor.step_loop.StepLoop.abort)."""
        request = self.requests.get(request_id)
        if request is not None and (index is None or request.params.n == 1):
            self._compiling.pop(request_id, None)  # (a choice of a request still compiling was never forked)
        deltas = self.loop.abort(request_id, index)
        if self._threads is not None and not self.has_work():
            self._threads.idle()
        return deltas

    def has_work(self) -> bool:
        return self.loop.has_work() or bool(self._compiling) or bool(self._beam_queue)

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
            steps=self.loop.steps,
            blockd_reachable=self.loop.blockd_reachable,
            busy_s=round(s.step_budget.busy_s, 4),
            computed_tokens=s.step_budget.computed_tokens,
            step_token_budget=s.step_budget.tokens(),
            tiers=self.model_step.tiers.report() if self.model_step.tiers is not None else {},
            **self._spec_load(),
        )

    def _spec_load(self) -> dict[str, int]:
        if self.speculator is None:
            return {}
        stats = self.speculator.stats
        return {
            "spec_drafts": stats.drafts,
            "spec_proposed_tokens": stats.proposed_tokens,
            "spec_accepted_tokens": stats.accepted_tokens,
        }

    # ------------------------------------------------------------------------------------------ the step

    def step(self) -> list[ep.Delta | ep.Rejected]:
        """Run one step; raises BlockdUnavailable (the step stays pending, nothing is lost) if blockd is away.
        Besides deltas, it returns `Rejected` for requests whose structured-output grammar did not compile."""
        report = self.loop.step()
        if self._beam_queue:
            self._start_next_beam()
        if self._threads is not None and not self.has_work():
            self._threads.idle()  # what others do until the next request is not what the next steps meet
        if self._compiling:  # admitted here, after the step's blockd call: a rejection is never lost to its failure
            if not report.chunks:  # nothing else to do: wait a little for a grammar rather than spin
                futures.wait(
                    [f for _, f in self._compiling.values()], timeout=0.01, return_when=futures.FIRST_COMPLETED
                )
            return [*report.deltas, *self._admit_compiled()]
        return list(report.deltas)


def _speculator(config: SpeculativeConfig, runner: ModelRunner) -> Speculator:
    """The speculator of `--speculative-config`: n-gram lookup, or a draft model loaded beside the target's runner
    (its device, block size, KV blocks and vocabulary: executor.draft)."""
    proposer: Proposer
    if config.method == "ngram":
        proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    else:
        assert config.model is not None
        proposer = DraftModelProposer.beside(config.model, runner)
    return Speculator(config, proposer, runner.config.max_model_len)


def _grammar_rejection(error: BaseException) -> tuple[ep.RejectCode, str]:
    """(code, message) of the Rejected for a grammar that did not compile."""
    code = (
        ep.RejectCode.INVALID_GRAMMAR
        if isinstance(error, GrammarRejected)
        else ep.RejectCode.STRUCTURED_OUTPUT_UNAVAILABLE
    )
    return code, str(error)
