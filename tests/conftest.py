"""Fixtures every test folder may use: session-wide tiny random checkpoints (see tests/support/models.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pagedkv.tools.model_gen import write_model
from tests.support.models import TINY, TINY_ARCHS


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
