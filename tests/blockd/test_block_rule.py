"""The block rule against a brute-force count of token slots (slot by slot, no division)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from blockd.block_rule import Growth, dead_blocks, growth, reservable, shared_blocks, to_block_end, trimmed_blocks


def _slots_counted(
    block_size: int, num_tokens: int, num_new_tokens: int, shared: bool, reserved: int, reserve: int
) -> tuple[int, int]:
    """(fresh blocks appended, blocks copied), by walking the slots a growth touches one at a time."""
    blocks = 0
    while blocks * block_size < num_tokens + reserved:
        blocks += 1
    table = blocks
    room = num_tokens + reserved  # slots the table already holds for this sequence
    keep = max(reserve, reserved - num_new_tokens, 0)
    copied = 0
    for slot in range(num_tokens, num_tokens + num_new_tokens + keep):
        written = slot < num_tokens + num_new_tokens or slot >= room  # a token, or a newly reserved slot
        if slot >= blocks * block_size:
            blocks += 1
        elif written and shared and slot // block_size == (num_tokens - 1) // block_size:
            copied = 1  # a write into the block that holds the last token, shared
    return blocks - table, copied


@st.composite
def _growths(draw: st.DrawFn) -> tuple[int, int, int, bool, int, int]:
    block_size = draw(st.integers(1, 8))
    num_tokens = draw(st.integers(1, 40))
    num_new_tokens = draw(st.integers(0, 40))
    # Reservations end at most a block past the block their first slot is in (blockd checks the one asked for).
    reserved = draw(st.integers(0, reservable(block_size, num_tokens)))
    reserve = draw(st.integers(0, reservable(block_size, num_tokens + num_new_tokens)))
    return block_size, num_tokens, num_new_tokens, draw(st.booleans()), reserved, reserve


@given(_growths())
def test_growth_matches_counting_slots(case: tuple[int, int, int, bool, int, int]) -> None:
    block_size, num_tokens, num_new_tokens, shared, reserved, reserve = case
    table_blocks = -(-(num_tokens + reserved) // block_size)
    got = growth(
        block_size,
        num_tokens,
        num_new_tokens,
        table_blocks,
        open_block_shared=shared,
        reserved=reserved,
        reserve=reserve,
    )
    new, copied = _slots_counted(block_size, num_tokens, num_new_tokens, shared, reserved, reserve)
    assert (got.new_blocks, int(got.copy_on_write)) == (new, copied)
    assert got.blocks == new + copied


@given(st.integers(1, 8), st.integers(0, 40), st.data())
def test_trim_hands_back_the_blocks_holding_no_kept_slot(block_size: int, num_tokens: int, data: st.DataObject) -> None:
    """Counted slot by slot: a block stays when one of its slots holds a token or a kept reserved slot."""
    reserved = data.draw(st.integers(0, reservable(block_size, num_tokens)))
    keep = data.draw(st.integers(0, reserved))
    table_blocks = -(-(num_tokens + reserved) // block_size)
    kept_blocks = {slot // block_size for slot in range(num_tokens + keep)}
    assert trimmed_blocks(block_size, num_tokens, keep, table_blocks) == table_blocks - len(kept_blocks)
    assert trimmed_blocks(block_size, num_tokens, reserved, table_blocks) == 0  # keeping them all: nothing


def test_examples() -> None:
    assert growth(4, 0, 9, 0) == Growth(3, False)  # an admission: ceil(9 / 4)
    assert growth(4, 8, 1, 2) == Growth(1, False)  # a decode at a block boundary
    assert growth(4, 6, 1, 2, open_block_shared=True) == Growth(0, True)  # first write after a fork
    assert growth(4, 8, 1, 2, open_block_shared=True) == Growth(1, False)  # a full shared block is never written
    assert growth(4, 6, 0, 2, open_block_shared=True) == Growth(0, False)  # nothing written, nothing copied
    assert growth(4, 6, 1, 3).blocks == 0  # a table longer than the tokens need takes nothing (never negative)


def test_reservation_examples() -> None:
    assert to_block_end(4, 8) == 4 and to_block_end(4, 9) == 3  # to the end of the next token's block
    assert reservable(4, 8) == 8 and reservable(4, 9) == 7  # and the block after it
    assert shared_blocks(4, 8) == 2 and shared_blocks(4, 9) == 3  # the blocks that hold a token
    assert growth(4, 8, 0, 2, reserve=4) == Growth(1, False)  # room for the next block's tokens, ahead of them
    assert growth(4, 9, 0, 3, reserve=7) == Growth(1, False)  # the rest of this block and all of the next
    assert growth(4, 9, 3, 4, reserved=7, reserve=7) == Growth(1, False)  # 3 registered, room renewed early
    assert growth(4, 8, 3, 3, reserved=4) == Growth(0, False)  # tokens computed into it, registered later
    assert growth(4, 8, 4, 3, reserved=4, reserve=4) == Growth(1, False)  # it ran out: register, reserve on
    assert growth(4, 6, 0, 2, reserved=2, reserve=1) == Growth(0, False)  # a reservation lasts until filled
    # A fork shares the open block (the rest of it reserved): the first of the two to write there copies it.
    assert growth(4, 6, 1, 2, open_block_shared=True, reserved=2) == Growth(0, True)
    # Reserving writes there only if the new slots start there: a parent holding the rest of it reserves on past
    # it without a copy; one holding less of it copies.
    assert growth(2, 1, 0, 1, open_block_shared=True, reserved=1, reserve=2) == Growth(1, False)
    assert growth(4, 5, 0, 2, open_block_shared=True, reserved=1, reserve=6) == Growth(1, True)
    # Reserved-only blocks are never shared: a full last token block leaves nothing to copy.
    assert growth(4, 8, 0, 3, open_block_shared=True, reserved=4, reserve=4) == Growth(0, False)


def _dead_counted(block_size: int, window: int, num_computed: int, horizon: int) -> int:
    """Leading blocks none of whose slots a query at positions [num_computed, horizon) reads, slot by slot."""
    read = {k for q in range(num_computed, horizon) for k in range(q + 1) if q - k < window}
    blocks = 0
    while all(slot not in read for slot in range(blocks * block_size, (blocks + 1) * block_size)):
        blocks += 1
    return blocks


@given(st.integers(1, 8), st.integers(1, 24), st.integers(0, 60))
def test_dead_blocks_matches_counting_slots(block_size: int, window: int, num_computed: int) -> None:
    # A query further on reads nothing earlier than the first one does: a horizon one block past is enough.
    horizon = num_computed + block_size + window
    assert dead_blocks(block_size, window, num_computed) == _dead_counted(block_size, window, num_computed, horizon)


def test_dead_block_examples() -> None:
    assert dead_blocks(4, None, 1000) == 0  # no window: everything stays read
    assert dead_blocks(4, 8, 8) == 0  # the query at 8 reads keys 1..8: block 0 is still read
    assert dead_blocks(4, 8, 10) == 0 and dead_blocks(4, 8, 11) == 1  # at 11 it reads 4..11: block 0 is dead
    assert dead_blocks(4, 1, 4) == 1  # a window of one: a query reads its own key only
