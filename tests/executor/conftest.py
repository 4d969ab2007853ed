"""Session-wide tiny random checkpoints, written by `executor.make_model.write_model` like a downloaded model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from executor.make_model import write_model

# Small enough to build in well under a second each, big enough to have GQA (4 query / 2 kv heads), two layers
# and a real BPE vocabulary.
TINY: dict[str, Any] = dict(
    hidden_size=128, layers=2, heads=4, kv_heads=2, vocab_size=512, max_position=512, dtype="float32", seed=0
)
TINY_ARCHS = ("llama", "qwen2", "mistral")


@pytest.fixture(scope="session")
def tiny_options() -> dict[str, Any]:
    """The write_model options every tiny fixture model uses (without arch): to write a twin for comparison."""
    return dict(TINY)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """arch -> directory of a tiny checkpoint, for "llama", "qwen2" (tied, qkv biases) and "mistral"."""
    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: write_model(root / f"tiny-{arch}", arch=arch, quiet=True, **TINY) for arch in TINY_ARCHS}


@pytest.fixture(scope="session")
def llama3_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama with Llama 3.1 rope scaling (original context 64 of 512)."""
    root = tmp_path_factory.mktemp("tiny-models-llama3")
    return write_model(root / "tiny-llama3", arch="llama", rope_scaling="llama3", quiet=True, **TINY)


# --------------------------------------------------------------------------------------------- services

from collections.abc import Iterator  # noqa: E402

from tests.blockd.conftest import BlockdProcess  # noqa: E402


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
