"""The tiny random checkpoints tests run on: their options, written like a downloaded model."""

from __future__ import annotations

from typing import Any

# Small enough to build in well under a second each, big enough to have GQA (4 query / 2 kv heads), two layers
# and a real BPE vocabulary.
TINY: dict[str, Any] = dict(
    hidden_size=128, layers=2, heads=4, kv_heads=2, vocab_size=512, max_position=512, dtype="float32", seed=0
)
TINY_ARCHS = ("llama", "qwen2", "mistral")
