"""The disk and shared tiers' faults for `pagedkv chaos`'s tiers phase (its scenarios: chaos.py's `TiersPhase`): the
token prompts whose block files it aims at, those files' names, the damage it does to them (truncated; bytes flipped in
the payload or the header; another model's file under one of their names), the hung write that lets writes queue
behind it, and each executor's tier counters (`LoadReport.tiers`).

What each scenario must show: docs/architecture.md ("Faults and attacks: `pagedkv chaos`").
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Final

from blockd.hashing import chain_hashes, extra_key, root_hash
from common.auth import ClientCurve
from common.tokens import pack_tokens
from executor.client import ExecutorClient, ExecutorRejected, ExecutorUnavailable
from executor.kv_tiers import SUFFIX, TEMP_SUFFIX

BLOCK_SIZE: Final = 16
PROMPT_BLOCKS: Final = 4  # full blocks a prompt holds (and one token more, so that all four can be reused)
# Flags of an executor with tiers: a device of 24 blocks (the ten load prompts hold 40), a host tier of 4 blocks
# (16 KiB each for chaos's model), a disk tier of some 250.
DEVICE_BLOCKS: Final = 24
HOST_KV: Final = "64KiB"
DISK_KV: Final = "4MiB"
# The full disk: no file of the executor may grow past this (a block file is 16 KiB of payload and its header).
FULL_DISK_BYTES: Final = 16 * 1024
DAMAGE: Final = ("truncated", "payload", "header")  # what `damage` does to a block file


def tier_flags(disk_dir: Path) -> list[str]:
    return [
        "--block-size",
        str(BLOCK_SIZE),
        "--num-blocks",
        str(DEVICE_BLOCKS),
        "--host-kv-memory",
        HOST_KV,
        "--disk-kv-dir",
        str(disk_dir),
        "--disk-kv-size",
        DISK_KV,
    ]


SHARED_KV: Final = "4MiB"


def shared_flags(shared_dir: Path) -> list[str]:
    """Flags of an executor with the shared tier alone (no host or disk tier): what its device evicts is loaded
    back from the volume, where every block it commits is written."""
    return [
        "--block-size",
        str(BLOCK_SIZE),
        "--num-blocks",
        str(DEVICE_BLOCKS),
        "--shared-kv-dir",
        str(shared_dir),
        "--shared-kv-size",
        SHARED_KV,
    ]


def shared_file(shared_dir: Path, block_hash: bytes) -> Path | None:
    """A block's file on the shared volume (under its layout's directory), if there is one."""
    return next(shared_dir.glob(f"*/{block_hash.hex()}{SUFFIX}"), None)


def token_prompts(prefix: str, count: int, seed: int, vocab_size: int) -> dict[str, list[int]]:
    """`count` prompts of random token ids (clear of the low ids, where tokenizers keep their special tokens), each
    `PROMPT_BLOCKS` full blocks and a token."""
    rng = random.Random(seed)
    length = PROMPT_BLOCKS * BLOCK_SIZE + 1
    return {f"{prefix}-{i}": [rng.randrange(16, vocab_size) for _ in range(length)] for i in range(count)}


def block_hashes(model_id: str, tokens: list[int]) -> list[bytes]:
    """The hashes of a prompt's reusable blocks, as blockd names them (an unkeyed deployment, no cache salt): the
    names of their block files."""
    packed = pack_tokens(tokens)
    return chain_hashes(packed, BLOCK_SIZE, root_hash(), extra_key(model_id), 0, PROMPT_BLOCKS)


def block_file(disk_dir: Path, block_hash: bytes) -> Path:
    return disk_dir / f"{block_hash.hex()}{SUFFIX}"


def block_files(disk_dir: Path) -> list[Path]:
    return sorted(p for p in disk_dir.iterdir() if p.name.endswith(SUFFIX))


def temp_files(disk_dir: Path) -> list[Path]:
    return sorted(p for p in disk_dir.iterdir() if p.name.endswith(TEMP_SUFFIX))


def hang_writes(disk_dir: Path, hashes: list[bytes]) -> int:
    """A FIFO where the writer's temporary file for each of `hashes` goes: its open blocks until a reader comes,
    which none does, as a write to a stalled disk hangs, so every later write queues behind it. Returns how many
    were set (none where the block is on disk already)."""
    set_ = 0
    for block_hash in hashes:
        path = block_file(disk_dir, block_hash)
        if not path.exists():
            os.mkfifo(path.with_name(path.name + TEMP_SUFFIX))
            set_ += 1
    return set_


def damage(path: Path, how: str) -> None:
    """A block file truncated to half, or one byte flipped in its payload (the last) or its header (in the block
    hash the header names: byte 20)."""
    data = bytearray(path.read_bytes())
    if how == "truncated":
        data = data[: len(data) // 2]
    else:
        data[-1 if how == "payload" else 20] ^= 0x5A
    path.write_bytes(bytes(data))


def tier_report(endpoint: str, curve: ClientCurve) -> dict[str, int] | None:
    """An executor's tier counters (None while it does not answer)."""
    try:
        with ExecutorClient(endpoint, timeout_s=5, curve=curve) as client:
            return dict(client.load().tiers)
    except (ExecutorUnavailable, ExecutorRejected):  # down, restarting, busy past the timeout: none this time
        return None
