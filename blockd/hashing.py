"""The one block-hash function of pagedkv.

hash(block i) = BLAKE2b-128(hash(block i-1) or the root, token ids of block i, extra key).

The root is derived from a per-deployment secret-free string, and the extra key from the model identity and the
optional cache salt, so a tenant with a salt can only ever hit its own prefixes and two models never share one.
Token ids are packed as little-endian uint32, so the value is identical across processes, machines and restarts
(unlike Python's `hash()`). The same packing (common.tokens) is the wire format for token ids: a packed prompt
is hashed as it arrives, without converting a single id.
"""

from __future__ import annotations

from collections.abc import Sequence
from hashlib import blake2b

from common.tokens import TOKEN_BYTES, as_packed

HASH_BYTES = 16
_EMPTY = blake2b(digest_size=HASH_BYTES)


def root_hash(deployment: str = "pagedkv") -> bytes:
    """The parent hash of every chain's first block."""
    return blake2b(b"pagedkv-root\0" + deployment.encode(), digest_size=HASH_BYTES).digest()


def extra_key(model_id: str, cache_salt: str | None = None) -> bytes:
    """Everything besides the tokens that decides whether two blocks hold the same KV."""
    salt = b"" if cache_salt is None else b"\1" + cache_salt.encode()
    return blake2b(b"pagedkv-extra\0" + model_id.encode() + b"\0" + salt, digest_size=HASH_BYTES).digest()


def chain_hashes(
    tokens: Sequence[int] | bytes | bytearray,
    block_size: int,
    parent: bytes,
    extra: bytes,
    start_block: int = 0,
    stop_block: int | None = None,
) -> list[bytes]:
    """Chained hashes of full blocks [start_block, stop_block) of `tokens` (ids, or ids packed).

    `parent` is the hash of block start_block-1 (or the root when start_block is 0).
    """
    packed = as_packed(tokens)
    stride = block_size * TOKEN_BYTES
    full = len(packed) // stride
    stop = full if stop_block is None else min(stop_block, full)
    hashes: list[bytes] = []
    h = parent
    fresh = _EMPTY.copy  # copying a primed state beats parsing blake2b's keyword arguments per block
    for offset in range(start_block * stride, stop * stride, stride):
        state = fresh()
        state.update(h + packed[offset : offset + stride] + extra)
        h = state.digest()
        hashes.append(h)
    return hashes


def epoch_fingerprint(epoch: int) -> str:
    """A short one-way digest of a pool's epoch, for people to tell executors apart (`blockd-cli pools`, the
    executor's start-up log line). 32 bits of a 62-bit random epoch: it names the epoch without revealing it, so
    showing it gives nobody the means to act on the pool."""
    data = b"pagedkv-epoch\0" + epoch.to_bytes(16, "little", signed=True)
    return blake2b(data, digest_size=4).hexdigest()
