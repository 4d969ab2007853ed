"""The executor's side of the shared KV tier (executor.shared_tier) on real files: blocks written behind and
reported once whole, loaded back byte for byte by another executor's store on the same directory, one tier id per
volume and a directory per layout, and each bad file (gone, truncated, corrupt, of another block) dropped, counted
and reported, never read; a dead writer's temporary file goes at a scan, a live one's stays."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from blockd.tiers import MEDIUM_SHARED, TierOp
from executor.kv_tiers import TEMP_SUFFIX, KvLayout
from executor.shared_tier import STALE_TEMP_S, SharedStore
from executor.tier_store import TierStore
from tests.executor.harness import run_landed
from tests.support.waiting import wait_for

LAYOUT = KvLayout("tiny-m", "float32", 1.0, 1.0, 16, 2, 2, 32, 4)
FP8 = KvLayout("tiny-m", "float8_e4m3fn", 0.5, 0.5, 16, 2, 2, 32, 1)


def _caches(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 16, 2, 32, generator=g), torch.randn(4, 16, 2, 32, generator=g)) for _ in range(2)]


def _store(directory: Path, seed: int, layout: KvLayout = LAYOUT, size: int = 1 << 20) -> TierStore:
    return TierStore(layout, _caches(seed), shared=SharedStore(layout, directory, size))


def _written(store: TierStore, count: int) -> list[bytes]:
    got: list[bytes] = []

    def done() -> bool:
        got.extend(store.take_shared_reports()[0])
        return len(got) >= count

    wait_for(done, timeout_s=30, what=f"{count} shared writes reported")
    return got


def _block(store: TierStore, block: int) -> list[torch.Tensor]:
    return [t[block].clone() for kv in store.kv_caches for t in kv]


H1, H2 = bytes(range(16)), bytes(range(1, 17))


def test_a_block_written_by_one_executor_loads_byte_for_byte_on_another(tmp_path: Path) -> None:
    a, b = _store(tmp_path, 1), _store(tmp_path, 2)
    assert a.shared is not None and b.shared is not None
    assert a.shared.shared_id == b.shared.shared_id  # one volume, one layout: one tier
    assert run_landed(a, [TierOp("save", MEDIUM_SHARED, H1, block=3)]) == []
    assert _written(a, 1) == [H1]
    assert [h.block_hash for h in b.spec().shared] == [H1]  # what b reports when it registers
    assert run_landed(b, [TierOp("load", MEDIUM_SHARED, H1, block=0)]) == []
    for got, want in zip(_block(b, 0), _block(a, 3), strict=True):
        assert torch.equal(got, want)
    assert b.report()["shared_loads"] == 1 and a.report()["shared_written"] == 1
    run_landed(a, [TierOp("discard", MEDIUM_SHARED, H1)])
    a.flush()
    assert b.spec().shared == []


def test_another_layout_gets_its_own_tier_and_never_meets_the_same_file_name(tmp_path: Path) -> None:
    a, fp8 = _store(tmp_path, 1), _store(tmp_path, 2, FP8)
    assert a.shared is not None and fp8.shared is not None
    assert a.shared.shared_id != fp8.shared.shared_id and a.shared.dir != fp8.shared.dir
    run_landed(a, [TierOp("save", MEDIUM_SHARED, H1, block=0)])
    _written(a, 1)
    assert fp8.spec().shared == []
    # Another volume: another tier id, whatever the layout.
    other = _store(tmp_path / "elsewhere", 3)
    assert other.shared is not None and other.shared.shared_id != a.shared.shared_id


@pytest.mark.parametrize("damage", ["gone", "truncated", "corrupt", "renamed"])
def test_a_bad_file_is_dropped_counted_and_reported_never_read(tmp_path: Path, damage: str) -> None:
    a, b = _store(tmp_path, 1), _store(tmp_path, 2)
    assert a.shared is not None and b.shared is not None
    run_landed(a, [TierOp("save", MEDIUM_SHARED, H1, block=1), TierOp("save", MEDIUM_SHARED, H2, block=2)])
    _written(a, 2)
    path = a.shared.dir / f"{H1.hex()}.kvb"
    data = path.read_bytes()
    if damage == "gone":
        path.unlink()
    elif damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "corrupt":
        path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    else:  # another block's file under H1's name
        path.write_bytes((a.shared.dir / f"{H2.hex()}.kvb").read_bytes())
    before = _block(b, 0)
    assert run_landed(b, [TierOp("load", MEDIUM_SHARED, H1, block=0)]) == [0]
    assert all(torch.equal(x, y) for x, y in zip(_block(b, 0), before, strict=True))  # nothing read into it
    reason = {"gone": "truncated", "truncated": "truncated", "corrupt": "corrupt", "renamed": "foreign"}[damage]
    assert b.report()[f"shared_dropped_{reason}"] == 1
    assert b.take_shared_reports() == ([], [H1])  # blockd forgets it
    assert not path.exists()  # dropped files go (another layout's live in their own directory)
    assert run_landed(b, [TierOp("load", MEDIUM_SHARED, H2, block=0)]) == []  # the good one still loads


def test_a_scan_removes_a_dead_writers_temporary_file_and_keeps_a_live_ones(tmp_path: Path) -> None:
    a = _store(tmp_path, 1)
    assert a.shared is not None
    dead = a.shared.dir / f"{H1.hex()}.kvb.123.ab{TEMP_SUFFIX}"
    live = a.shared.dir / f"{H2.hex()}.kvb.456.cd{TEMP_SUFFIX}"
    dead.write_bytes(b"half")
    live.write_bytes(b"half")
    old = time.time() - STALE_TEMP_S - 60
    os.utime(dead, (old, old))
    assert a.spec().shared == []
    assert not dead.exists() and live.exists()


def test_the_report_keeps_the_newest_files_within_the_budget(tmp_path: Path) -> None:
    size = 2 * LAYOUT.file_bytes
    a = _store(tmp_path, 1, size=size)
    assert a.shared is not None and a.shared.blocks == 2
    hashes = [bytes([i]) * 16 for i in range(3)]
    for i, h in enumerate(hashes):
        run_landed(a, [TierOp("save", MEDIUM_SHARED, h, block=i)])
        _written(a, 1)
        stamp = time.time() - 100 + i
        os.utime(a.shared.dir / f"{h.hex()}.kvb", (stamp, stamp))
    assert [held.block_hash for held in a.spec().shared] == hashes[1:]
