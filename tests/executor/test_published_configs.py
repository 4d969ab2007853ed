"""config.json files shaped like the published ones (Llama 3.2 1B, Qwen3 0.6B and 30B-A3B, Mixtral 8x7B, Gemma 2
2B, Gemma 3 1B and 4B's text model, Phi-4-mini, gpt-oss-20b dequantized): every field kept, in the spelling those
files use (transformers 4: top-level rope_theta and rope_scaling, torch_dtype), only the sizes scaled down. Each either
loads and computes what transformers computes from the same file and weights, or is refused with an error naming
the field it does not implement; none is silently misread."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as tf

from executor.checkpoint import load_config
from executor.model_config import CheckpointError, UnsupportedModel
from tests.executor.harness import assert_forward_matches

HIDDEN, VOCAB, INIT = 128, 300, 0.3  # the published initializer_range (0.02) would give near-tied logits


def _layer_types(n: int, every: int) -> list[str]:
    return ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n)]


PUBLISHED: dict[str, dict[str, Any]] = {
    "Llama-3.2-1B": {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 256,
        "eos_token_id": 257,
        "head_dim": 32,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initializer_range": INIT,
        "intermediate_size": 512,
        "max_position_embeddings": 1024,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 1,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 64,
            "rope_type": "llama3",
        },
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.45.0.dev0",
        "use_cache": True,
        "vocab_size": VOCAB,
    },
    "Qwen3-0.6B": {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 256,
        "eos_token_id": 257,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initializer_range": INIT,
        "intermediate_size": 384,
        "max_position_embeddings": 1024,
        "max_window_layers": 3,
        "model_type": "qwen3",
        "num_attention_heads": 4,
        "num_hidden_layers": 3,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": VOCAB,
    },
    "Qwen3-30B-A3B": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 256,
        "decoder_sparse_step": 1,
        "eos_token_id": 257,
        "head_dim": 32,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initializer_range": INIT,
        "intermediate_size": 384,
        "max_position_embeddings": 1024,
        "max_window_layers": 2,
        "mlp_only_layers": [],
        "model_type": "qwen3_moe",
        "moe_intermediate_size": 48,
        "norm_topk_prob": True,
        "num_attention_heads": 8,
        "num_experts": 16,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 2,
        "num_key_value_heads": 1,
        "output_router_logits": False,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": VOCAB,
    },
    "Mixtral-8x7B-v0.1": {
        "architectures": ["MixtralForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initializer_range": INIT,
        "intermediate_size": 448,
        "max_position_embeddings": 1024,
        "model_type": "mixtral",
        "num_attention_heads": 4,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 2,
        "num_key_value_heads": 1,
        "num_local_experts": 8,
        "output_router_logits": False,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.02,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.36.0.dev0",
        "use_cache": True,
        "vocab_size": VOCAB,
    },
    "gemma-2-2b": {
        "architectures": ["Gemma2ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_logit_softcapping": 50.0,
        "bos_token_id": 2,
        "cache_implementation": "hybrid",
        "eos_token_id": 1,
        "final_logit_softcapping": 30.0,
        "head_dim": 64,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": HIDDEN,
        "initializer_range": INIT,
        "intermediate_size": 512,
        "max_position_embeddings": 1024,
        "model_type": "gemma2",
        "num_attention_heads": 4,
        "num_hidden_layers": 3,
        "num_key_value_heads": 2,
        "pad_token_id": 0,
        "query_pre_attn_scalar": 64,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000.0,
        "sliding_window": 24,
        "torch_dtype": "float32",
        "transformers_version": "4.42.4",
        "use_cache": True,
        "vocab_size": VOCAB,
    },
    "gemma-3-1b": {
        "architectures": ["Gemma3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_logit_softcapping": None,
        "bos_token_id": 2,
        "cache_implementation": "hybrid",
        "eos_token_id": [1, 106],
        "final_logit_softcapping": None,
        "head_dim": 64,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": HIDDEN,
        "initializer_range": INIT,
        "intermediate_size": 768,
        "max_position_embeddings": 1024,
        "model_type": "gemma3_text",
        "num_attention_heads": 4,
        "num_hidden_layers": 7,
        "num_key_value_heads": 1,
        "pad_token_id": 0,
        "query_pre_attn_scalar": 64,
        "rms_norm_eps": 1e-06,
        "rope_local_base_freq": 10000,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": 20,
        "sliding_window_pattern": 6,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.50.0.dev0",
        "use_cache": True,
        "vocab_size": VOCAB,
    },
    # gemma-3-4b's text_config, written out as a text-only checkpoint (its defaults made explicit)
    "gemma-3-4b-text": {
        "architectures": ["Gemma3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_logit_softcapping": None,
        "bos_token_id": 2,
        "eos_token_id": [1, 106],
        "final_logit_softcapping": None,
        "head_dim": 32,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": HIDDEN,
        "initializer_range": INIT,
        "intermediate_size": 512,
        "max_position_embeddings": 1024,
        "model_type": "gemma3_text",
        "num_attention_heads": 8,
        "num_hidden_layers": 6,
        "num_key_value_heads": 4,
        "pad_token_id": 0,
        "query_pre_attn_scalar": 32,
        "rms_norm_eps": 1e-06,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "rope_theta": 1000000.0,
        "sliding_window": 24,
        "sliding_window_pattern": 6,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.50.0.dev0",
        "use_cache": True,
        "vocab_size": VOCAB,
    },
    "gpt-oss-20b-dequantized": {
        "architectures": ["GptOssForCausalLM"],
        "attention_bias": True,
        "attention_dropout": 0.0,
        "eos_token_id": 257,
        "experts_per_token": 4,
        "head_dim": 32,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initial_context_length": 64,
        "initializer_range": INIT,
        "intermediate_size": 128,
        "layer_types": _layer_types(4, 2),
        "max_position_embeddings": 2048,
        "model_type": "gpt_oss",
        "num_attention_heads": 8,
        "num_experts_per_tok": 4,
        "num_hidden_layers": 4,
        "num_key_value_heads": 1,
        "num_local_experts": 8,
        "output_router_logits": False,
        "pad_token_id": 258,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "original_max_position_embeddings": 64,
            "rope_type": "yarn",
            "truncate": False,
        },
        "rope_theta": 150000,
        "router_aux_loss_coef": 0.9,
        "sliding_window": 16,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.55.0.dev0",
        "use_cache": True,
        "vocab_size": VOCAB,
    },
}
_PHI4_ROTARY_HALF = 12  # Phi-4-mini: head_dim 128, partial_rotary_factor 0.75 -> 48 pairs; here 32 * 0.75 / 2
PHI4_MINI: dict[str, Any] = {
    "architectures": ["Phi3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 256,
    "embd_pdrop": 0.0,
    "eos_token_id": 256,
    "full_attn_mod": 1,
    "hidden_act": "silu",
    "hidden_size": HIDDEN,
    "initializer_range": INIT,
    "intermediate_size": 384,
    "interpolate_factor": 1,
    "lm_head_bias": False,
    "max_position_embeddings": 2048,
    "mlp_bias": False,
    "model_type": "phi3",
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "original_max_position_embeddings": 64,
    "pad_token_id": 256,
    "partial_rotary_factor": 0.75,
    "resid_pdrop": 0.0,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "long_factor": [1.0 + 0.5 * i for i in range(_PHI4_ROTARY_HALF)],
        "short_factor": [1.0 + 0.05 * i for i in range(_PHI4_ROTARY_HALF)],
        "type": "longrope",
    },
    "rope_theta": 10000.0,
    "sliding_window": 262144,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0",
    "use_cache": True,
    "vocab_size": VOCAB,
}
GEMMA3_4B: dict[str, Any] = {  # as published: the multimodal model, its text model nested
    "architectures": ["Gemma3ForConditionalGeneration"],
    "model_type": "gemma3",
    "text_config": {"hidden_size": HIDDEN, "model_type": "gemma3_text", "num_hidden_layers": 2},
    "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 64},
    "mm_tokens_per_image": 256,
    "torch_dtype": "bfloat16",
}
GPT_OSS_20B_MXFP4 = {
    **PUBLISHED["gpt-oss-20b-dequantized"],
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"], "quant_method": "mxfp4"},
}
# What is refused, and the field its error must name.
REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    "gemma-3-4b": (GEMMA3_4B, "Gemma3ForConditionalGeneration"),
    "Llama-3.2-1B-partial-rotary": (  # only Phi-3's code turns part of each head
        {**PUBLISHED["Llama-3.2-1B"], "partial_rotary_factor": 0.5},
        "partial_rotary_factor",
    ),
    "gpt-oss-20b": (GPT_OSS_20B_MXFP4, "quantization_config"),
}


def _checkpoint(config: dict[str, Any], root: Path) -> tuple[Path, Any]:
    """Random weights of transformers' model for `config` under the published config.json itself."""
    (root / "published").mkdir(parents=True)
    (root / "published" / "config.json").write_text(json.dumps(config), encoding="utf-8")
    hf_config = tf.AutoConfig.from_pretrained(root / "published")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = tf.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
        with torch.no_grad():  # random where transformers initialises constants, so each of them matters
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.copy_(torch.randn_like(param) * 0.2 + (0.0 if "gemma" in config["model_type"] else 1.0))
                elif name.endswith(("bias", "sinks")):
                    param.normal_(0.0, 0.5)
    model.save_pretrained(root / "model")
    (root / "model" / "config.json").write_text(json.dumps(config), encoding="utf-8")  # not transformers' rewrite
    reference = tf.AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.float32).eval()
    return root / "model", reference


PUBLISHED["Phi-4-mini"] = PHI4_MINI  # partial rotary (the first 3/4 of each head turn) with LongRoPE


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_configs_load_and_match_transformers(name: str, tmp_path: Path) -> None:
    model_dir, reference = _checkpoint(PUBLISHED[name], tmp_path)
    assert_forward_matches(model_dir, reference, VOCAB)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_published_configs_not_implemented_are_refused_naming_the_field(name: str, tmp_path: Path) -> None:
    config, field = REFUSED[name]
    (tmp_path / "config.json").write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises((UnsupportedModel, CheckpointError), match=field):
        load_config(tmp_path)
