"""The one block rule: how many fresh blocks a sequence takes to grow, for blockd and the executor alike.

A sequence of n tokens holds ceil(n / block_size) blocks. Growing it by k > 0 tokens takes the blocks past its
table's end, plus one copy of its last block when that block is partly filled and shared with another
sequence (after a fork): the new tokens must not be written into a block someone else reads.

blockd's pool grants by this rule (admit, append); the executor's scheduler estimates by it before it asks.
Pure arithmetic, no state: both sides pass in what they know.
"""

from __future__ import annotations

from typing import NamedTuple


class Growth(NamedTuple):
    """Fresh blocks one growth takes."""

    new_blocks: int  # blocks appended to the table
    copy_on_write: bool  # the shared, partly filled last block is replaced by a fresh copy first

    @property
    def blocks(self) -> int:
        """All fresh blocks it takes from the free queue."""
        return self.new_blocks + self.copy_on_write


def growth(
    block_size: int, num_tokens: int, num_new_tokens: int, table_blocks: int, *, last_block_shared: bool = False
) -> Growth:
    """Blocks taken when a table of `table_blocks` blocks holding `num_tokens` tokens grows by `num_new_tokens`.

    An admission is a growth from an empty table (or from its cached prefix: full blocks, so never a copy).
    """
    new_blocks = max(-(-(num_tokens + num_new_tokens) // block_size) - table_blocks, 0)
    copy = num_new_tokens > 0 and num_tokens % block_size != 0 and last_block_shared
    return Growth(new_blocks, copy)
