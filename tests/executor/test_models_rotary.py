"""Every rotary scaling's table against transformers' own rope functions, on configs that reach each branch
(YaRN truncated or not and with mscale; LongRoPE past its original context; Llama 3's three bands)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from executor.models.families import FAMILIES, rope_config
from executor.models.rotary import Rotary, rotary_angles

HEAD_DIM, MAX_POSITION = 64, 2048
CASES: dict[str, dict[str, Any]] = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "yarn-truncated": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 256},
    "yarn-untruncated-mscale": {
        "rope_type": "yarn",
        "factor": 16.0,
        "original_max_position_embeddings": 128,
        "beta_fast": 16.0,
        "beta_slow": 2.0,
        "mscale": 0.7,
        "mscale_all_dim": 0.5,
        "truncate": False,
    },
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    },
    "longrope": {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.03 * i for i in range(HEAD_DIM // 2)],
        "long_factor": [1.0 + 0.7 * i for i in range(HEAD_DIM // 2)],
        "original_max_position_embeddings": 512,
    },
}


def _hf_config(params: dict[str, Any]) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        hidden_size=HEAD_DIM * 2,
        num_attention_heads=2,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITION,
        rope_parameters={"rope_theta": 50000.0, **params},
    )


@pytest.mark.parametrize("name", sorted(CASES))
def test_rotary_tables_equal_transformers(name: str) -> None:
    params = CASES[name]
    raw = {"max_position_embeddings": MAX_POSITION, "rope_parameters": {"rope_theta": 50000.0, **params}}
    rope = rope_config(raw["rope_parameters"], raw, FAMILIES["LlamaForCausalLM"], HEAD_DIM, Path("config.json"))
    angles, factor = rotary_angles(rope, HEAD_DIM, MAX_POSITION)
    hf = _hf_config(params)
    init = ROPE_INIT_FUNCTIONS[params["rope_type"]]
    inv_freq, hf_factor = init(hf, torch.device("cpu"))
    assert factor == pytest.approx(hf_factor, rel=1e-12)
    original = params.get("original_max_position_embeddings", MAX_POSITION)
    positions = torch.arange(MAX_POSITION, dtype=torch.float32)
    if name == "longrope":  # the short factors below the original context, the long ones from it on
        long_freq, _ = init(hf, torch.device("cpu"), seq_len=original + 1)
        torch.testing.assert_close(angles[:original], positions[:original, None] * inv_freq, rtol=0, atol=0)
        torch.testing.assert_close(angles[original:], positions[original:, None] * long_freq, rtol=0, atol=0)
    else:
        torch.testing.assert_close(angles, positions[:, None] * inv_freq, rtol=0, atol=0)
    table = Rotary(rope, HEAD_DIM, MAX_POSITION)
    assert table.cos.shape == (MAX_POSITION, HEAD_DIM) and table.cos.dtype is torch.float32
    torch.testing.assert_close(table.cos[:, : HEAD_DIM // 2], angles.cos() * hf_factor)
