"""Stable error codes of blockd. Clients branch on `code`; `message` is for people."""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    BAD_MESSAGE = "bad_message"  # not a decodable message at all
    BAD_VERSION = "bad_version"  # protocol version this daemon does not speak
    UNKNOWN_OP = "unknown_op"
    INVALID_REQUEST = "invalid_request"  # wrong types, missing fields, values out of range
    TOO_LARGE = "too_large"  # message over --max-message-bytes
    UNKNOWN_POOL = "unknown_pool"  # not registered (or expired): the client should register again
    POOL_MISMATCH = "pool_mismatch"  # re-registration with a different shape or model
    UNKNOWN_SEQUENCE = "unknown_sequence"
    SEQUENCE_EXISTS = "sequence_exists"
    DOUBLE_FREE = "double_free"  # the sequence was freed already
    OUT_OF_BLOCKS = "out_of_blocks"  # not enough free blocks; nothing changed
    # Fencing: a pool is changed only by the executor that holds it, proven by its epoch.
    STALE_EPOCH = "stale_epoch"  # the request's epoch is not the pool's: another executor holds it now
    POOL_HELD = "pool_held"  # register with a new epoch while the pool's executor is alive (its lease runs)
    # Bounds, checked before any work: the request changes nothing.
    TOO_MANY_POOLS = "too_many_pools"  # a new pool past --max-pools
    POOL_TOO_LARGE = "pool_too_large"  # num_blocks past --max-blocks-per-pool
    UNSUPPORTED_BLOCK_SIZE = "unsupported_block_size"  # a block size outside --block-sizes
    TOO_MANY_TOKENS = "too_many_tokens"  # a lookup past --max-lookup-tokens, or more tokens than a pool holds
    # Authentication (with keys): the sender's role may not make this request; it changes nothing.
    FORBIDDEN = "forbidden"
    INTERNAL = "internal"

    @classmethod
    def of(cls, code: str) -> ErrorCode:
        """The code named by a reply; INTERNAL for one this client does not know."""
        return cls._value2member_map_.get(code, cls.INTERNAL)  # type: ignore[return-value]


class BlockdError(Exception):
    """An error answered to the caller; the state it concerns is unchanged."""

    def __init__(self, code: ErrorCode, message: str, *, missing_blocks: int = 0) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.missing_blocks = missing_blocks
