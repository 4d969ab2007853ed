"""The block rule against a brute-force count of token slots (block by block, no division)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from blockd.block_rule import Growth, growth


def _slots_counted(block_size: int, num_tokens: int, num_new_tokens: int, shared: bool) -> tuple[int, int]:
    """(fresh blocks appended, blocks copied), by filling slots one token at a time."""
    blocks, filled = 0, 0  # blocks of the table, tokens in its last block
    for _ in range(num_tokens):
        if blocks == 0 or filled == block_size:
            blocks, filled = blocks + 1, 0
        filled += 1
    table = blocks
    copied = 0
    for _ in range(num_new_tokens):
        if blocks == 0 or filled == block_size:
            blocks, filled = blocks + 1, 0
        elif shared and blocks == table and not copied:  # first write into the shared, partly filled last block
            copied = 1
        filled += 1
    return blocks - table, copied


@given(
    block_size=st.integers(1, 8),
    num_tokens=st.integers(0, 40),
    num_new_tokens=st.integers(0, 40),
    shared=st.booleans(),
)
def test_growth_matches_counting_slots(block_size: int, num_tokens: int, num_new_tokens: int, shared: bool) -> None:
    table_blocks = -(-num_tokens // block_size)
    got = growth(block_size, num_tokens, num_new_tokens, table_blocks, last_block_shared=shared)
    new, copied = _slots_counted(block_size, num_tokens, num_new_tokens, shared)
    assert (got.new_blocks, int(got.copy_on_write)) == (new, copied)
    assert got.blocks == new + copied


def test_examples() -> None:
    assert growth(4, 0, 9, 0) == Growth(3, False)  # an admission: ceil(9 / 4)
    assert growth(4, 8, 1, 2) == Growth(1, False)  # a decode at a block boundary
    assert growth(4, 6, 1, 2, last_block_shared=True) == Growth(0, True)  # first write after a fork
    assert growth(4, 8, 1, 2, last_block_shared=True) == Growth(1, False)  # a full shared block is never written
    assert growth(4, 6, 0, 2, last_block_shared=True) == Growth(0, False)  # nothing written, nothing copied
    assert growth(4, 6, 1, 3).blocks == 0  # a table longer than the tokens need takes nothing (never negative)
