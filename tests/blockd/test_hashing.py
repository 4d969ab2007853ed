"""The block hash: stable across processes, chained, keyed by model and salt, full blocks only."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from hashlib import blake2b
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blockd.hashing import HASH_BYTES, chain_hashes, extra_key, root_hash, secret_key
from common.tokens import pack_tokens, unpack_tokens

REPO = Path(__file__).resolve().parents[2]
ROOT = root_hash()
EXTRA = extra_key("llama-3-8b")

CASES = [
    ([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, "llama-3-8b", None),
    ([0, 2**32 - 1, 7, 7, 65536, 3], 2, "llama-3-8b", "tenant-a"),
    (list(range(100, 164)), 16, "qwen2-7b", ""),
]

_CHILD = """
import json, sys
from blockd.hashing import chain_hashes, extra_key, root_hash
cases = json.loads(sys.stdin.read())
out = [[h.hex() for h in chain_hashes(t, bs, root_hash(), extra_key(model, salt))] for t, bs, model, salt in cases]
print(json.dumps(out))
"""


def reference_chain(tokens: list[int], bs: int, parent: bytes, extra: bytes, key: bytes = b"") -> list[bytes]:
    """The documented formula, written out independently: BLAKE2b-128(parent, uint32-LE ids, extra)."""
    out = []
    for i in range(len(tokens) // bs):
        block = struct.pack(f"<{bs}I", *tokens[i * bs : (i + 1) * bs])
        parent = blake2b(parent + block + extra, digest_size=16, key=key).digest()
        out.append(parent)
    return out


def field(data: bytes) -> bytes:
    return struct.pack("<I", len(data)) + data


@pytest.mark.parametrize("hashseed", ["0", "12345"])
def test_hash_is_identical_in_another_process(hashseed: str) -> None:
    env = dict(os.environ, PYTHONHASHSEED=hashseed, PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD],
        input=json.dumps(CASES),
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=60,
        check=True,
    )
    theirs = json.loads(proc.stdout)
    ours = [[h.hex() for h in chain_hashes(t, bs, ROOT, extra_key(m, s))] for t, bs, m, s in CASES]
    assert theirs == ours
    assert all(ours)


@pytest.mark.parametrize(("tokens", "bs", "model", "salt"), CASES)
def test_hash_follows_the_documented_formula(tokens: list[int], bs: int, model: str, salt: str | None) -> None:
    root = blake2b(field(b"pagedkv-root") + field(b"pagedkv"), digest_size=16).digest()
    assert root == ROOT
    extra = extra_key(model, salt)
    tail = b"\0" if salt is None else b"\1" + field(salt.encode())
    assert extra == blake2b(field(b"pagedkv-extra") + field(model.encode()) + tail, digest_size=16).digest()
    assert chain_hashes(tokens, bs, root, extra) == reference_chain(tokens, bs, root, extra)
    assert all(len(h) == HASH_BYTES == 16 for h in chain_hashes(tokens, bs, root, extra))


def test_hashes_chain() -> None:
    tokens = list(range(16))
    base = chain_hashes(tokens, 4, ROOT, EXTRA)
    assert len(set(base)) == 4
    # Changing block 0 changes every later hash, though blocks 1-3 hold the same tokens.
    changed0 = chain_hashes([99, *tokens[1:]], 4, ROOT, EXTRA)
    assert all(a != b for a, b in zip(base, changed0, strict=True))
    # Changing block 2 keeps blocks 0-1 and changes 2-3.
    changed2 = chain_hashes([*tokens[:9], 99, *tokens[10:]], 4, ROOT, EXTRA)
    assert changed2[:2] == base[:2]
    assert changed2[2] != base[2] and changed2[3] != base[3]
    # The same block content at another position (another parent) hashes differently.
    repeated = chain_hashes([1, 2, 3, 4] * 2, 4, ROOT, EXTRA)
    assert repeated[0] != repeated[1]


def test_model_id_salt_and_deployment_change_the_hash() -> None:
    tokens = [5, 6, 7, 8, 9, 10, 11, 12]
    variants = {
        "plain": chain_hashes(tokens, 4, ROOT, extra_key("model-a")),
        "other model": chain_hashes(tokens, 4, ROOT, extra_key("model-b")),
        "salt a": chain_hashes(tokens, 4, ROOT, extra_key("model-a", "a")),
        "salt b": chain_hashes(tokens, 4, ROOT, extra_key("model-a", "b")),
        "empty salt": chain_hashes(tokens, 4, ROOT, extra_key("model-a", "")),
        "other deployment": chain_hashes(tokens, 4, root_hash("staging"), extra_key("model-a")),
    }
    every_hash = [h for hashes in variants.values() for h in hashes]
    assert len(set(every_hash)) == len(every_hash), "two variants share a hash"
    assert extra_key("model-a") == extra_key("model-a", None)
    # Model id and salt cannot be confused by moving characters between them.
    assert extra_key("ab", "c") != extra_key("a", "bc")


def test_only_full_blocks_are_hashed() -> None:
    assert chain_hashes([1, 2, 3], 4, ROOT, EXTRA) == []
    assert chain_hashes([], 4, ROOT, EXTRA) == []
    full = chain_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, ROOT, EXTRA)
    for tail in ([], [9], [9, 10, 11], [0, 0, 0]):
        assert chain_hashes([1, 2, 3, 4, 5, 6, 7, 8, *tail], 4, ROOT, EXTRA) == full
    assert len(chain_hashes(list(range(11)), 4, ROOT, EXTRA)) == 2


@settings(max_examples=200, derandomize=True, database=None, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=40),
    bs=st.integers(1, 6),
    start=st.integers(0, 12),
    stop=st.one_of(st.none(), st.integers(0, 14)),
)
def test_slicing_equals_the_full_computation(tokens: list[int], bs: int, start: int, stop: int | None) -> None:
    full = chain_hashes(tokens, bs, ROOT, EXTRA)
    assert full == reference_chain(tokens, bs, ROOT, EXTRA)
    parent = full[start - 1] if 0 < start <= len(full) else ROOT
    part = chain_hashes(tokens, bs, parent, EXTRA, start, stop)
    if start <= len(full):
        assert part == full[start:stop]
    else:
        assert part == []
    # Computing a chain piece by piece (as commit does) gives the whole chain.
    pieces: list[bytes] = []
    for cut in range(0, len(full) + 1, 2):
        pieces += chain_hashes(tokens, bs, pieces[-1] if pieces else ROOT, EXTRA, len(pieces), cut)
    pieces += chain_hashes(tokens, bs, pieces[-1] if pieces else ROOT, EXTRA, len(pieces))
    assert pieces == full


@settings(max_examples=100, derandomize=True, database=None, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**32 - 1), max_size=30), bs=st.integers(1, 5))
def test_packed_and_unpacked_ids_hash_alike(tokens: list[int], bs: int) -> None:
    packed = pack_tokens(tokens)
    assert packed == struct.pack(f"<{len(tokens)}I", *tokens)
    assert unpack_tokens(packed) == tokens
    assert chain_hashes(packed, bs, ROOT, EXTRA) == chain_hashes(tokens, bs, ROOT, EXTRA)
    assert chain_hashes(bytearray(packed), bs, ROOT, EXTRA) == chain_hashes(tokens, bs, ROOT, EXTRA)


@pytest.mark.parametrize("bad", [[-1], [2**32], [1, 2, 3, 2**40]])
def test_ids_outside_uint32_are_refused(bad: list[int]) -> None:
    with pytest.raises(OverflowError):
        pack_tokens(bad)
    with pytest.raises(OverflowError):
        chain_hashes(bad, 1, ROOT, EXTRA)


def test_variable_fields_are_length_prefixed() -> None:
    """Moving bytes between the deployment name, the model id and the salt never gives the same hash."""
    assert extra_key("ab", "c") != extra_key("a", "bc") != extra_key("abc", "")
    assert extra_key("a\0\1b") != extra_key("a", "b")
    assert extra_key("m", "") != extra_key("m", None)
    assert root_hash("a") != root_hash("a\0")


def test_a_deployment_secret_keys_every_hash() -> None:
    """With --deployment-secret every hash is a keyed BLAKE2b: nobody without the secret can recompute one, so
    the hashes stored in Redis do not confirm a guessed prompt."""
    tokens = list(range(32))
    key = secret_key("s3cret")
    assert len(key) == 32 and secret_key(None) == secret_key("") == b""
    plain = chain_hashes(tokens, 4, root_hash(), extra_key("m"))
    keyed = chain_hashes(tokens, 4, root_hash(key=key), extra_key("m", key=key), key=key)
    other = secret_key("another")
    keyed_other = chain_hashes(tokens, 4, root_hash(key=other), extra_key("m", key=other), key=other)
    assert len(keyed) == len(plain) == 8
    assert not set(plain) & set(keyed) and not set(keyed) & set(keyed_other)
    # Knowing one stored hash (a parent) does not let anyone check the next block without the key.
    assert chain_hashes(tokens, 4, keyed[0], extra_key("m", key=key), 1, 2) != [keyed[1]]
    assert chain_hashes(tokens, 4, keyed[0], extra_key("m", key=key), 1, 2, key) == [keyed[1]]
    assert keyed == reference_chain(tokens, 4, root_hash(key=key), extra_key("m", key=key), key)
    # Deterministic: the same secret gives the same hashes (a restarted blockd finds its prefixes).
    assert keyed == chain_hashes(tokens, 4, root_hash(key=key), extra_key("m", key=key), key=key)
