"""Beam search on blockd forks: one request's beams, scored as transformers' `generate(num_beams=k,
do_sample=False)` scores them, each beam a sequence whose history's blocks it shares with its siblings.

Each round waits until every live beam has its next-token logprobs (normally all in one step), then keeps the k
best continuations of the 2k most likely: a beam continued once goes on as itself, one continued c times forks
c - 1 children (blockd shares the blocks of its registered tokens; the first write into the shared open block
copies that block alone), a beam not continued is freed. A continuation that ends (an end-of-sequence or stop
token, or the length limit) among the k best becomes a finished hypothesis, scored by its logprob divided by
(generated tokens ** length_penalty); the request ends as transformers' stopping rule says (`early_stopping`:
True, False or "never"), and its n best hypotheses are sent, each whole, in one delta. The design is in
docs/architecture.md ("Beam search").
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from executor import protocol as ep
from executor.sequence import Request, Sequence, Status

if TYPE_CHECKING:
    from executor.scheduler import Scheduler

_DROPPED = -1.0e9  # transformers' score of a continuation that may not run on


@dataclass
class Hypothesis:
    """A finished beam: its generated tokens, its length-penalised score and its cumulative logprob."""

    tokens: list[int]
    score: float
    logprob: float
    finish_reason: str


@dataclass
class _Beam:
    seq: Sequence
    logprob: float  # cumulative, over its generated tokens


@dataclass
class _Continuation:
    parent: int  # index into the running beams
    token: int
    logprob: float  # the parent's cumulative logprob plus this token's
    ends: bool


@dataclass
class BeamSearch:
    """One request's beam search: its running beams, its finished hypotheses and the logprobs of this round."""

    request: Request
    stop_tokens: frozenset[int]
    limit: int  # the longest a beam may grow (prompt and generated tokens)
    running: list[_Beam] = field(default_factory=list)  # best first, as transformers orders them
    finished: list[Hypothesis] = field(default_factory=list)  # best first, at most the width
    done: bool = False
    _pending: dict[int, torch.Tensor] = field(default_factory=dict)  # id(seq) -> its next-token logprobs
    _improvable: bool = True  # transformers' early-stop heuristic has not yet said no beam can do better
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1))

    @classmethod
    def start(cls, request: Request, first: Sequence, stop_tokens: frozenset[int], limit: int) -> BeamSearch:
        search = cls(request, stop_tokens, limit)
        search.running.append(_Beam(first, 0.0))
        return search

    @property
    def width(self) -> int:
        return self.request.params.beam_width

    def take(self, seq: Sequence, logprobs: torch.Tensor, scheduler: Scheduler) -> list[ep.Delta]:
        """`seq`'s next-token logprobs; once every running beam has its own, the round is played: the beams are
        continued, forked and freed through `scheduler`, and once the search ends its deltas are returned."""
        if self.done or all(beam.seq is not seq for beam in self.running):
            return []
        self._pending[id(seq)] = logprobs
        if len(self._pending) < len(self.running):
            return []
        continuations = self._round()
        self._pending.clear()
        if self.done:
            return self._finish(scheduler)
        self._continue(continuations, scheduler)
        return []

    def abort(self, scheduler: Scheduler) -> list[ep.Delta]:
        """Stop the search: every beam's blocks go back, each of the n choices ends with "abort"."""
        self.done = True
        for beam in self.running:
            scheduler.finish(beam.seq, "abort")
        request = self.request
        return [
            ep.Delta(
                request_id=request.request_id,
                index=i,
                token_ids=[],
                finish_reason="abort",
                prompt_tokens=len(request.prompt),
                cached_tokens=request.num_cached_tokens,
            )
            for i in range(request.params.n)
        ]

    # ------------------------------------------------------------------------------------------ scoring

    def _round(self) -> list[_Continuation]:
        """transformers' step of `_beam_search`: the top (1 + stop tokens) * k continuations, the k best that do not
        end run on, those that end among the first k are scored as finished; then the stopping rule."""
        params = self.request.params
        k, penalty, early = self.width, params.length_penalty, params.early_stopping
        beams = self.running
        logprobs = torch.stack([self._pending[id(beam.seq)] for beam in beams])
        scores = torch.tensor([beam.logprob for beam in beams], dtype=logprobs.dtype, device=logprobs.device)
        accumulated = (logprobs + scores[:, None]).flatten()
        keep = min(max(2, 1 + len(self.stop_tokens)) * k, accumulated.numel())
        top, index = torch.topk(accumulated, keep)
        vocab = logprobs.shape[1]
        length = len(beams[0].seq.tokens)  # every beam has as many tokens: a round adds one to each
        at_limit = length + 1 >= self.limit
        candidates = [
            _Continuation(i // vocab, i % vocab, lp, at_limit or i % vocab in self.stop_tokens)
            for lp, i in zip(top.tolist(), index.tolist(), strict=True)
        ]
        prompt_len = len(self.request.prompt)
        if self._improvable and not (early is True and len(self.finished) == k):
            generated = length + 1 - prompt_len
            for c in candidates[:k]:
                if c.ends:
                    tokens = [*beams[c.parent].seq.tokens[prompt_len:], c.token]
                    reason = "length" if c.token not in self.stop_tokens else "stop"
                    self.finished.append(Hypothesis(tokens, c.logprob / generated**penalty, c.logprob, reason))
            self.finished.sort(key=lambda h: -h.score)  # (stable: an earlier one first among equals)
            del self.finished[k:]
        going = [c for c in candidates if not c.ends][:k]
        if len(self.finished) == k:
            best = going[0].logprob if going else _DROPPED
            hypothetical = (self.limit if early == "never" and penalty > 0.0 else length + 1) - prompt_len
            self._improvable = self._improvable and best / hypothetical**penalty > self.finished[-1].score
        full = len(self.finished) == k and early is True
        self.done = not self._improvable or full or not going
        return going

    # ------------------------------------------------------------------------------------------ the beams

    def _continue(self, continuations: list[_Continuation], scheduler: Scheduler) -> None:
        """The next round's beams, in rank order: a parent's first continuation is the parent itself, its others
        forks made before its token is added; a beam with none is freed."""
        old = self.running
        owned: set[int] = set()
        beams: list[_Beam] = []
        appended: list[tuple[Sequence, int]] = []
        for c in continuations:
            parent = old[c.parent].seq
            if c.parent in owned:
                beams.append(_Beam(self._fork(parent, c.token, scheduler), c.logprob))
            else:
                owned.add(c.parent)
                beams.append(_Beam(parent, c.logprob))
                appended.append((parent, c.token))
        for seq, token in appended:
            seq.tokens.append(token)
        for i, beam in enumerate(old):
            if i not in owned:
                scheduler.finish(beam.seq, "abort")  # dropped: its own blocks go back, shared ones stay
        self.running = beams

    def _fork(self, parent: Sequence, token: int, scheduler: Scheduler) -> Sequence:
        request = self.request
        child = Sequence(f"{request.request_id}#beam{next(self._ids)}", request, 0, [*parent.tokens, token], None)
        request.sequences.append(child)
        if parent.status is Status.RUNNING and parent.fork_parent is None:
            # It shares the blocks of the parent's registered tokens; the parent's tokens computed past them lie in
            # its reserved slots, which a fork does not share: the child computes those again.
            child.num_computed = min(parent.num_computed, scheduler.registered(parent))
            child.committed_tokens = min(parent.committed_tokens, child.num_computed)
            scheduler.fork(parent, child)
        else:  # the parent is not in blockd (preempted): the child is admitted alone, its history a prefix hit
            scheduler.add(child)
        return child

    def _finish(self, scheduler: Scheduler) -> list[ep.Delta]:
        for beam in self.running:
            scheduler.finish(beam.seq, "stop")
        request = self.request
        return [
            ep.Delta(
                request_id=request.request_id,
                index=i,
                token_ids=hypothesis.tokens,
                finish_reason=hypothesis.finish_reason,
                prompt_tokens=len(request.prompt),
                completion_tokens=len(hypothesis.tokens),
                cached_tokens=request.num_cached_tokens,
            )
            for i, hypothesis in enumerate(self.finished[: request.params.n])
        ]
