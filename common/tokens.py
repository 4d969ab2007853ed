"""The wire format of token ids, spoken by gateway, executor and blockd alike: little-endian uint32, packed.

A packed prompt crosses every hop as one bytes object: decoded without per-id work, and hashed by blockd
(blockd.hashing) exactly as it arrives.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

TOKEN_BYTES = 4


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 bytes; raises OverflowError for ids outside [0, 2**32)."""
    packed = array("I", token_ids)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def unpack_tokens(packed: bytes | bytearray) -> list[int]:
    """The inverse of pack_tokens."""
    ids = array("I")
    ids.frombytes(packed)
    if sys.byteorder != "little":
        ids.byteswap()
    return ids.tolist()


def as_packed(tokens: Sequence[int] | bytes | bytearray) -> bytes | bytearray:
    """Token ids in their packed form, packing them if they are not already."""
    if isinstance(tokens, (bytes, bytearray)):
        if len(tokens) % TOKEN_BYTES:
            raise ValueError(f"packed token ids must be a multiple of {TOKEN_BYTES} bytes, got {len(tokens)}")
        return tokens
    return pack_tokens(tokens)
