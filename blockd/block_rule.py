"""The one block rule: how many fresh blocks a sequence takes to grow, for blockd and the executor alike.

A sequence of n tokens with r reserved slots holds ceil((n + r) / block_size) blocks. Reserved slots are room for
tokens blockd has not been told yet: an executor computes a decoding sequence's tokens into them step after step
and registers them (their ids, which the prefix index hashes) only when the room runs low. A reservation reaches
at most to the end of the block after the one its first slot is in (`reservable`), so one append gives a decoding
sequence between one and two blocks of room, and a step's round trip is needed only every block or so of decode
steps (the executor renews every sequence that is low on room in the same round trip).

Only the blocks that hold a registered token can be shared (a fork shares those and no reserved-only block), so
a write can find at most one block shared: the open block, partly filled, that the next token goes into.

Growing a sequence by k tokens (they fill its reserved slots first) and to `reserve` reserved slots past them
takes the blocks past its table's end, plus one copy of its open block when that block is shared with another
sequence (after a fork) and the growth writes into it (`writes_open_block`: a token registered, or a slot newly
reserved there): the new tokens must not be written into a block someone else reads. The executor writes a
reserved slot before blockd hears of its token, so of the sequences sharing a partly filled block at most one
holds reserved slots in it (the fork's parent; the child starts with none, and copies before it reserves).

A model whose every layer attends within a sliding window (a query at position q sees keys k with q - k < window)
never reads a sequence's leading blocks again once its queries have moved past them: `dead_blocks` says how many.
The executor hands them back (blockd's `slide`), leaving holes at the head of the table.

blockd's pool grants by this rule (admit, append, slide); the executor's scheduler estimates by it before it asks.
Pure arithmetic, no state: both sides pass in what they know.
"""

from __future__ import annotations

from typing import NamedTuple


class Growth(NamedTuple):
    """Fresh blocks one growth takes."""

    new_blocks: int  # blocks appended to the table
    copy_on_write: bool  # the shared open block is replaced by a fresh copy first

    @property
    def blocks(self) -> int:
        """All fresh blocks it takes from the free queue."""
        return self.new_blocks + self.copy_on_write


def to_block_end(block_size: int, num_tokens: int) -> int:
    """Slots from a sequence's next token to the end of the block that token goes into."""
    return block_size - num_tokens % block_size


def reservable(block_size: int, num_tokens: int) -> int:
    """Most slots a sequence of `num_tokens` tokens may hold reserved: up to the end of the block after the one
    its next token goes into."""
    return to_block_end(block_size, num_tokens) + block_size


def shared_blocks(block_size: int, num_tokens: int) -> int:
    """Leading blocks of a table that a fork shares: those holding one of the `num_tokens` registered tokens."""
    return -(-num_tokens // block_size)


def reserved_after(reserved: int, num_new_tokens: int, reserve: int) -> int:
    """Reserved slots after registering `num_new_tokens` (which fill reserved slots first) and asking for
    `reserve`: a reservation lasts until tokens fill it."""
    return max(reserve, reserved - num_new_tokens, 0)


def writes_open_block(block_size: int, num_tokens: int, num_new_tokens: int, reserved: int, kept: int) -> bool:
    """Whether a growth writes into the sequence's open block (partly filled: its next token goes there): it
    registers a token, or reserves a slot there that was not reserved before (new reserved slots start where
    the old ones end, so none lands there once the old ones reach the block's end)."""
    if num_tokens % block_size == 0:
        return False
    return num_new_tokens > 0 or (kept > reserved and reserved < to_block_end(block_size, num_tokens))


def growth(
    block_size: int,
    num_tokens: int,
    num_new_tokens: int,
    table_blocks: int,
    *,
    open_block_shared: bool = False,
    reserved: int = 0,
    reserve: int = 0,
) -> Growth:
    """Blocks taken when a table of `table_blocks` blocks holding `num_tokens` tokens and `reserved` reserved
    slots grows by `num_new_tokens` tokens, keeping `reserve` slots reserved past them. `open_block_shared`: the
    partly filled block the next token goes into is held by another sequence too.

    An admission is a growth from an empty table (or from its cached prefix: full blocks, so never a copy).
    """
    kept = reserved_after(reserved, num_new_tokens, reserve)
    new_blocks = max(-(-(num_tokens + num_new_tokens + kept) // block_size) - table_blocks, 0)
    writes = writes_open_block(block_size, num_tokens, num_new_tokens, reserved, kept)
    return Growth(new_blocks, writes and open_block_shared)


def dead_blocks(block_size: int, window: int | None, num_computed: int) -> int:
    """Leading blocks no future query reads: the queries still to come are at positions >= `num_computed` and see
    keys k with q - k < `window`, so every key at or before num_computed - window is dead. None: no window (every
    key is read for ever)."""
    if window is None:
        return 0
    return max(num_computed - window + 1, 0) // block_size
