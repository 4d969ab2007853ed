"""Configs as transformers' own config classes write them (their defaults, not make-model's), each family with the
options make-model does not vary: the model's logits over a prefill chunk, a decode token and a second chunk on
the paged cache equal transformers' full forward (the greedy tokens, and their logprobs within 2e-3), with windows
shorter than the chunks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as tf

from tests.executor.harness import assert_forward_matches

BASE: dict[str, Any] = dict(
    vocab_size=300,
    hidden_size=128,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    pad_token_id=None,
    initializer_range=0.3,
    max_position_embeddings=512,
)
GEMMA3_ROPE = {
    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
}
CASES: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "llama-attention-bias": (tf.LlamaConfig, tf.LlamaForCausalLM, dict(attention_bias=True)),
    "qwen2-max-window-layers": (
        tf.Qwen2Config,
        tf.Qwen2ForCausalLM,
        dict(use_sliding_window=True, sliding_window=12, max_window_layers=1, layer_types=None),
    ),
    "qwen3-bias-window": (
        tf.Qwen3Config,
        tf.Qwen3ForCausalLM,
        dict(attention_bias=True, use_sliding_window=True, sliding_window=10, max_window_layers=2),
    ),
    "qwen3_moe-sparse-step-2": (
        tf.Qwen3MoeConfig,
        tf.Qwen3MoeForCausalLM,
        dict(
            num_experts=6, num_experts_per_tok=3, moe_intermediate_size=32, decoder_sparse_step=2, norm_topk_prob=True
        ),
    ),
    "mixtral-top-1-window": (
        tf.MixtralConfig,
        tf.MixtralForCausalLM,
        dict(num_local_experts=5, num_experts_per_tok=1, sliding_window=9),
    ),
    "gemma2-scalar-144-softcaps": (
        tf.Gemma2Config,
        tf.Gemma2ForCausalLM,
        dict(query_pre_attn_scalar=144, sliding_window=10, attn_logit_softcapping=20.0, final_logit_softcapping=15.0),
    ),
    "gemma3-linear-global-softcap": (
        tf.Gemma3TextConfig,
        tf.Gemma3ForCausalLM,
        dict(
            sliding_window=11,
            rope_parameters=GEMMA3_ROPE,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            attn_logit_softcapping=30.0,
        ),
    ),
    "phi3-window": (tf.Phi3Config, tf.Phi3ForCausalLM, dict(sliding_window=13, bos_token_id=0, eos_token_id=1)),
    "phi3-partial-rotary": (
        tf.Phi3Config,
        tf.Phi3ForCausalLM,
        dict(partial_rotary_factor=0.5, num_key_value_heads=1, bos_token_id=0, eos_token_id=1),
    ),
    "gpt_oss-layer-types-low-limit": (
        tf.GptOssConfig,
        tf.GptOssForCausalLM,
        dict(
            num_local_experts=6,
            num_experts_per_tok=2,
            sliding_window=7,
            layer_types=["full_attention", "sliding_attention", "sliding_attention"],
            swiglu_limit=1.5,  # low enough that the clamps act
        ),
    ),
    "mistral-head-dim-64": (tf.MistralConfig, tf.MistralForCausalLM, dict(head_dim=64, sliding_window=12)),
}


def _save(name: str, root: Path) -> tuple[Path, Any]:
    config_cls, model_cls, options = CASES[name]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = model_cls(config_cls(**{**BASE, **options})).eval()
        with torch.no_grad():  # random where transformers initialises constants, so each of them matters
            for param_name, param in model.named_parameters():
                if param_name.endswith("norm.weight"):
                    param.copy_(torch.randn_like(param) * 0.2 + (0.0 if name.startswith("gemma") else 1.0))
                elif param_name.endswith(("bias", "sinks")):
                    param.normal_(0.0, 0.5)
    model.save_pretrained(root / name)
    return root / name, model


@pytest.mark.parametrize("name", sorted(CASES))
def test_transformers_configs_of_every_family_match(name: str, tmp_path: Path) -> None:
    model_dir, reference = _save(name, tmp_path)
    assert_forward_matches(model_dir, reference, BASE["vocab_size"])
