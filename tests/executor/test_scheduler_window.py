"""The scheduler with a sliding-window pool (tests/executor/test_scheduler.py's harness, blockd in process): the
blocks behind every query's window go back in the step ops sent anyway, a chunk's queries never reach a hole, and
random workloads (forks, prefix hits, aborts, preemptions) still end with every block back."""

from __future__ import annotations

import random

import pytest

from blockd import protocol as p
from blockd.block_rule import dead_blocks
from blockd.pool import HOLE
from executor.scheduler import Chunk, Purpose, window_blocks
from executor.sequence import Sequence
from executor.step_loop import Draw
from tests.executor.test_scheduler import RANDOM_SEEDS, FakeModel, Harness


class WindowReads(FakeModel):
    """Also checks that every key a chunk's queries read (within the window) lies in a block the table holds."""

    def __init__(self, harness: Harness, stops: random.Random | None, window: int) -> None:
        super().__init__(harness, stops)
        self.window = window

    def run(self, chunks: list[Chunk], rows: list[tuple[Sequence, Chunk]]) -> list[Draw]:
        bs = self.harness.scheduler.block_size
        for chunk in chunks:
            table = self.harness.pool.seqs[chunk.seq.seq_id].blocks
            first_read = max(chunk.start - self.window + 1, 0)
            assert HOLE not in table[first_read // bs :], (chunk.seq.seq_id, chunk.start, table)
        return super().run(chunks, rows)


def windowed(window: int, **options) -> Harness:
    h = Harness(sliding_window=window, **options)
    h.loop.model = WindowReads(h, options.get("stops"), window)
    return h


def test_a_decoding_sequence_holds_its_window_and_slides_with_its_commits() -> None:
    h = windowed(8, num_blocks=12, block_size=4)
    seq = h.submit("long", 6, max_tokens=60)  # 66 tokens: 17 blocks, more than the pool has
    most_held = 0
    for _ in range(200):
        record = h.step()
        purposes = [e.purpose for e in record.plan.entries]
        if Purpose.SLIDE in purposes:  # after the commit that covers the tokens it counts
            (slide,) = (e.op for e in record.plan.entries if e.purpose is Purpose.SLIDE)
            assert type(slide) is p.Slide and slide.num_computed_tokens == seq.committed_tokens
            assert Purpose.COMMIT in purposes[: purposes.index(Purpose.SLIDE)]
        if seq.seq_id in h.pool.seqs:
            mirrored = h.pool.seqs[seq.seq_id]
            most_held = max(most_held, len(mirrored.blocks) - mirrored.holes)
            assert mirrored.holes == dead_blocks(4, 8, seq.committed_tokens)
        if not h.loop.has_work():
            break
    assert seq.finish_reason == "length" and seq.preemptions == 0
    assert most_held <= 8 // 4 + 4
    h.assert_all_done()


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_prompt_longer_than_the_pool_is_held_a_chunk_at_a_time(pipelined: bool) -> None:
    h = windowed(8, num_blocks=12, block_size=4, max_num_batched_tokens=8, pipelined=pipelined)
    assert h.loop.max_prompt_tokens > 48  # its window and a step's tokens fit: any prompt the model takes
    seq = h.submit("long", 100, max_tokens=5)  # 25 blocks' worth, in a pool of 12
    admit = h.step().plan.entries[0]
    assert admit.purpose is Purpose.ADMIT and admit.op.hold == 8  # held a step's tokens at first
    assert h.scheduler.registered(seq) == 8
    most_held = 0
    while h.loop.has_work():
        h.step()
        if seq.seq_id in h.pool.seqs:
            mirrored = h.pool.seqs[seq.seq_id]
            most_held = max(most_held, len(mirrored.blocks) - mirrored.holes)
    assert seq.finish_reason == "length" and seq.num_generated == 5 and seq.preemptions == 0
    assert most_held <= window_blocks(4, 8 + 8)
    h.assert_all_done()


@pytest.mark.parametrize("pipelined", [False, True])
def test_random_windowed_workloads_finish_with_every_block_back(pipelined: bool) -> None:
    slid = held_in_part = 0
    for seed in range(RANDOM_SEEDS):
        rng = random.Random(seed)
        block_size, window, budget = rng.choice([2, 4]), rng.randint(1, 12), rng.choice([4, 8, 16])
        h = windowed(
            window,
            # sequences grow past the pool, and prompts can be longer than it
            num_blocks=window_blocks(block_size, window + budget) + rng.randint(2, 8),
            max_num_batched_tokens=budget,
            block_size=block_size,
            max_num_seqs=4,
            pipelined=pipelined,
            stops=random.Random(seed) if seed % 2 else None,
        )
        live: list[Sequence] = []
        for step in range(300):
            if step < 40 and rng.random() < 0.3:
                prompt = None
                if live and rng.random() < 0.5:  # a follow-up sharing an earlier sequence's tokens (prefix hits)
                    earlier = rng.choice(live).tokens
                    prompt = earlier[: rng.randint(1, min(len(earlier), 12))] + [rng.randint(1, 50) for _ in range(3)]
                n = rng.randint(1, 3)
                prompt_len = rng.choice([rng.randint(1, 12), rng.randint(1, 120)])
                live.append(h.submit(f"r{step}", prompt_len, max_tokens=rng.randint(1, 60), n=n, prompt=prompt))
            if live and rng.random() < 0.03:
                h.abort(rng.choice(live).request)
            if step >= 40 and not h.scheduler.has_work():
                break
            record = h.step()
            slid += sum(s.holes for s in h.pool.seqs.values())
            held_in_part += sum(1 for e in record.plan.entries if e.purpose is Purpose.ADMIT and e.op.hold is not None)
        h.run()
        h.assert_all_done()
        assert h.loop.max_seq_tokens > h.scheduler.num_blocks * block_size < h.loop.max_prompt_tokens
    assert slid > 0 and held_in_part > 0
