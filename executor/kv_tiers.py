"""What a block stored outside the device is: its KV layout, and the block file format of the disk tier.

A stored block is addressed by its chained hash (blockd.hashing) plus the layout of the bytes (model id, KV dtype
with its fp8 scales, block size, layers, KV heads, head dim): a block file carries both, and a checksum of the
bytes, so that a corrupt, partial (torn), foreign or stale file is recognised and dropped, never read.

File: `MAGIC | format u16 | layout length u16 | payload length u64 | block hash 16 | checksum 16 | layout JSON |
payload`, named `<hash hex>.kvb`, written to a temporary name and renamed into place. The checksum is XXH3-128
over the block hash, the layout and the payload: every load checks it. It is there for accidents (a torn write, a
flipped bit, a file cut short or copied in from elsewhere), which a non-cryptographic hash catches as well as any:
whoever can write into a tier's directory could write a matching SHA-256 as easily, so that directory's
permissions are the defence against them. At some 40 GB/s it costs a 128 KiB block 3 us, against SHA-256's 75 us
(with SHA instructions), which was the largest part of a disk load.
"""

from __future__ import annotations

import enum
import functools
import json
import os
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import BinaryIO, Final

import xxhash

MAGIC: Final = b"PKVB"
# 2: the checksum covers the block hash and the layout too; 3: SHA-256, not BLAKE2b; 4: XXH3-128, not SHA-256
FORMAT: Final = 4
SUFFIX: Final = ".kvb"
TEMP_SUFFIX: Final = ".tmp"
_HEADER = struct.Struct("<4sHHQ16s16s")
# A block file claiming more bytes than this (and than four of the reader's own) is not read to be classified.
MAX_READ_BYTES: Final = 64 << 20


@dataclass(frozen=True)
class KvLayout:
    """How one block's bytes are laid out: for each layer, K then V, each `[block_size, kv_heads, head_dim]`."""

    model_id: str
    dtype: str
    k_scale: float
    v_scale: float
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    element_bytes: int

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer's K (or V) block."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.element_bytes

    @property
    def block_bytes(self) -> int:
        return 2 * self.num_layers * self.layer_bytes

    def encoded(self) -> bytes:
        return self._encoded

    @functools.cached_property
    def _encoded(self) -> bytes:  # (every block read and write checks it: made once)
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()

    @property
    def file_bytes(self) -> int:
        """The size of one block file: what a disk budget is divided by."""
        return _HEADER.size + len(self.encoded()) + self.block_bytes


class Dropped(enum.Enum):
    """Why a stored block was not used (each is counted)."""

    TRUNCATED = "truncated"  # shorter than its header says, or a temporary file a write left behind (torn)
    CORRUPT = "corrupt"  # not a block file, or its bytes do not match its checksum
    FOREIGN = "foreign"  # another layout (model, dtype, block size, shape) or another block's file
    STALE = "stale"  # an older (or newer) format of this file


class BadBlock(Exception):
    def __init__(self, reason: Dropped, detail: str, *, theirs: bool = False) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        # A whole block file of another layout: another deployment's sharing the directory, not to be deleted.
        self.theirs = theirs


def checksum(block_hash: bytes, encoded_layout: bytes, payload: bytes | bytearray | memoryview) -> bytes:
    digest = xxhash.xxh3_128(block_hash)
    digest.update(len(encoded_layout).to_bytes(2, "little") + encoded_layout)
    digest.update(payload)
    return digest.digest()


def encode_block(layout: KvLayout, block_hash: bytes, payload: bytes | bytearray | memoryview) -> bytes:
    encoded = layout.encoded()
    header = _HEADER.pack(MAGIC, FORMAT, len(encoded), len(payload), block_hash, checksum(block_hash, encoded, payload))
    return b"".join((header, encoded, payload))


def write_block_file(path: Path, layout: KvLayout, block_hash: bytes, payload: bytes, temp_tag: str = "") -> None:
    """Write a block file whole or not at all: to a temporary name (`temp_tag` makes it this writer's own), then
    renamed into place, so a kill mid-write leaves only the temporary file; a failed write removes it (a full
    disk's partial file would only take more of it)."""
    temp = path.with_name(path.name + temp_tag + TEMP_SUFFIX)
    try:
        temp.write_bytes(encode_block(layout, block_hash, payload))
        os.replace(temp, path)
    except OSError:
        temp.unlink(missing_ok=True)
        raise


def read_block_file(layout: KvLayout, block_hash: bytes, file: BinaryIO, buffer: bytearray | None = None) -> memoryview:
    """The checked payload of an open block file (closed after), writable, so a tensor can wrap it without a copy:
    a view of `buffer` where the file fits in it (a reader's reused buffer), of a new one where not.
    Raises BadBlock (why it must not be read) or OSError (it cannot be read). Called off the step's thread: a
    file opened there is read here even if it has been deleted or replaced since (its open descriptor keeps it).
    It reads the header first and then only what the header says, plus a byte: a file that claims more than
    `MAX_READ_BYTES` (or four of this layout's) is another layout's, whatever else it holds, and is not read."""
    with file:
        head = bytearray(_HEADER.size)
        data: bytearray | memoryview = head[: _read_into(file, memoryview(head))]
        if len(data) == _HEADER.size:
            magic, fmt, layout_len, payload_len, stored_hash, _ = _HEADER.unpack_from(head)
            total = _HEADER.size + layout_len + payload_len
            if magic == MAGIC and fmt == FORMAT and total > max(MAX_READ_BYTES, 4 * layout.file_bytes):
                raise BadBlock(
                    Dropped.FOREIGN,
                    f"another KV layout ({payload_len:,} bytes a block): not read",
                    theirs=stored_hash == block_hash,
                )
            if magic == MAGIC and fmt == FORMAT:
                if buffer is None or len(buffer) < total + 1:
                    buffer = bytearray(total + 1)
                view = memoryview(buffer)[: total + 1]
                view[: _HEADER.size] = head
                data = view[: _read_into(file, view, _HEADER.size)]
    return decode_block(layout, block_hash, data)


def _read_into(file: BinaryIO, view: memoryview, start: int = 0) -> int:
    """Fill `view` from `start` as far as the file goes; returns how far it got."""
    got = start
    while got < len(view) and (n := file.readinto(view[got:])):
        got += n
    return got


def decode_block(layout: KvLayout, block_hash: bytes, data: bytes | bytearray | memoryview) -> memoryview:
    """The payload of a block file, or BadBlock saying why it must not be read."""
    if len(data) < _HEADER.size:
        raise BadBlock(Dropped.TRUNCATED, f"{len(data)} bytes, less than a header")
    magic, fmt, layout_len, payload_len, stored_hash, stored_sum = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise BadBlock(Dropped.CORRUPT, "not a block file")
    if fmt != FORMAT:
        raise BadBlock(Dropped.STALE, f"format {fmt}, this executor reads {FORMAT}")
    if len(data) < _HEADER.size + layout_len + payload_len:
        raise BadBlock(Dropped.TRUNCATED, f"{len(data)} bytes of {_HEADER.size + layout_len + payload_len}")
    view = memoryview(data)
    start = _HEADER.size + layout_len
    payload = view[start : start + payload_len]
    stored_layout = bytes(view[_HEADER.size : start])
    if len(data) != start + payload_len or checksum(stored_hash, stored_layout, payload) != stored_sum:
        raise BadBlock(Dropped.CORRUPT, "its bytes do not match its checksum")
    if stored_layout != layout.encoded() or payload_len != layout.block_bytes:
        raise BadBlock(Dropped.FOREIGN, "another KV layout", theirs=stored_hash == block_hash)
    if stored_hash != block_hash:
        raise BadBlock(Dropped.FOREIGN, "another block's content")
    return payload
