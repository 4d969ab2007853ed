"""One prompt's generation: route it, submit it, turn the executor's token deltas into text events (a detokenizer
and a stop-string matcher per choice), and submit it again elsewhere when its executor is lost before anything was
shown (a slow executor is not a lost one: gateway/executors.py). What a client sees when: docs/architecture.md
("A request", "Executor health and failover").
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from executor import protocol as ep
from executor.params import SamplingParams
from gateway import errors
from gateway.executors import ExecutorLink, ExecutorLost, ExecutorUnavailable, StreamItem
from gateway.metrics import GatewayMetrics
from gateway.routing import Router
from gateway.text import Detokenizer, StopMatcher, Tokenizer

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


class _Choice:
    def __init__(self, detokenizer: Detokenizer, stops: Sequence[str], include_stop: bool) -> None:
        self.detokenizer = detokenizer
        self.stop = StopMatcher(stops, include_stop)
        self.finished = False
        self.tokens = 0
        self.last_token_at: float | None = None


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
    ) -> None:
        self.request_id = request_id
        self.prompt = list(prompt)
        self.params = params
        self.stops = list(stops)
        self.router = router
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.arrival = time.monotonic() if arrival is None else arrival
        # A whole (non-streamed) response has shown the client nothing yet: lost mid-way, it yields Restarted and
        # starts over elsewhere; a stream that has shown something cannot take it back (GenerationFailed).
        self.replayable = replayable
        self.output = output or OutputOptions()
        self.cache_salt = cache_salt
        self.report_cached_tokens = report_cached_tokens
        self.usage = Usage(prompt_tokens=len(self.prompt), report_cached=report_cached_tokens)
        self.executor: str | None = None  # the pool that served it
        self.first_token_at: float | None = None
        self.submitted_at: float | None = None  # first handed to an executor
        self._link: ExecutorLink | None = None
        self._submitted_id: str | None = None
        self._choices: list[_Choice] = []
        self._done = False
        # Asked with params.prompt_logprobs: one entry per prompt token after the first, from the first delta.
        self.prompt_logprobs: list[ep.TokenLogprob] | None = None

    async def events(self) -> AsyncIterator[ChoiceEvent | Restarted]:
        yielded = False
        tried: set[str] = set()
        attempt = 0
        try:
            while True:
                queue = await self._submit(tried, attempt)
                retry = False
                while not self._done:
                    item = await queue.get()
                    if isinstance(item, ExecutorLost) or (
                        type(item) is ep.Delta
                        and item.finish_reason == "abort"
                        and not self._choices[item.index].finished
                    ):
                        reason = item.reason if isinstance(item, ExecutorLost) else "it aborted the request"
                        if yielded and not self.replayable:
                            raise GenerationFailed(f"the executor serving this request was lost ({reason})")
                        retry = True
                        break
                    if type(item) is ep.Rejected:
                        retryable = item.code in (ep.RejectCode.CAPACITY_EXCEEDED, ep.RejectCode.QUEUE_FULL)
                        if retryable and len(self.router.healthy(tried | {self._endpoint})):
                            retry = True  # another executor may have a larger cache, or room in its queue
                            break
                        self._choices = []  # refused: nothing ran, nothing to count as aborted
                        if item.code == ep.RejectCode.INVALID_GRAMMAR and self.params.structured is not None:
                            raise errors.invalid_request(item.message, param=self.params.structured.param or None)
                        raise _REJECTIONS.get(item.code, errors.internal)(item.message)
                    event = self._on_delta(item)
                    if event is not None:
                        yielded = True
                        yield event
                if not retry:
                    return
                tried.add(self._endpoint)
                self._release()
                attempt += 1
                self.metrics.retries.inc()
                if yielded:
                    yielded = False
                    self.first_token_at = None
                    yield Restarted()
        finally:
            if not self._done:
                unfinished = sum(not c.finished for c in self._choices)
                if unfinished:
                    self.metrics.vllm.success("abort", unfinished)
            self._release(abort=not self._done)

    @property
    def _endpoint(self) -> str:
        assert self._link is not None
        return self._link.endpoint

    async def _submit(self, tried: set[str], attempt: int) -> asyncio.Queue[StreamItem]:
        while True:
            route = await self.router.choose(self.prompt, exclude=tried, cache_salt=self.cache_salt)
            if route is None:
                detail = "every executor is out of rotation" if not tried else "the executors tried were lost"
                raise errors.no_executor(detail)
            link = route.link
            submitted_id = self.request_id if attempt == 0 else f"{self.request_id}-retry{attempt}"
            try:
                queue = link.submit(submitted_id, self.prompt, self.params, self.cache_salt)
            except ExecutorUnavailable:
                tried.add(link.endpoint)
                continue
            self._link, self._submitted_id = link, submitted_id
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
            self.usage = Usage(prompt_tokens=len(self.prompt), report_cached=self.report_cached_tokens)
            self.metrics.routed.labels(executor=link.endpoint, policy=self.router.policy).inc()
            return queue

    def _on_delta(self, delta: ep.Delta) -> ChoiceEvent | None:
        choice = self._choices[delta.index]
        if choice.finished:
            return None  # tokens that were in flight when its stop string was found
        now = time.monotonic()
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.usage.cached_tokens = max(self.usage.cached_tokens, delta.cached_tokens)
        if delta.token_ids:
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
                self._abort_choice(delta.index)
        elif delta.finish_reason is not None:
            released += choice.stop.flush()
            if delta.finish_reason not in ("stop", "length"):
                raise GenerationFailed(f"the executor ended this request with {delta.finish_reason!r}")
            finish_reason = delta.finish_reason
        if finish_reason is not None:
            choice.finished = True
            self.metrics.vllm.success(finish_reason)
            if all(c.finished for c in self._choices):
                self._finish(now)
        if not released and not delta.logprobs and finish_reason is None:
            return None
        stop_string = choice.stop.stop_string if choice.stop.stopped else None
        return ChoiceEvent(delta.index, released, list(delta.logprobs or ()), finish_reason, stop_string)

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

    def _abort_choice(self, index: int) -> None:
        assert self._link is not None and self._submitted_id is not None
        if self.params.n == 1:
            self._link.abort(self._submitted_id)
        else:
            self._link.abort(self._submitted_id, index)

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

    def _release(self, abort: bool = False) -> None:
        """Stop listening for this submission; abort it at the executor if it is still going."""
        if self._link is None or self._submitted_id is None:
            return
        if abort:
            self._link.abort(self._submitted_id)
        else:
            self._link.release(self._submitted_id)
        self._link = None
        self._submitted_id = None
