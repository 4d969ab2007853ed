"""The one block rule: how many fresh blocks a sequence takes to grow, for blockd and the executor alike.

A sequence of n tokens with r reserved slots holds ceil((n + r) / block_size) blocks. Reserved slots are room for
tokens blockd has not been told yet: an executor computes a decoding sequence's tokens into them step after step
and registers them (their ids, which the prefix index hashes) only when the room runs out, once a block. So a
decode step needs no blockd op for most sequences, and a step's round trip can be sent before its tokens are
sampled. A reservation never reaches past the block its first slot is in (`reservable`): every slot past a
sequence's tokens is then in its last block, the only one a write can find shared.

Growing a sequence by k tokens (they fill its reserved slots first) and to `reserve` reserved slots past them
takes the blocks past its table's end, plus one copy of its last block when that block is open (has a slot past
the tokens), shared with another sequence (after a fork), and written by the growth (tokens registered, or slots
newly reserved): the new tokens must not be written into a block someone else reads.

blockd's pool grants by this rule (admit, append); the executor's scheduler estimates by it before it asks.
Pure arithmetic, no state: both sides pass in what they know.
"""

from __future__ import annotations

from typing import NamedTuple


class Growth(NamedTuple):
    """Fresh blocks one growth takes."""

    new_blocks: int  # blocks appended to the table
    copy_on_write: bool  # the shared, open last block is replaced by a fresh copy first

    @property
    def blocks(self) -> int:
        """All fresh blocks it takes from the free queue."""
        return self.new_blocks + self.copy_on_write


def reservable(block_size: int, num_tokens: int) -> int:
    """Most slots a sequence of `num_tokens` tokens may hold reserved: up to the end of the block that its next
    token goes into."""
    return block_size - num_tokens % block_size


def reserved_after(reserved: int, num_new_tokens: int, reserve: int) -> int:
    """Reserved slots after registering `num_new_tokens` (which fill reserved slots first) and asking for
    `reserve`: a reservation lasts until tokens fill it."""
    return max(reserve, reserved - num_new_tokens, 0)


def growth(
    block_size: int,
    num_tokens: int,
    num_new_tokens: int,
    table_blocks: int,
    *,
    last_block_shared: bool = False,
    reserved: int = 0,
    reserve: int = 0,
) -> Growth:
    """Blocks taken when a table of `table_blocks` blocks holding `num_tokens` tokens and `reserved` reserved
    slots grows by `num_new_tokens` tokens, keeping `reserve` slots reserved past them.

    An admission is a growth from an empty table (or from its cached prefix: full blocks, so never a copy).
    """
    kept = reserved_after(reserved, num_new_tokens, reserve)
    new_blocks = max(-(-(num_tokens + num_new_tokens + kept) // block_size) - table_blocks, 0)
    writes = num_new_tokens > 0 or kept > reserved
    open_tail = num_tokens % block_size != 0 or reserved > 0
    return Growth(new_blocks, writes and open_tail and last_block_shared)
