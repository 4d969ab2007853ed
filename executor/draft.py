"""Draft-model proposals for speculative decoding (`{"method": "draft_model", "model": DIR, ...}`).

A small model of the target's vocabulary proposes greedily (a point mass, so verification is exact rejection
sampling: executor/speculative.py). It keeps its own paged KV cache: a `ModelRunner` of its own beside the
target's, its blocks handed out here rather than by blockd, since no other process reads them and nothing in
them is shared or cached. Each step a sequence's draft cache catches up on the tokens it lacks (the accepted
draft tokens and the step's correction, or a prompt), in one batched pass for every drafting sequence, then
takes k - 1 more batched single-token passes. Rollback is the longest prefix its cached tokens share with the
sequence's: a rejected draft's K/V is overwritten by the next catch-up.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from blockd.client import MirroredSequence
from executor.checkpoint import load_config
from executor.model_config import CheckpointError, UnsupportedModel
from executor.runner import ModelRunner, load_model
from executor.scheduler import Chunk
from executor.sequence import Sequence
from executor.speculative import SpeculativeConfigError
from pagedkv_kernels.pointwise import argmax_rows


@dataclass
class _DraftSeq:
    """What a chunk of the draft model reads of a sequence: its id and tokens (the real ones and the draft so far)."""

    seq_id: str
    tokens: list[int]
    request: Any = None  # (Chunk.scored_positions reads request.prompt_logprobs: none here)


class _NoPromptLogprobs:
    prompt_logprobs = None


@dataclass
class _State:
    blocks: list[int] = field(default_factory=list)
    fed: list[int] = field(default_factory=list)  # the tokens whose K/V its cache holds, in order


class DraftModelProposer:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.block_size = runner.block_size
        self.free: list[int] = list(range(runner.num_blocks))
        self._states: weakref.WeakKeyDictionary[Sequence, _State] = weakref.WeakKeyDictionary()

    @classmethod
    def beside(cls, model_dir: str, target: ModelRunner) -> DraftModelProposer:
        """The draft model at `model_dir` on the target runner's device, with as many KV blocks of the same size
        as the target has; refused (SpeculativeConfigError) if it cannot be loaded or its vocabulary differs."""
        path = Path(model_dir)
        try:
            config = load_config(path)
        except (CheckpointError, UnsupportedModel, OSError) as exc:
            raise SpeculativeConfigError(f"draft model {model_dir}: {exc}") from None
        if config.vocab_size != target.config.vocab_size:
            raise SpeculativeConfigError(
                f"draft model {model_dir}: vocabulary of {config.vocab_size} tokens, the target's has "
                f"{target.config.vocab_size}: a draft must share the target's tokenizer"
            )
        loaded = load_model(path, target.device, target.dtype)
        return cls(ModelRunner(loaded, num_blocks=target.num_blocks, block_size=target.block_size))

    def _state(self, seq: Sequence) -> _State:
        state = self._states.get(seq)
        if state is None:
            state = self._states[seq] = _State()
            weakref.finalize(seq, self.free.extend, state.blocks)  # its blocks come back with the sequence
        return state

    def _room(self, state: _State, slots: int) -> bool:
        need = -(-slots // self.block_size) - len(state.blocks)
        if need > len(self.free):
            return False
        for _ in range(max(need, 0)):
            state.blocks.append(self.free.pop())
        return True

    def propose_all(self, wanted: list[tuple[Sequence, int]]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in wanted]
        live: list[tuple[int, _DraftSeq, int]] = []  # (index in wanted, its stand-in, most)
        tables: dict[str, MirroredSequence] = {}
        chunks: list[Chunk] = []
        for i, (seq, most) in enumerate(wanted):
            state = self._state(seq)
            tokens = seq.tokens
            if not self._room(state, len(tokens) + most):
                continue  # the draft cache is full: this sequence decodes without a draft
            kept = 0  # rollback: the longest prefix of the cached tokens that is the sequence's
            limit = min(len(state.fed), len(tokens) - 1)
            while kept < limit and state.fed[kept] == tokens[kept]:
                kept += 1
            stand_in = _DraftSeq(seq.seq_id, list(tokens), _NoPromptLogprobs())
            tables[seq.seq_id] = MirroredSequence(bytearray(), state.blocks, 0)
            chunks.append(Chunk(stand_in, kept, tokens[kept:]))  # type: ignore[arg-type]
            state.fed = list(tokens)
            live.append((i, stand_in, most))
        step = 0
        while chunks:
            logits = self.runner.execute(chunks, tables)
            picked = argmax_rows(logits[: len(chunks)]).tolist()
            step += 1
            chunks = []
            still = []
            for (i, stand_in, most), token in zip(live, picked, strict=True):
                drafts[i].append(token)
                if step < most:  # feed it for the next draft token
                    start = len(stand_in.tokens)
                    stand_in.tokens.append(token)
                    self._state(wanted[i][0]).fed.append(token)
                    chunks.append(Chunk(stand_in, start, [token]))  # type: ignore[arg-type]
                    still.append((i, stand_in, most))
            live = still
        return drafts
