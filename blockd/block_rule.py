"""The one block rule: how many fresh blocks a sequence takes to grow, for blockd and the executor alike.

A sequence of n tokens with r reserved slots (room for tokens computed but not registered yet) holds
ceil((n + r) / block_size) blocks. blockd's pool grants by this rule (admit, append, slide); the executor's
scheduler estimates by it before it asks (docs/architecture.md, "The core"). Pure arithmetic, no state.
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
    its next token goes into. So one append gives a decoding sequence between one and two blocks of room, and a
    round trip is needed only every block or so of decode steps."""
    return to_block_end(block_size, num_tokens) + block_size


def shared_blocks(block_size: int, num_tokens: int) -> int:
    """Leading blocks of a table that a fork shares: those holding one of the `num_tokens` registered tokens, no
    reserved-only block, so that a write can find at most one block shared: the open one."""
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

    A shared open block that the growth writes into is copied first: the new tokens must not go into a block
    someone else reads. Of the sequences sharing it at most one holds reserved slots in it (the fork's parent;
    the child starts with none, and copies before it reserves). An admission is a growth from an empty table (or
    from its cached prefix: full blocks, so never a copy).
    """
    kept = reserved_after(reserved, num_new_tokens, reserve)
    new_blocks = max(-(-(num_tokens + num_new_tokens + kept) // block_size) - table_blocks, 0)
    writes = writes_open_block(block_size, num_tokens, num_new_tokens, reserved, kept)
    return Growth(new_blocks, writes and open_block_shared)


def trimmed_blocks(block_size: int, num_tokens: int, keep: int, table_blocks: int) -> int:
    """Blocks a trim hands back: a table of `table_blocks` blocks holding `num_tokens` tokens keeps `keep` of its
    reserved slots (no more than it holds) and so ceil((num_tokens + keep) / block_size) blocks; the ones past
    them hold reserved slots only (speculative decoding's rejected drafts, room no longer wanted)."""
    return max(table_blocks - -(-(num_tokens + keep) // block_size), 0)


def dead_blocks(block_size: int, window: int | None, num_computed: int) -> int:
    """Leading blocks no future query reads: the queries still to come are at positions >= `num_computed` and see
    keys k with q - k < `window`, so every key at or before num_computed - window is dead. None: no window (every
    key is read for ever). The executor hands them back (blockd's `slide`), leaving holes at the table's head."""
    if window is None:
        return 0
    return max(num_computed - window + 1, 0) // block_size
