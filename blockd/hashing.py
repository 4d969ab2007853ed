"""The one block-hash function of pagedkv.

hash(block i) = BLAKE2b-128(hash(block i-1) or the deployment's root, token ids of block i as little-endian
uint32, extra key of the model and cache salt), keyed with the deployment secret when there is one. Why each
input is there: docs/architecture.md ("Block hash", and "Prefix-cache isolation" in the security model).
"""

from __future__ import annotations

from collections.abc import Sequence
from hashlib import blake2b
from typing import Any

from common.tokens import TOKEN_BYTES, as_packed

HASH_BYTES = 16
_EMPTY = blake2b(digest_size=HASH_BYTES)
_PRIMED: dict[bytes, Any] = {b"": _EMPTY}


def secret_key(secret: str | bytes | None) -> bytes:
    """The BLAKE2b key of a deployment secret (any length in, 32 bytes out; b"" for none: unkeyed)."""
    if not secret:
        return b""
    data = secret.encode() if isinstance(secret, str) else secret
    return blake2b(_field(b"pagedkv-secret") + _field(data), digest_size=32).digest()


def _field(data: bytes) -> bytes:
    """A variable-length field as it goes into a hash: its length (uint32 LE), then itself."""
    return len(data).to_bytes(4, "little") + data


def _hasher(key: bytes) -> Any:
    state = _PRIMED.get(key)
    if state is None:
        state = _PRIMED[key] = blake2b(digest_size=HASH_BYTES, key=key)
    return state


def root_hash(deployment: str = "pagedkv", key: bytes = b"") -> bytes:
    """The parent hash of every chain's first block (`key`: the deployment's secret_key, or b"")."""
    state = _hasher(key).copy()
    state.update(_field(b"pagedkv-root") + _field(deployment.encode()))
    return state.digest()


def extra_key(model_id: str, cache_salt: str | None = None, key: bytes = b"") -> bytes:
    """Everything besides the tokens that decides whether two blocks hold the same KV."""
    salt = b"\0" if cache_salt is None else b"\1" + _field(cache_salt.encode())
    state = _hasher(key).copy()
    state.update(_field(b"pagedkv-extra") + _field(model_id.encode()) + salt)
    return state.digest()


def chain_hashes(
    tokens: Sequence[int] | bytes | bytearray,
    block_size: int,
    parent: bytes,
    extra: bytes,
    start_block: int = 0,
    stop_block: int | None = None,
    key: bytes = b"",
) -> list[bytes]:
    """Chained hashes of full blocks [start_block, stop_block) of `tokens` (ids, or ids packed).

    `parent` is the hash of block start_block-1 (or the root when start_block is 0); `key` the deployment's
    secret_key (b"": unkeyed).
    """
    packed = as_packed(tokens)
    stride = block_size * TOKEN_BYTES
    full = len(packed) // stride
    stop = full if stop_block is None else min(stop_block, full)
    hashes: list[bytes] = []
    h = parent
    fresh = _hasher(key).copy  # copying a primed state beats parsing blake2b's keyword arguments per block
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


def group_extra_key(extra: bytes, group: int, key: bytes = b"") -> bytes:
    """The extra key of a layer group's chains (a pool with layer groups): the same tokens hash apart per group."""
    state = _hasher(key).copy()
    state.update(_field(b"pagedkv-group") + extra + group.to_bytes(4, "little"))
    return state.digest()
