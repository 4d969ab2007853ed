"""The transformers config and the model with seeded random weights, as a downloaded one would be."""

from __future__ import annotations

from typing import Any

from pagedkv.tools.model_gen.spec import (
    ARCHITECTURES,
    BOS,
    EOS,
    IM_END,
    ModelSpec,
)


def _hf_config(spec: ModelSpec, ids: dict[str, int]) -> Any:
    """The transformers config object for the spec, with the tokenizer's special token ids."""
    import transformers

    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": spec.rope_theta}
    if spec.rope_scaling == "llama3":
        # Llama 3.1's factors; the original context is 1/8 of max_position so all three frequency bands
        # (kept, smoothed, scaled) occur at small head dims too.
        original = max(2, spec.max_position // 8)
        rope = {
            "rope_type": "llama3",
            "rope_theta": spec.rope_theta,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": original,
        }
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
        # pad_token_id stays None: transformers would zero that embedding row (padding_idx).
    )
    if spec.arch == "llama":
        return transformers.LlamaConfig(**common, attention_bias=False, mlp_bias=False)
    if spec.arch == "mistral":
        # sliding_window=None: every layer attends to the whole context (Mistral's default 4096 would window).
        return transformers.MistralConfig(**common, sliding_window=None)
    return transformers.Qwen2Config(
        **common, use_sliding_window=False, sliding_window=None, max_window_layers=spec.layers
    )


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
    model = model.to(getattr(torch, spec.dtype)).eval()
    model.config.dtype = spec.dtype
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=ids[BOS], eos_token_id=[ids[EOS], ids[IM_END]], pad_token_id=ids[EOS]
    )
    return model
