"""Driving a real engine (in this process) against a real blockd (another process), and the transformers oracle."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import torch
import transformers

from blockd.tiers import TierOp
from executor import protocol as ep
from executor.engine import Engine, EngineLimits
from executor.model import ForwardBatch
from executor.params import SamplingParams
from executor.runner import LoadedModel, load_model
from executor.sequence import Status
from executor.speculative import SpeculativeConfig
from executor.tier_store import TierStore


def make_engine(
    model_dir: Path,
    blockd_endpoint: str,
    *,
    num_blocks: int = 64,
    block_size: int = 16,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    backend: str = "auto",
    pool_id: str = "test-pool",
    seed: int | None = 0,
    speculative: SpeculativeConfig | None = None,
) -> Engine:
    engine = Engine.assemble(
        _loaded(model_dir),
        blockd_endpoint,
        pool_id=pool_id,
        num_blocks=num_blocks,
        block_size=block_size,
        limits=EngineLimits(max_num_seqs, max_num_batched_tokens, speculative=speculative),
        backend=backend,
        seed=seed,
        retry_for_s=20.0,
    )  # type: ignore[arg-type]
    engine.pool.register()
    return engine


@lru_cache(maxsize=8)
def _loaded(model_dir: Path) -> LoadedModel:
    """Weights are read-only during inference: engines of one test session share them (each has its own cache)."""
    return load_model(model_dir, torch.device("cpu"))


@dataclass
class Choice:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[ep.TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    cached_tokens: int = 0
    completion_tokens: int = 0
    prompt_logprobs: list[ep.TokenLogprob] | None = None


Arrival = tuple[str, list[int], SamplingParams]


def check_sequence_invariants(engine: Engine) -> None:
    """What must hold between steps (see executor.sequence and executor.scheduler)."""
    scheduler = engine.scheduler
    for seq in scheduler.running:
        assert seq.status is Status.RUNNING
        registered = scheduler.registered(seq)
        assert registered <= len(seq.tokens), seq
        if seq.fork_parent is None:
            mirrored = engine.pool.seqs[seq.seq_id]
            # A token computed before it is registered sits in the slot blockd reserved for it.
            assert seq.num_computed <= registered + mirrored.reserved, seq
            assert mirrored.token_ids() == seq.tokens[:registered], seq  # what blockd holds is the sequence's own
            bs = engine.pool.block_size
            assert len(mirrored.blocks) == -(-(registered + mirrored.reserved) // bs), seq
    for seq in scheduler.waiting:
        assert seq.status is Status.WAITING and seq.seq_id not in engine.pool.seqs
    held = Counter(b for s in engine.pool.seqs.values() for b in s.blocks[s.holes :])
    assert engine.pool.blocks_in_use == len(held)
    assert engine.pool.refcount == [held[b] for b in range(engine.pool.num_blocks)]


def drive(
    engine: Engine,
    arrivals: dict[int, list[Arrival]],
    *,
    max_steps: int = 5000,
    on_step: Callable[[int, Engine], None] | None = None,
) -> dict[str, list[Choice]]:
    """Run until every request is done, submitting `arrivals[k]` before step k; choices per request id."""
    results: dict[str, list[Choice]] = {}
    pending = dict(arrivals)
    step = 0
    while pending or engine.has_work():
        for request_id, prompt, params in pending.pop(step, []):
            engine.add_request(request_id, prompt, params)
            results[request_id] = [Choice() for _ in range(params.n)]
        for delta in engine.step():
            choice = results[delta.request_id][delta.index]
            choice.tokens += delta.token_ids
            choice.logprobs += delta.logprobs or []
            choice.finish_reason = delta.finish_reason
            choice.cached_tokens = delta.cached_tokens
            choice.completion_tokens = delta.completion_tokens
            if delta.prompt_logprobs is not None:
                assert choice.prompt_logprobs is None, "prompt logprobs are sent once"
                choice.prompt_logprobs = delta.prompt_logprobs
        check_sequence_invariants(engine)
        if on_step is not None:
            on_step(step, engine)
        step += 1
        assert step < max_steps, "the engine did not finish"
    return results


@lru_cache(maxsize=8)
def hf_model(model_dir: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@contextlib.contextmanager
def reference_run() -> Iterator[None]:
    """The oracle's forward passes: no autograd, one torch thread. The tiny checkpoints' ops take microseconds,
    and an OpenMP team is as slow as its slowest thread: with a stack's processes (or another job) on the other
    core, two threads ran these forwards 8-10x slower than one (docs/architecture.md, "CPU threads")."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            yield
    finally:
        torch.set_num_threads(threads)


def hf_greedy(model_dir: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy generate: the oracle. It stops after an end-of-sequence token, like the engine."""
    model = hf_model(model_dir)
    with reference_run():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )
    return out[0, len(prompt) :].tolist()


def hf_beams(model_dir: Path, prompt: list[int], params: SamplingParams) -> list[list[int]]:
    """transformers' own beam search: the oracle (its sequences padded past an end, cut back here)."""
    model = hf_model(model_dir)
    with reference_run():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=params.max_tokens,
            num_beams=params.beam_width,
            num_return_sequences=params.n,
            length_penalty=params.length_penalty,
            early_stopping=params.early_stopping,
            do_sample=False,
        )
    eos = set(
        model.generation_config.eos_token_id
        if isinstance(model.generation_config.eos_token_id, list)
        else [model.generation_config.eos_token_id]
    )
    beams = []
    for row in out[:, len(prompt) :].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        beams.append(row[:cut])
    return beams


def hf_greedy_ignoring_eos(model, prompt, n):
    """Greedy continuation of exactly n tokens, end-of-sequence tokens included (the argmax of transformers'
    logits at each position, fed back)."""
    tokens = list(prompt)
    hf = hf_model(model)
    with reference_run():
        for _ in range(n):
            tokens.append(int(hf(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt) :]


def hf_logprobs(model_dir: Path, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """log-softmax of transformers' logits at each generated position: [len(generated), vocab]."""
    model = hf_model(model_dir)
    with reference_run():
        logits = model(torch.tensor([prompt + generated])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.float(), dim=-1)


def check_against_transformers(model_dir: Path, prompt: list[int], choice: Choice, tolerance: float = 2e-3) -> None:
    """A greedy choice (sampled with logprobs=1) equals transformers' tokens, each chosen token's logprob within
    `tolerance` of transformers' (float32)."""
    assert choice.tokens == hf_greedy_ignoring_eos(model_dir, prompt, len(choice.tokens))
    reference = hf_logprobs(model_dir, prompt, choice.tokens)
    assert len(choice.logprobs) == len(choice.tokens)
    for position, entry in enumerate(choice.logprobs):
        expected = reference[position, entry.token_id].item()
        assert abs(entry.logprob - expected) < tolerance, (position, entry.logprob, expected)


def random_prompts(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def assert_forward_matches(model_dir: Path, reference: transformers.PreTrainedModel, vocab_size: int) -> None:
    """The loaded checkpoint's logits over a prefill chunk, a decode token and a second chunk on the paged cache
    (60 tokens, windows shorter than the chunks) against `reference`'s full forward: the same greedy tokens, and
    their logprobs within 2e-3."""
    loaded = load_model(model_dir, torch.device("cpu"))
    c = loaded.config
    tokens, block = 60, 16
    ids = torch.randint(0, vocab_size, (tokens,), generator=torch.Generator().manual_seed(1))
    blocks = -(-tokens // block)
    shape = (blocks + 1, block, c.num_kv_heads, c.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(c.num_layers)]
    pieces = []
    for start, n in ((0, 37), (37, 1), (38, 22)):  # a chunk, a decode token, a chunk reading the cached ones
        batch = ForwardBatch(
            input_ids=ids[start : start + n],
            positions=torch.arange(start, start + n),
            slot_mapping=torch.arange(start, start + n) + block,  # block 0 stays unused
            block_tables=torch.arange(1, blocks + 1, dtype=torch.int32)[None],
            query_start_loc=torch.tensor([0, n], dtype=torch.int32),
            seq_lens=torch.tensor([start + n], dtype=torch.int32),
            logits_indices=torch.arange(n),
        )
        pieces.append(loaded.model(batch, caches))
    ours = torch.cat(pieces)
    with reference_run():
        expected = reference(ids[None]).logits[0].float()
    chosen = expected.argmax(-1)
    assert torch.equal(ours.argmax(-1), chosen)
    rows = torch.arange(tokens)
    ours_lp, expected_lp = torch.log_softmax(ours, -1)[rows, chosen], torch.log_softmax(expected, -1)[rows, chosen]
    assert (ours_lp - expected_lp).abs().max().item() < 2e-3  # the greedy tokens' logprobs


def run_landed(store: TierStore, ops: list[TierOp], timeout_s: float = 30.0) -> list[int]:
    """Run `ops`, then wait for and land every disk or shared load they began; returns the device blocks whose
    load failed, at once (no file to open) or once read (a bad file)."""
    moved = store.run(ops)
    landed = store.land(set(moved.reading.values()), wait_s=timeout_s)
    assert landed.in_flight == 0, f"{landed.in_flight} reads still going after {timeout_s} s"
    failed = set(landed.failed)
    return [*moved.failed, *(block for block, ticket in moved.reading.items() if ticket in failed)]
