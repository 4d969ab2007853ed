"""One prompt's generation: route it, submit it, turn the executor's token deltas into text events (a detokenizer
and a stop-string matcher per choice), and submit it again elsewhere when its executor is lost before anything was
shown, or continue its choices on another executor from the tokens they already have (gateway/migration.py) when
it is lost mid-generation (a slow executor is not a lost one: gateway/executors.py). What a client sees when:
docs/architecture.md ("A request", "Executor health and failover").
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import structlog

from executor import protocol as ep
from executor.params import SamplingParams
from gateway import errors, migration
from gateway.executors import ExecutorLink, ExecutorLost, ExecutorUnavailable, StreamItem
from gateway.metrics import GatewayMetrics
from gateway.routing import Route, Router
from gateway.text import Detokenizer, StopMatcher, Tokenizer

log = structlog.get_logger("gateway")

# The executor's refusals a client caused, as the client's errors; any other code is ours (500).
_REJECTIONS = {
    # (a message that starts by naming its parameter, "priority: ...", names it for the client too)
    ep.RejectCode.INVALID_REQUEST: lambda m: errors.invalid_request(m, param=_named(m)),
    ep.RejectCode.CONTEXT_LENGTH_EXCEEDED: lambda m: errors.context_length_exceeded(m),
    ep.RejectCode.CAPACITY_EXCEEDED: lambda m: errors.context_length_exceeded(m),
    # The executor holds --max-queued-requests already: refused before anything ran, as the door would have.
    ep.RejectCode.QUEUE_FULL: lambda m: errors.APIError(429, m, type="rate_limit_error", code="queue_full"),
}


def _named(message: str) -> str | None:
    head, colon, _ = message.partition(": ")
    return head if colon and head.isidentifier() else None


class GenerationFailed(RuntimeError):
    """The generation broke after it had started streaming."""


@dataclass
class ChoiceEvent:
    index: int
    text: str
    logprobs: list[ep.TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length"
    stop_string: str | None = None  # the stop string that ended the choice (finish_reason "stop"), if one did


@dataclass(frozen=True)
class Restarted:
    """The events yielded so far are void: the generation starts again on another executor."""


@dataclass(frozen=True)
class OutputOptions:
    """How the tokens of a choice become its text (vLLM's output settings)."""

    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # the stop string, or the stop token's text, stays in the text


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    report_cached: bool = True  # False: cached_tokens stays out of the response (it tells of others' prompts)


@dataclass
class _Submission:
    """One request at an executor: the whole generation's choices, or one choice continued there."""

    link: ExecutorLink
    request_id: str
    choices: list[int]  # the generation's index of each of the executor's choices
    original: bool  # the first submission of the prompt (its cached tokens, its prompt logprobs are the client's)


class _Choice:
    def __init__(self, detokenizer: Detokenizer, stops: Sequence[str], include_stop: bool) -> None:
        self.detokenizer = detokenizer
        self.stop = StopMatcher(stops, include_stop)
        self.finished = False
        self.tokens = 0
        self.token_ids: list[int] = []  # every token the executors generated for it: what a continuation follows
        self.last_token_at: float | None = None
        self.submission: _Submission | None = None  # where it is generated now
        self.remote_index = 0  # its index there


class Generation:
    def __init__(
        self,
        *,
        request_id: str,
        prompt: Sequence[int],
        params: SamplingParams,
        stops: Sequence[str],
        router: Router,
        tokenizer: Tokenizer,
        metrics: GatewayMetrics,
        arrival: float | None = None,
        replayable: bool = False,
        output: OutputOptions | None = None,
        cache_salt: str | None = None,
        report_cached_tokens: bool = True,
        max_migrations: int = migration.DEFAULT_MAX_MIGRATIONS,
    ) -> None:
        self.request_id = request_id
        self.prompt = list(prompt)
        self.params = params
        self.stops = list(stops)
        self.router = router
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.arrival = time.monotonic() if arrival is None else arrival
        # A whole (non-streamed) response has shown the client nothing yet: lost mid-way where it cannot migrate,
        # it yields Restarted and starts over elsewhere; such a stream cannot take back what it showed.
        self.replayable = replayable
        self.output = output or OutputOptions()
        self.cache_salt = cache_salt
        self.report_cached_tokens = report_cached_tokens
        self.max_migrations = max_migrations
        self.migrations = 0  # times its choices were continued elsewhere
        self._attempt = 0  # times it was submitted again from its prompt
        self._why_not_migrated = ""  # the last migration refused, for the client's error
        self.usage = Usage(prompt_tokens=len(self.prompt), report_cached=report_cached_tokens)
        self.executor: str | None = None  # the pool that served it
        self.first_token_at: float | None = None
        self.submitted_at: float | None = None  # first handed to an executor
        # Every submission's items come on this one queue, told apart by request id.
        self._queue: asyncio.Queue[StreamItem] = asyncio.Queue()
        self._submissions: dict[str, _Submission] = {}
        self._choices: list[_Choice] = []
        self._done = False
        # Asked with params.prompt_logprobs: one entry per prompt token after the first, from the first delta.
        self.prompt_logprobs: list[ep.TokenLogprob] | None = None

    async def events(self) -> AsyncIterator[ChoiceEvent | Restarted]:
        yielded = False
        tried: set[str] = set()
        try:
            await self._submit(tried)
            while not self._done:
                item = await self._queue.get()
                submission = self._submissions.get(item.request_id)
                if submission is None:
                    continue  # from a submission let go of (its choices finished, or continued elsewhere)
                lost = self._lost(item, submission)
                if lost is not None:
                    if yielded:
                        events = await self._migrate(submission, lost)
                        if events is not None:
                            for event in events:
                                yield event
                            continue
                        if not self.replayable:
                            raise GenerationFailed(
                                f"the executor serving this request was lost ({lost}) and {self._why_not_migrated}"
                            )
                    if yielded:
                        yielded = False
                        self.first_token_at = None
                        yield Restarted()
                    await self._start_over(submission, tried)
                    continue
                if type(item) is ep.Rejected:
                    retryable = item.code in (ep.RejectCode.CAPACITY_EXCEEDED, ep.RejectCode.QUEUE_FULL)
                    if retryable and len(self.router.healthy(tried | {submission.link.endpoint})):
                        await self._start_over(submission, tried)  # another may have a larger cache, or room
                        continue
                    self._choices = []  # refused: nothing ran, nothing to count as aborted
                    if item.code == ep.RejectCode.INVALID_GRAMMAR and self.params.structured is not None:
                        raise errors.invalid_request(item.message, param=self.params.structured.param or None)
                    raise _REJECTIONS.get(item.code, errors.internal)(item.message)
                assert type(item) is ep.Delta
                event = self._on_delta(submission.choices[item.index], item, submission.original)
                if event is not None:
                    yielded = True
                    yield event
        finally:
            if not self._done:
                unfinished = sum(not c.finished for c in self._choices)
                if unfinished:
                    self.metrics.vllm.success("abort", unfinished)
            self._release_all(abort=not self._done)

    def _lost(self, item: StreamItem, submission: _Submission) -> str | None:
        """Why `item` says this submission's choices will get no more tokens there, or None."""
        if isinstance(item, ExecutorLost):
            return item.reason
        if (
            type(item) is ep.Delta
            and item.finish_reason == "abort"
            and not self._choices[submission.choices[item.index]].finished
        ):
            return "it aborted the request"
        if type(item) is ep.Rejected and not submission.original:
            return f"a continuation was refused there: {item.code}: {item.message}"
        return None

    async def _start_over(self, submission: _Submission, tried: set[str]) -> None:
        """The whole generation submitted again to an executor not tried, all of this try let go of."""
        tried.add(submission.link.endpoint)
        self._drop(submission)  # lost or refused there: nothing runs there for it
        self._release_all(abort=True)  # continuations of other choices, if any
        self._attempt += 1
        self.metrics.retries.inc()
        await self._submit(tried)

    async def _submit(self, tried: set[str]) -> None:
        """The whole generation, from its prompt, to an executor not tried."""
        attempt = self._attempt
        while True:
            route = await self.router.choose(self.prompt, exclude=tried, cache_salt=self.cache_salt)
            if route is None:
                detail = "every executor is out of rotation" if not tried else "the executors tried were lost"
                raise errors.no_executor(detail)
            link = route.link
            submitted_id = self.request_id if attempt == 0 else f"{self.request_id}-retry{attempt}"
            try:
                link.submit(submitted_id, self.prompt, self.params, self.cache_salt, self._queue)
            except ExecutorUnavailable:
                tried.add(link.endpoint)
                continue
            submission = _Submission(link, submitted_id, list(range(self.params.n)), original=True)
            self._submissions[submitted_id] = submission
            if self.submitted_at is None:
                self.submitted_at = time.monotonic()
            self.executor = link.pool_id
            out = self.output
            self._choices = [
                _Choice(
                    self.tokenizer.detokenizer(self.prompt, out.skip_special_tokens),
                    self.stops,
                    out.include_stop_str_in_output,
                )
                for _ in range(self.params.n)
            ]
            for index, choice in enumerate(self._choices):
                choice.submission, choice.remote_index = submission, index
            self.usage = Usage(prompt_tokens=len(self.prompt), report_cached=self.report_cached_tokens)
            self._routed(route)
            return

    async def _migrate(self, lost: _Submission, reason: str) -> list[ChoiceEvent] | None:
        """Continue the unfinished choices of a lost submission on other executors, each from the prompt plus its
        own tokens; the events of choices that had nothing left to generate. None if they cannot continue
        (`_why_not_migrated` says why): the caller starts over or fails."""
        self._drop(lost)
        unfinished = [c for c in lost.choices if not self._choices[c].finished]
        if not unfinished:
            return []
        refused = migration.refusal(self.params)
        if refused is not None or self.migrations >= self.max_migrations:
            self._why_not_migrated = (
                f"it cannot continue elsewhere: {refused}"
                if refused is not None
                else f"it was continued elsewhere {self.migrations} times already (--max-migrations)"
            )
            self.metrics.failed_migrations.labels(reason="refused" if refused else "limit").inc()
            return None
        self.migrations += 1
        events: list[ChoiceEvent] = []
        for index in unfinished:
            choice = self._choices[index]
            params = migration.continuation(self.params, index, choice.token_ids, self.migrations)
            if params is None:  # every token it may have was out; only its finish was lost
                finish = ep.Delta(request_id=lost.request_id, index=0, token_ids=[], finish_reason="length")
                event = self._on_delta(index, finish, original=False)
                events += [event] if event is not None else []
                continue
            if not await self._continue(index, params, exclude={lost.link.endpoint}):
                self.metrics.failed_migrations.labels(reason="no_executor").inc()
                self._why_not_migrated = "no other executor is in rotation to continue it"
                return None
            log.info(
                "request_migrated",
                request_id=self.request_id,
                choice=index,
                lost=lost.link.endpoint,
                to=choice.submission.link.endpoint if choice.submission else None,
                tokens=len(choice.token_ids),
                reason=reason,
            )
        self.metrics.migrations.inc()
        return events

    async def _continue(self, index: int, params: SamplingParams, exclude: set[str]) -> bool:
        """Submit choice `index`'s continuation to an executor not in `exclude`; False if none is left."""
        choice = self._choices[index]
        prompt = self.prompt + choice.token_ids
        while True:
            route = await self.router.choose(prompt, exclude=exclude, cache_salt=self.cache_salt)
            if route is None:
                return False
            link = route.link
            submitted_id = f"{self.request_id}-m{self.migrations}-{index}"
            try:
                link.submit(submitted_id, prompt, params, self.cache_salt, self._queue)
            except ExecutorUnavailable:
                exclude.add(link.endpoint)
                continue
            submission = _Submission(link, submitted_id, [index], original=False)
            self._submissions[submitted_id] = submission
            choice.submission, choice.remote_index = submission, 0
            self._routed(route)
            return True

    def _on_delta(self, index: int, delta: ep.Delta, original: bool) -> ChoiceEvent | None:
        choice = self._choices[index]
        if choice.finished:
            return None  # tokens that were in flight when its stop string was found
        now = time.monotonic()
        if original:  # a continuation's prompt holds the generated tokens: its hits and logprobs are not the client's
            if delta.prompt_logprobs is not None:
                self.prompt_logprobs = delta.prompt_logprobs
            self.usage.cached_tokens = max(self.usage.cached_tokens, delta.cached_tokens)
        if delta.token_ids:
            choice.token_ids += delta.token_ids
            self._count_tokens(choice, len(delta.token_ids), now)
        shown = delta.token_ids
        if delta.finish_reason == "stop" and shown and not self.output.include_stop_str_in_output:
            shown = shown[:-1]  # the executor stopped on this token (EOS or a stop token id): not part of the text
        text = choice.detokenizer.add(shown)
        if delta.finish_reason is not None:
            text += choice.detokenizer.flush()
        released = choice.stop.feed(text)
        finish_reason = None
        if choice.stop.stopped:
            finish_reason = "stop"
            if delta.finish_reason is None:
                self._abort_choice(choice)
        elif delta.finish_reason is not None:
            released += choice.stop.flush()
            if delta.finish_reason not in ("stop", "length"):
                raise GenerationFailed(f"the executor ended this request with {delta.finish_reason!r}")
            finish_reason = delta.finish_reason
        if finish_reason is not None:
            choice.finished = True
            self.metrics.vllm.success(finish_reason)
            self._let_go_if_finished(choice.submission)
            if all(c.finished for c in self._choices):
                self._finish(now)
        if not released and not delta.logprobs and finish_reason is None:
            return None
        stop_string = choice.stop.stop_string if choice.stop.stopped else None
        return ChoiceEvent(index, released, list(delta.logprobs or ()), finish_reason, stop_string)

    def _count_tokens(self, choice: _Choice, count: int, now: float) -> None:
        if self.first_token_at is None:
            self.first_token_at = now
            self.metrics.ttft.observe(now - self.arrival)
        elif choice.last_token_at is not None:
            self.metrics.itl.observe(now - choice.last_token_at)
        choice.last_token_at = now
        choice.tokens += count
        self.usage.completion_tokens += count
        self.metrics.generated_tokens.inc(count)

    def _abort_choice(self, choice: _Choice) -> None:
        submission = choice.submission
        if submission is None:
            return
        if len(submission.choices) == 1:
            submission.link.abort(submission.request_id)
            self._submissions.pop(submission.request_id, None)
        else:
            submission.link.abort(submission.request_id, choice.remote_index)

    def _let_go_if_finished(self, submission: _Submission | None) -> None:
        """Once every choice a submission generates is finished, its later items are not listened for."""
        if submission is None or submission.request_id not in self._submissions:
            return
        if all(self._choices[c].finished for c in submission.choices):
            self._drop(submission)

    def _finish(self, now: float) -> None:
        self._done = True
        self.metrics.e2e.observe(now - self.arrival)
        self.metrics.prompt_tokens.inc(self.usage.prompt_tokens)
        self.metrics.cached_tokens.inc(self.usage.cached_tokens)
        vllm, usage = self.metrics.vllm, self.usage
        submitted = self.submitted_at if self.submitted_at is not None else self.arrival
        first = self.first_token_at if self.first_token_at is not None else now
        vllm.queue.observe(submitted - self.arrival)
        vllm.prefill.observe(first - submitted)
        vllm.decode.observe(now - first)
        vllm.inference.observe(now - submitted)
        vllm.request_prompt_tokens.observe(usage.prompt_tokens)
        vllm.request_generation_tokens.observe(usage.completion_tokens)

    def _routed(self, route: Route) -> None:
        """Count where a submission went, and why (where its prompt's K/V was there: gateway.routing)."""
        link = route.link
        self.metrics.routed.labels(executor=link.endpoint, policy=self.router.policy).inc()
        if route.tier is not None:
            self.metrics.routed_by_tier.labels(tier=route.tier).inc()
            log.debug(
                "request_routed",
                request_id=self.request_id,
                executor=link.pool_id,
                tier=route.tier,
                expected_cached_tokens=route.expected_cached_tokens,
            )

    def _drop(self, submission: _Submission, abort: bool = False) -> None:
        """Stop listening for this submission; abort it at the executor if it may still be going."""
        self._submissions.pop(submission.request_id, None)
        if abort:
            submission.link.abort(submission.request_id)
        else:
            submission.link.release(submission.request_id)

    def _release_all(self, abort: bool = False) -> None:
        for submission in list(self._submissions.values()):
            self._drop(submission, abort)
