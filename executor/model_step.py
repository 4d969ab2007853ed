"""The model half of a step (an `executor.step_loop.StepModel`): the forward pass, prompt logprobs, sampling."""

from __future__ import annotations

import itertools
from collections.abc import Collection, Mapping

import torch

from blockd.client import MirroredSequence
from blockd.tiers import TierOp
from executor import protocol as ep
from executor.runner import ModelRunner
from executor.sampling import Sampler, SampleRow, choice_generator
from executor.scheduler import Chunk
from executor.sequence import Request, Sequence
from executor.speculative import Speculator
from executor.step_loop import Draw
from executor.structured import new_matcher
from executor.threads import ThreadGovernor
from executor.tier_store import Landed, Moved, TierStore


class ModelStep:
    def __init__(
        self,
        runner: ModelRunner,
        sampler: Sampler,
        tables: Mapping[str, MirroredSequence],
        threads: ThreadGovernor | None = None,
        speculator: Speculator | None = None,
    ) -> None:
        self.runner = runner
        self.sampler = sampler
        self.tables = tables  # the block tables the forward pass reads: the pool client's mirror
        self.threads = threads
        self.speculator = speculator  # speculative decoding: proposes drafts, counts what verification accepts
        self.tiers: TierStore | None = None  # the lower KV tiers (--host-kv-memory, --disk-kv-dir), if any

    def move_tiers(self, ops: list[TierOp]) -> Moved:
        if self.tiers is None:
            raise RuntimeError("blockd sent tier moves to an executor without tiers")
        return self.tiers.run(ops)

    def land_loads(self, keep: Collection[int], wait_s: float = 0.0) -> Landed:
        assert self.tiers is not None  # (only a store's `run` hands out tickets)
        return self.tiers.land(keep, wait_s=wait_s)

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
        row_of: dict[int, int] = {}  # the sampling chunks' rows come first, in order: 1 + len(draft) each
        width = 0
        for c in chunks:
            if c.samples:
                row_of[id(c)] = width
                width += 1 + len(c.draft)
        if logits.shape[0] > width:
            self._score_prompts(chunks, logits[width:])
        if not rows:
            return []
        index: list[int] = []
        sample_rows: list[SampleRow] = []
        for seq, chunk in rows:
            first = row_of[id(chunk)]
            index.append(first)
            sample_rows.append(SampleRow(seq.params, seq.generator, seq.tokens, seq.prompt_len, seq.matcher))
            for i in range(len(chunk.draft)):  # row i + 1 samples the token after draft[:i + 1]
                index.append(first + 1 + i)
                context = seq.tokens + chunk.draft[: i + 1] if seq.params.processes_logits else seq.tokens
                sample_rows.append(SampleRow(seq.params, seq.generator, context, seq.prompt_len))
        picked = logits[:width]
        if index != list(range(width)):  # (an echo row skipped, or new choices drawing from one row)
            picked = picked[torch.tensor(index, device=logits.device)]
        # Beam search rows draw nothing: their logprobs go to executor.beam, which ranks every beam's together
        # (the speculator drafts nothing for them, so each has one row).
        beams = {i for i, (seq, _) in enumerate(rows) if seq.params.beam_search}
        beam_logprobs = iter(())
        if beams:
            firsts = list(itertools.accumulate((1 + len(chunk.draft) for _, chunk in rows), initial=0))
            beam_at = [firsts[i] for i in sorted(beams)]
            beam_logprobs = iter(torch.log_softmax(picked[beam_at].float(), dim=-1))
            keep = [j for i in range(len(rows)) if i not in beams for j in range(firsts[i], firsts[i + 1])]
            picked, sample_rows = picked[keep], [sample_rows[j] for j in keep]
        draws: list[Draw] = []
        if sample_rows:
            sampled = self.sampler(picked, sample_rows)
            draws = [Draw(t, lp) for t, lp in zip(sampled.token_ids, sampled.logprobs, strict=True)]
        if not beams and len(draws) == len(rows):
            return draws
        out, at = [], 0
        for i, (_, chunk) in enumerate(rows):
            if i in beams:
                out.append(Draw(-1, beam_logprobs=next(beam_logprobs)))
                continue
            mine = draws[at : at + 1 + len(chunk.draft)]
            at += len(mine)
            if not chunk.draft:
                out.append(mine[0])
                continue
            assert self.speculator is not None
            accepted = self.speculator.verified(chunk.draft, [d.token for d in mine])
            out.append(Draw(mine[accepted].token, mine[accepted].logprob, tuple(mine[:accepted])))
        return out

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
