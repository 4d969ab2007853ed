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
