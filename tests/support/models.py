"""The tiny random checkpoints tests run on: their options, written like a downloaded model."""

from __future__ import annotations

from typing import Any

# Small enough to build in well under a second each, big enough to have GQA (4 query / 2 kv heads), two layers
# and a real BPE vocabulary.
TINY: dict[str, Any] = dict(
    hidden_size=128, layers=2, heads=4, kv_heads=2, vocab_size=512, max_position=512, dtype="float32", seed=0
)
TINY_ARCHS = ("llama", "qwen2", "mistral")

# Several shapes of every family (head dims, GQA ratios, windows, experts, tied or not, rope scalings): each a
# make-model option set over TINY. Windows are short so the tests' prompts run well past them.
FAMILY_SPECS: dict[str, dict[str, Any]] = {
    "qwen3-hd64-gqa4-tied": dict(arch="qwen3", heads=4, kv_heads=1, head_dim=64, tie_embeddings=True),
    "qwen3-hd32-window": dict(arch="qwen3", hidden_size=64, head_dim=32, sliding_window=20, sliding_pattern=2),
    "qwen3_moe-e4k2": dict(arch="qwen3_moe", head_dim=32, experts=4, experts_per_token=2),
    "qwen3_moe-e8k3-dense-layer": dict(
        arch="qwen3_moe", layers=3, experts=8, experts_per_token=3, norm_topk_prob=False, mlp_only_layers=(1,)
    ),
    "mixtral-e4k2": dict(arch="mixtral", experts=4, experts_per_token=2),
    "mixtral-e8k2-window-mha": dict(
        arch="mixtral", heads=4, kv_heads=4, head_dim=32, experts=8, experts_per_token=2, sliding_window=24
    ),
    "gemma2-w16": dict(arch="gemma2", head_dim=32, sliding_window=16),
    "gemma2-w24-untied-hd64": dict(
        arch="gemma2", layers=3, kv_heads=1, head_dim=64, sliding_window=24, tie_embeddings=False
    ),
    "gemma3-w16": dict(arch="gemma3", layers=3, head_dim=32, sliding_window=16, sliding_pattern=3),
    "gemma3-w20-linear-gqa4": dict(
        arch="gemma3", layers=4, kv_heads=1, sliding_window=20, sliding_pattern=2, rope_scaling="linear"
    ),
    "phi3": dict(arch="phi3"),
    "phi3-longrope-window": dict(arch="phi3", kv_heads=4, rope_scaling="longrope", sliding_window=48),
    "gpt_oss-w16-e4k2": dict(arch="gpt_oss", head_dim=32, sliding_window=16, experts=4, experts_per_token=2),
    "gpt_oss-w24-e8k4-yarn": dict(
        arch="gpt_oss", kv_heads=1, head_dim=64, sliding_window=24, experts=8, experts_per_token=4, rope_scaling="yarn"
    ),
    "llama-yarn": dict(arch="llama", rope_scaling="yarn"),
    "llama-linear": dict(arch="llama", rope_scaling="linear"),
    "llama-dynamic": dict(arch="llama", rope_scaling="dynamic"),
    "mistral-w16": dict(arch="mistral", sliding_window=16),
    "qwen2-w20": dict(arch="qwen2", sliding_window=20),
    # From the shape sweep (tools/shape_sweep.py): odd layer counts, windows that are not a block multiple, wide
    # heads, GQA 8:1, one expert per token.
    "gemma3-l7-w13": dict(arch="gemma3", layers=7, sliding_window=13),
    "qwen3-gqa8-hd32-l3": dict(arch="qwen3", heads=8, kv_heads=1, head_dim=32, layers=3),
    "mistral-w13-hd96": dict(arch="mistral", sliding_window=13, head_dim=96),
    "gpt_oss-w13-e16k1-hd80": dict(arch="gpt_oss", head_dim=80, sliding_window=13, experts=16, experts_per_token=1),
}
# One shape of each family that the API tests serve through a whole stack (a stack per family costs seconds).
API_FAMILY_SPECS = (
    "llama-yarn",
    "mistral-w16",
    "qwen2-w20",
    "qwen3-hd32-window",
    "qwen3_moe-e4k2",
    "mixtral-e8k2-window-mha",
    "gemma2-w16",
    "gemma3-w16",
    "phi3-longrope-window",
    "gpt_oss-w16-e4k2",
)
