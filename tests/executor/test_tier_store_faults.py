"""The disk tier's failure modes on real files, as `pagedkv chaos --only tiers` found them: a write that fails (a
full disk: RLIMIT_FSIZE in a child process, so the write gets EFBIG) leaves no partial file and is reported to
blockd as not on disk, never loaded nor counted as a drop; a flipped byte in a block file's header reads as corrupt,
not as another layout; a whole block file of another model, in a directory two deployments share, is left to it."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest
import torch

from blockd.tiers import MEDIUM_DISK, TierOp
from common import processes
from executor.kv_tiers import MAX_READ_BYTES, BadBlock, Dropped, KvLayout, decode_block, encode_block, read_block_file
from executor.tier_store import TierStore
from tests.executor.harness import run_landed

LAYOUT = KvLayout("tiny-m", "float32", 1.0, 1.0, 16, 2, 2, 32, 4)  # 16 KiB a block
OTHER = KvLayout("tiny-other", "float32", 1.0, 1.0, 16, 2, 2, 32, 4)

_FULL_DISK_CHILD = """
import json, sys
from pathlib import Path
import torch
from blockd.tiers import MEDIUM_DISK, TierOp
from executor.kv_tiers import KvLayout
from executor.tier_store import TierStore

disk = Path(sys.argv[1])
caches = [(torch.randn(4, 16, 2, 32), torch.randn(4, 16, 2, 32)) for _ in range(2)]
store = TierStore(KvLayout("tiny-m", "float32", 1.0, 1.0, 16, 2, 2, 32, 4), caches, disk_dir=disk, disk_bytes=1 << 20)
block_hash = bytes(range(16))
store.run([TierOp("save", MEDIUM_DISK, block_hash, block=1)])
store.flush()
failed = store.run([TierOp("load", MEDIUM_DISK, block_hash, block=2)]).failed  # sent before blockd heard
lost = store.take_drops()
files = sorted(p.name for p in disk.iterdir())
print(json.dumps({"report": store.report(), "failed": failed, "lost": [h.hex() for h in lost], "files": files}))
"""


def test_a_write_to_a_full_disk_leaves_nothing_and_blockd_hears_of_it(tmp_path: Path) -> None:
    disk, log = tmp_path / "kv", tmp_path / "child.log"
    disk.mkdir()
    child = processes.start(
        [sys.executable, "-c", _FULL_DISK_CHILD, str(disk)], log, file_size_limit=LAYOUT.file_bytes // 2
    )
    assert child.wait(timeout=120) == 0, log.read_text()[-3000:]
    result = json.loads(log.read_text().strip().splitlines()[-1])
    report = result["report"]
    assert report["write_failures"] == 1 and report["written"] == 0, result
    assert result["files"] == [], result  # no partial temporary file taking more of the full disk
    assert result["failed"] == [2], result  # the load fails: the block is computed instead
    assert report["dropped_truncated"] == 0 and report["disk_held"] == 0, result  # a failed write, not a drop
    assert result["lost"] == [bytes(range(16)).hex()], result  # blockd's directory forgets it


@pytest.mark.parametrize("offset", [4, 20, 40, 60])  # format, the block hash, the checksum, the layout
def test_a_byte_flipped_in_the_header_is_never_read(offset: int) -> None:
    block_hash = bytes(16)
    data = bytearray(encode_block(LAYOUT, block_hash, bytes(LAYOUT.block_bytes)))
    data[offset] ^= 0x5A
    with pytest.raises(BadBlock) as raised:
        decode_block(LAYOUT, block_hash, bytes(data))
    assert raised.value.reason == (Dropped.STALE if offset == 4 else Dropped.CORRUPT)
    assert not raised.value.theirs


def test_a_directory_shared_with_another_model_keeps_its_files(tmp_path: Path) -> None:
    disk = tmp_path / "kv"
    disk.mkdir()
    payload = torch.randn(LAYOUT.block_bytes // 4).numpy().tobytes()
    ours, theirs, copied = bytes([1]) * 16, bytes([2]) * 16, bytes([3]) * 16
    (disk / f"{ours.hex()}.kvb").write_bytes(encode_block(LAYOUT, ours, payload))
    (disk / f"{theirs.hex()}.kvb").write_bytes(encode_block(OTHER, theirs, payload))  # the other model's own
    (disk / f"{copied.hex()}.kvb").write_bytes(encode_block(OTHER, theirs, payload))  # under another name
    caches = [(torch.zeros(4, 16, 2, 32), torch.zeros(4, 16, 2, 32)) for _ in range(2)]
    store = TierStore(LAYOUT, caches, disk_dir=disk, disk_bytes=1 << 20)
    try:
        assert list(store.disk) == [ours]
        assert store.report()["dropped_foreign"] == 2
        assert (disk / f"{theirs.hex()}.kvb").exists()  # whole and the other's: it still reads it
        assert not (disk / f"{copied.hex()}.kvb").exists()  # nobody's: gone
        assert run_landed(store, [TierOp("load", MEDIUM_DISK, ours, block=0)]) == []
        assert caches[0][0][0].reshape(-1).view(torch.uint8).numpy().tobytes() == payload[: LAYOUT.layer_bytes]
    finally:
        store.flush()


@pytest.mark.parametrize("model_id", ["m", "another-model-whose-id-is-much-longer-than-ours"])
def test_a_file_of_another_layout_reads_as_foreign_whatever_its_size(tmp_path: Path, model_id: str) -> None:
    """The reader reads what the header claims (plus a byte), not a size of its own layout: another model's file
    under our block's name is foreign, not truncated, however long its layout; one whose header claims more than
    the read bound is foreign unread."""
    block_hash = bytes([7]) * 16
    theirs = KvLayout(model_id, "float32", 1.0, 1.0, 16, 3, 2, 32, 4)
    path = tmp_path / "block.kvb"
    path.write_bytes(encode_block(theirs, block_hash, bytes(theirs.block_bytes)))
    with pytest.raises(BadBlock) as raised:
        read_block_file(LAYOUT, block_hash, path.open("rb"))
    assert raised.value.reason is Dropped.FOREIGN and raised.value.theirs
    huge = bytearray(encode_block(LAYOUT, block_hash, bytes(LAYOUT.block_bytes)))
    huge[8:16] = (MAX_READ_BYTES + 1).to_bytes(8, "little")  # the payload length field

    class Counted(io.BytesIO):
        read_bytes = 0

        def readinto(self, buffer) -> int:  # type: ignore[override]
            n = super().readinto(buffer)
            Counted.read_bytes += n
            return n

    with pytest.raises(BadBlock) as raised:
        read_block_file(LAYOUT, block_hash, Counted(bytes(huge)))
    assert raised.value.reason is Dropped.FOREIGN and Counted.read_bytes == 48  # the header alone


def test_a_reused_read_buffer_never_lends_its_old_bytes(tmp_path: Path) -> None:
    """Reads go into buffers used again and again: a file cut short, or one a byte longer than a block file, read
    into a buffer that held a whole block is dropped (truncated, corrupt), never landed with the bytes left there;
    a whole file lands exactly its own bytes, however many loads the buffer has served."""
    disk = tmp_path / "kv"
    disk.mkdir()
    payloads = {bytes([i]) * 16: torch.randn(LAYOUT.block_bytes // 4).numpy().tobytes() for i in range(1, 7)}
    for block_hash, payload in payloads.items():
        (disk / f"{block_hash.hex()}.kvb").write_bytes(encode_block(LAYOUT, block_hash, payload))
    caches = [(torch.zeros(4, 16, 2, 32), torch.zeros(4, 16, 2, 32)) for _ in range(2)]
    store = TierStore(LAYOUT, caches, disk_dir=disk, disk_bytes=1 << 20)  # (it scans them in)
    try:
        hashes = list(payloads)
        whole, short, long = hashes[0], hashes[1], hashes[2]
        assert run_landed(store, [TierOp("load", MEDIUM_DISK, whole, block=0)]) == []  # the buffer holds a block
        path = disk / f"{short.hex()}.kvb"
        path.write_bytes(path.read_bytes()[:-100])
        path = disk / f"{long.hex()}.kvb"
        path.write_bytes(path.read_bytes() + b"\0")
        before = caches[0][0][1].clone()
        assert run_landed(store, [TierOp("load", MEDIUM_DISK, short, block=1)]) == [1]
        assert run_landed(store, [TierOp("load", MEDIUM_DISK, long, block=1)]) == [1]
        assert torch.equal(caches[0][0][1], before)  # nothing landed
        report = store.report()
        assert report["dropped_truncated"] == 1 and report["dropped_corrupt"] == 1, report
        for round_ in range(3):  # every buffer reused, in another order each time
            order = hashes[3:] if round_ % 2 else hashes[3:][::-1]
            ops = [TierOp("load", MEDIUM_DISK, h, block=i) for i, h in enumerate(order)]
            assert run_landed(store, ops) == []
            for i, block_hash in enumerate(order):
                got = b"".join(t[i].reshape(-1).view(torch.uint8).numpy().tobytes() for kv in caches for t in kv)
                assert got == payloads[block_hash]
    finally:
        store.flush()


def test_a_read_buffer_too_small_for_the_file_is_not_used(tmp_path: Path) -> None:
    """A file longer than the reader's buffer is read into a buffer of its own (to tell what it is), whole."""
    block_hash = bytes([9]) * 16
    path = tmp_path / "block.kvb"
    payload = bytes(range(256)) * (LAYOUT.block_bytes // 256)
    path.write_bytes(encode_block(LAYOUT, block_hash, payload))
    small = bytearray(64)
    got = read_block_file(LAYOUT, block_hash, path.open("rb", buffering=0), small)
    assert bytes(got) == payload and small == bytearray(64)
    reused = bytearray(b"\xff" * (LAYOUT.file_bytes + 1))
    got = read_block_file(LAYOUT, block_hash, path.open("rb", buffering=0), reused)
    assert bytes(got) == payload and got.obj is reused  # in the reader's own buffer, no copy
