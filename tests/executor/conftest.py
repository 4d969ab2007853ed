"""Executor tests: a real blockd process per test, checked for leaked blocks at teardown."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.blockd.conftest import BlockdProcess


@pytest.fixture
def blockd(tmp_path: Path) -> Iterator[BlockdProcess]:
    """A real blockd process (no persistence); at teardown every pool must hold zero blocks."""
    daemon = BlockdProcess(["--no-persistence"], tmp_path / "blockd.log")
    daemon.start()
    yield daemon
    try:
        if daemon.alive():
            with daemon.client() as client:
                stats = client.stats()
                leaks = {p.pool_id: p.blocks_in_use for p in stats.pools if p.blocks_in_use}
                assert not leaks, f"blocks still in use after the test: {leaks}"
                assert client.check() == []
    finally:
        if daemon.alive():
            daemon.kill9()
