"""The model half of a step (an `executor.step_loop.StepModel`): the forward pass, prompt logprobs, sampling."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from blockd.client import MirroredSequence
from blockd.tiers import TierOp
from executor import protocol as ep
from executor.runner import ModelRunner
from executor.sampling import Sampler, SampleRow, choice_generator
from executor.scheduler import Chunk
from executor.sequence import Request, Sequence
from executor.step_loop import Draw
from executor.structured import new_matcher
from executor.threads import ThreadGovernor
from executor.tier_store import TierStore


class ModelStep:
    def __init__(
        self,
        runner: ModelRunner,
        sampler: Sampler,
        tables: Mapping[str, MirroredSequence],
        threads: ThreadGovernor | None = None,
    ) -> None:
        self.runner = runner
        self.sampler = sampler
        self.tables = tables  # the block tables the forward pass reads: the pool client's mirror
        self.threads = threads
        self.tiers: TierStore | None = None  # the lower KV tiers (--host-kv-memory, --disk-kv-dir), if any

    def move_tiers(self, ops: list[TierOp]) -> list[int]:
        if self.tiers is None:
            raise RuntimeError("blockd sent tier moves to an executor without tiers")
        return self.tiers.run(ops)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        self.runner.copy_blocks(pairs)

    def new_choice(self, request: Request, index: int) -> Sequence:
        generator = choice_generator(request.params, index, self.runner.device)
        seq = Sequence(f"{request.request_id}#{index}", request, index, list(request.prompt), generator)
        if request.grammar is not None:
            seq.matcher = new_matcher(request.grammar)
        return seq

    def run(self, chunks: list[Chunk], rows: list[tuple[Sequence, Chunk]]) -> list[Draw]:
        if self.threads is not None:
            self.threads.step()
        logits = self.runner.execute(chunks, self.tables)
        sampling = [c for c in chunks if c.samples]  # their rows come first, in order
        if logits.shape[0] > len(sampling):
            self._score_prompts(chunks, logits[len(sampling) :])
        if not rows:
            return []
        row_of = {id(c): i for i, c in enumerate(sampling)}
        index = [row_of[id(chunk)] for _, chunk in rows]
        picked = logits[: len(sampling)]
        if index != list(range(len(sampling))):  # (an echo row skipped, or new choices drawing from one row)
            picked = picked[torch.tensor(index, device=logits.device)]
        beams = [i for i, (seq, _) in enumerate(rows) if seq.params.beam_search]
        if not beams:
            return self._sample(picked, rows)
        # Beam search rows draw nothing: their logprobs go to executor.beam, which ranks every beam's together.
        draws: list[Draw | None] = [None] * len(rows)
        logprobs = torch.log_softmax(picked[beams].float(), dim=-1)
        for j, i in enumerate(beams):
            draws[i] = Draw(-1, beam_logprobs=logprobs[j])
        others = [i for i in range(len(rows)) if draws[i] is None]
        if others:
            for i, draw in zip(others, self._sample(picked[others], [rows[i] for i in others]), strict=True):
                draws[i] = draw
        return [draw for draw in draws if draw is not None]

    def _sample(self, logits: torch.Tensor, rows: list[tuple[Sequence, Chunk]]) -> list[Draw]:
        sampled = self.sampler(
            logits, [SampleRow(seq.params, seq.generator, seq.tokens, seq.prompt_len, seq.matcher) for seq, _ in rows]
        )
        return [Draw(t, lp) for t, lp in zip(sampled.token_ids, sampled.logprobs, strict=True)]

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
