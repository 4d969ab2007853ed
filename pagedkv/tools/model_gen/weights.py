"""The transformers config and the model with seeded random weights, as a downloaded one would be."""

from __future__ import annotations

import math
from typing import Any

from pagedkv.tools.model_gen.spec import (
    ARCHITECTURES,
    BOS,
    EOS,
    IM_END,
    TARGET_LOGIT_STD,
    ModelSpec,
)

# The families added after the first three get random norm weights, biases and sinks (transformers initialises
# them to constants), so every one of those paths changes the output; the first three keep their files.
_CONSTANT_INIT = ("llama", "mistral", "qwen2")


def _rope_parameters(spec: ModelSpec) -> dict[str, Any]:
    theta = spec.resolved_rope_theta
    if spec.rope_scaling == "none":
        return {"rope_type": "default", "rope_theta": theta}
    if spec.rope_scaling == "llama3":
        # Llama 3.1's factors; the original context is 1/8 of max_position so all three frequency bands
        # (kept, smoothed, scaled) occur at small head dims too.
        return {
            "rope_type": "llama3",
            "rope_theta": theta,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": max(2, spec.max_position // 8),
        }
    if spec.rope_scaling in ("linear", "dynamic"):
        return {"rope_type": spec.rope_scaling, "rope_theta": theta, "factor": 2.0}
    original = spec.max_position // 4
    if spec.rope_scaling == "yarn":  # gpt-oss's parameters, at a quarter of the context
        return {
            "rope_type": "yarn",
            "rope_theta": theta,
            "factor": 4.0,
            "original_max_position_embeddings": original,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
        }
    half = spec.resolved_head_dim // 2  # longrope: per-pair factors rising from 1, the long ones further
    return {
        "rope_type": "longrope",
        "rope_theta": theta,
        "short_factor": [1.0 + 0.05 * i for i in range(half)],
        "long_factor": [1.0 + 0.5 * i for i in range(half)],
        "original_max_position_embeddings": original,
    }


def _hf_config(spec: ModelSpec, ids: dict[str, int]) -> Any:
    """The transformers config object for the spec, with the tokenizer's special token ids."""
    import transformers

    rope = _rope_parameters(spec)
    common: dict[str, Any] = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.resolved_intermediate_size,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.resolved_head_dim,
        hidden_act="silu",
        max_position_embeddings=spec.max_position,
        initializer_range=spec.resolved_initializer_range,
        rms_norm_eps=1e-6,
        tie_word_embeddings=spec.tied,
        rope_parameters=rope,
        bos_token_id=ids[BOS],
        eos_token_id=ids[EOS],
        pad_token_id=None,  # transformers would zero that embedding row (padding_idx)
    )
    window = spec.resolved_window
    layered = dict(sliding_window=window, layer_types=spec.layer_types)
    moe = dict(num_experts_per_tok=spec.experts_per_token)
    arch = spec.arch
    if arch == "llama":
        return transformers.LlamaConfig(**common, attention_bias=False, mlp_bias=False)
    if arch == "mistral":
        # sliding_window=None: every layer attends to the whole context (Mistral's default 4096 would window).
        return transformers.MistralConfig(**common, sliding_window=window)
    if arch == "qwen2":
        if window is None:
            return transformers.Qwen2Config(
                **common, use_sliding_window=False, sliding_window=None, max_window_layers=spec.layers
            )
        return transformers.Qwen2Config(**common, use_sliding_window=True, max_window_layers=0, **layered)
    if arch == "qwen3":
        return transformers.Qwen3Config(
            **common, use_sliding_window=window is not None, max_window_layers=0, attention_bias=False, **layered
        )
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **common,
            **moe,
            num_experts=spec.experts,
            moe_intermediate_size=spec.resolved_moe_intermediate_size,
            norm_topk_prob=spec.norm_topk_prob,
            decoder_sparse_step=spec.decoder_sparse_step,
            mlp_only_layers=list(spec.mlp_only_layers),
            use_sliding_window=window is not None,
            sliding_window=window,
        )
    if arch == "mixtral":
        return transformers.MixtralConfig(**common, **moe, num_local_experts=spec.experts, sliding_window=window)
    if arch == "phi3":
        original = rope.get("original_max_position_embeddings", spec.max_position)
        return transformers.Phi3Config(**common, original_max_position_embeddings=original, sliding_window=window)
    if arch == "gpt_oss":
        return transformers.GptOssConfig(**common, **moe, num_local_experts=spec.experts, **layered)
    gemma = dict(common, hidden_act=None, hidden_activation="gelu_pytorch_tanh", **layered)
    if arch == "gemma2":
        return transformers.Gemma2Config(**gemma)
    # Gemma 3: the global layers take the spec's rope, the sliding ones their own base.
    gemma["rope_parameters"] = {
        "full_attention": rope,
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    }
    return transformers.Gemma3TextConfig(**gemma)


def _randomise_constants(model: Any, spec: ModelSpec) -> None:
    """Random values where transformers initialises constants: biases (zero), norm weights (one, or zero in
    Gemma's 1 + w form), attention sinks; so a model that dropped any of them would answer differently."""
    import torch

    std = spec.resolved_initializer_range
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(torch.randn_like(param) * 0.1 + (0.0 if spec.arch.startswith("gemma") else 1.0))
            elif name.endswith("sinks"):
                param.normal_(0.0, 1.0)
            elif name.endswith("bias"):
                param.normal_(0.0, std)
        if spec.arch.startswith("gemma") and spec.tied:
            # Gemma scales the embedding by sqrt(hidden) and its tied head reads the same rows: at the init's
            # std the input token's own embedding dominates the residual stream and the model echoes its input
            # (greedy text then hardly depends on attention). Its scaled embedding is cut to RMS 2/sqrt(hidden),
            # below what the layers add, and the final norm's (1 + w) brings the logits back to TARGET_LOGIT_STD.
            scaled_rms = 2 / math.sqrt(spec.hidden_size)
            model.model.embed_tokens.weight.mul_(scaled_rms / TARGET_LOGIT_STD)
            model.model.norm.weight.add_(TARGET_LOGIT_STD / scaled_rms - 1)


def _build_model(spec: ModelSpec, ids: dict[str, int]) -> Any:
    """The *ForCausalLM with seeded random weights, in the spec's dtype, with its generation config."""
    import torch
    import transformers

    config = _hf_config(spec, ids)
    cls = getattr(transformers, ARCHITECTURES[spec.arch])
    # fork_rng: seeding must not disturb the caller's random stream (tests, benches).
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = cls(config)
        if spec.arch == "qwen2":
            # Initialised to zero by transformers; random biases make the q/k/v bias path matter.
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if name.endswith(".bias"):
                        param.normal_(0.0, spec.resolved_initializer_range)
        elif spec.arch not in _CONSTANT_INIT:
            _randomise_constants(model, spec)
    model = model.to(getattr(torch, spec.dtype)).eval()
    model.config.dtype = spec.dtype
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=ids[BOS], eos_token_id=[ids[EOS], ids[IM_END]], pad_token_id=ids[EOS]
    )
    return model
