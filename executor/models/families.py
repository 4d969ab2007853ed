"""Each supported family: how its Hugging Face config maps onto the shared building blocks.

A family is a small description (`Family`): its defaults where config.json may be silent, which layers slide, how
its MLP is routed. `describe` reads a config.json into the fields of `ModelConfig`; every field that changes the
math and is not implemented is refused (UnsupportedModel naming it), never ignored.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from executor.model_config import CheckpointError, LayerConfig, MoEConfig, RopeConfig, UnsupportedModel

SLIDING, FULL = "sliding_attention", "full_attention"
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


@dataclass(frozen=True)
class Family:
    name: str
    eps: float = 1e-6
    tied: bool = False  # tie_word_embeddings when the config does not say
    qkv_bias: Callable[[dict[str, Any]], bool] = lambda raw: bool(raw.get("attention_bias", False))
    output_bias: Callable[[dict[str, Any]], bool] = lambda raw: bool(raw.get("attention_bias", False))
    windows: Callable[[dict[str, Any], int], list[bool]] | None = None  # which layers slide, or None: all do
    default_window: int | None = None
    qk_norm: bool = False
    gemma: bool = False  # (1 + w) norms, sandwich norms, GELU-tanh, scaled embeddings, query_pre_attn_scalar
    local_rope: bool = False  # sliding layers have their own rotary base (Gemma 3)
    rope_aliases: dict[str, str] = field(default_factory=dict)
    moe: Callable[[dict[str, Any], Path], tuple[MoEConfig, list[bool]]] | None = None
    sinks: bool = False
    partial_rotary: bool = False  # partial_rotary_factor turns only the first dims of each head


def _layer_types(pattern: int | None) -> Callable[[dict[str, Any], int], list[bool]]:
    """Sliding layers from `layer_types`, else every layer but each `pattern`-th (Gemma's and gpt-oss's default)."""

    def windows(raw: dict[str, Any], n: int) -> list[bool]:
        types = raw.get("layer_types")
        if isinstance(types, list) and types:
            if len(types) != n or any(t not in (SLIDING, FULL) for t in types):
                raise UnsupportedModel(f"layer_types must be {n} of {SLIDING!r}/{FULL!r}, not {types!r}")
            return [t == SLIDING for t in types]
        if pattern is None:
            return [False] * n
        every = int(raw.get("sliding_window_pattern", raw.get("_sliding_window_pattern", pattern)))
        return [bool((i + 1) % every) for i in range(n)]

    return windows


def _qwen_windows(raw: dict[str, Any], n: int) -> list[bool]:
    """Qwen2/Qwen3: `layer_types` when written, else layers from max_window_layers on, when use_sliding_window."""
    types = raw.get("layer_types")
    if isinstance(types, list) and types:
        return _layer_types(None)(raw, n)
    if not raw.get("use_sliding_window"):
        return [False] * n
    first = int(raw.get("max_window_layers", n))
    return [i >= first for i in range(n)]


def _qwen3_moe_windows(raw: dict[str, Any], n: int) -> list[bool]:
    return [bool(raw.get("use_sliding_window"))] * n  # every layer or none: transformers has no per-layer switch


def _softmax_moe(
    size_key: str, sparse_layers: bool, experts_default: int, top_k_default: int
) -> Callable[..., tuple[MoEConfig, list[bool]]]:
    """Mixtral's and Qwen3-MoE's router (softmax over all experts, top-k); the defaults are transformers'."""

    def moe(raw: dict[str, Any], path: Path) -> tuple[MoEConfig, list[bool]]:
        n = int(raw["num_hidden_layers"])
        experts = int(raw.get("num_experts") or raw.get("num_local_experts") or experts_default)
        config = MoEConfig(
            num_experts=experts,
            top_k=int(raw.get("num_experts_per_tok") or top_k_default),
            intermediate_size=int(raw.get(size_key) or raw["intermediate_size"]),
            router="softmax_topk",
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)) if sparse_layers else True,  # Mixtral: always
            router_bias=False,
            expert_bias=False,
            activation="silu",
        )
        if not sparse_layers:
            return config, [True] * n
        step = int(raw.get("decoder_sparse_step", 1))
        dense = set(map(int, raw.get("mlp_only_layers") or []))
        return config, [i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(n)]

    return moe


def _gpt_oss_moe(raw: dict[str, Any], path: Path) -> tuple[MoEConfig, list[bool]]:
    config = MoEConfig(
        num_experts=int(raw["num_local_experts"]),
        top_k=int(raw.get("num_experts_per_tok") or raw.get("experts_per_token") or 4),
        intermediate_size=int(raw["intermediate_size"]),
        router="topk_softmax",
        norm_topk_prob=False,
        router_bias=True,
        expert_bias=True,
        activation="swiglu_oai",
        swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
    )
    return config, [True] * int(raw["num_hidden_layers"])


_NO_BIAS = lambda raw: False  # noqa: E731
FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family("llama", windows=lambda raw, n: [False] * n),
    "MistralForCausalLM": Family("mistral"),
    "Qwen2ForCausalLM": Family("qwen2", qkv_bias=lambda raw: True, output_bias=_NO_BIAS, windows=_qwen_windows),
    "Qwen3ForCausalLM": Family("qwen3", windows=_qwen_windows, qk_norm=True),
    "Qwen3MoeForCausalLM": Family(
        "qwen3_moe",
        windows=_qwen3_moe_windows,
        qk_norm=True,
        moe=_softmax_moe("moe_intermediate_size", True, 128, 8),
    ),
    "MixtralForCausalLM": Family(
        "mixtral", eps=1e-5, qkv_bias=_NO_BIAS, output_bias=_NO_BIAS, moe=_softmax_moe("", False, 8, 2)
    ),
    "Gemma2ForCausalLM": Family("gemma2", tied=True, windows=_layer_types(2), default_window=4096, gemma=True),
    "Gemma3ForCausalLM": Family(
        "gemma3", tied=True, windows=_layer_types(6), default_window=4096, gemma=True, qk_norm=True, local_rope=True
    ),
    "Phi3ForCausalLM": Family(
        "phi3",
        eps=1e-5,
        qkv_bias=_NO_BIAS,
        output_bias=_NO_BIAS,
        rope_aliases={"su": "longrope", "yarn": "longrope"},
        partial_rotary=True,
    ),
    "GptOssForCausalLM": Family(
        "gpt_oss",
        eps=1e-5,
        qkv_bias=lambda raw: bool(raw.get("attention_bias", True)),
        output_bias=lambda raw: bool(raw.get("attention_bias", True)),
        windows=_layer_types(2),
        default_window=128,
        moe=_gpt_oss_moe,
        sinks=True,
    ),
}
SUPPORTED_ARCHITECTURES = {name: family.name for name, family in FAMILIES.items()}
_BY_MODEL_TYPE = {"gemma3_text": "Gemma3ForCausalLM"} | {f.name: name for name, f in FAMILIES.items()}


def family_of(raw: dict[str, Any], path: Path) -> Family:
    """The checkpoint's family, or UnsupportedModel naming what is supported."""
    supported = ", ".join(sorted(FAMILIES))
    found = raw.get("architectures") or []
    if isinstance(found, list) and found:
        for name in found:
            if name in FAMILIES:
                return FAMILIES[name]
        raise UnsupportedModel(
            f"{path}: architecture {', '.join(map(str, found))} is not supported; supported: {supported}"
        )
    # Some configs carry only model_type; accept it when it names a supported family.
    model_type = raw.get("model_type")
    if model_type in _BY_MODEL_TYPE:
        return FAMILIES[_BY_MODEL_TYPE[model_type]]
    raise UnsupportedModel(
        f"{path}: no supported architecture (architectures={found!r}, model_type={model_type!r}); "
        f"supported: {supported}"
    )


def _rope_tables(raw: dict[str, Any], family: Family, path: Path) -> dict[str, dict[str, Any]]:
    """Raw rope parameters by table ("global", and "local" for Gemma 3), from either spelling."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        # transformers 5 keys rope parameters by layer type when layers differ.
        if family.local_rope:
            return {"global": dict(params.get(FULL) or {}), "local": dict(params.get(SLIDING) or {})}
        distinct = {json.dumps(v, sort_keys=True) for v in params.values()}
        if len(distinct) != 1:
            raise UnsupportedModel(f"{path}: rope parameters differ between layer types: {params}")
        params = next(iter(params.values()))
    if isinstance(params, dict):
        tables = {"global": dict(params)}
    else:
        tables = {"global": dict(raw.get("rope_scaling") or {})}
        if "rope_theta" in raw:
            tables["global"]["rope_theta"] = raw["rope_theta"]
    if family.local_rope:
        tables.setdefault("local", {})
        tables["local"].setdefault("rope_theta", raw.get("rope_local_base_freq", 10000.0))
        tables["global"].setdefault("rope_theta", 1000000.0)
    return tables


def _float_list(value: Any, half: int, what: str, path: Path) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in value)
    except TypeError:
        raise CheckpointError(f"{path}: longrope {what} must be a list of numbers") from None
    if len(values) != half:
        raise CheckpointError(f"{path}: longrope {what} has {len(values)} entries, not the rotary dims / 2 = {half}")
    return values


def _rotary_dim(raw: dict[str, Any], family: Family, head_dim: int, path: Path) -> int:
    """The dims of each head the rotary turns: head_dim, or its partial_rotary_factor share (Phi-3 / Phi-4-mini:
    the first ones, as transformers' Phi3 does; other families' code has no such split, so it is refused)."""
    params = raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), dict) else {}
    # transformers 5 reads rope_parameters' value (it folds a top-level one in only where that has none)
    factor = float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    if factor == 1.0:
        return head_dim
    dim = int(head_dim * factor)
    if not family.partial_rotary:
        raise UnsupportedModel(f"{path}: partial rotary embeddings (partial_rotary_factor) are not supported")
    if not 0 < dim <= head_dim or dim % 2:
        raise CheckpointError(f"{path}: partial_rotary_factor {factor} gives {dim} of {head_dim} dims, not even")
    return dim


def rope_config(params: dict[str, Any], raw: dict[str, Any], family: Family, head_dim: int, path: Path) -> RopeConfig:
    """One table's RopeConfig: its theta and its scaling normalised to the parameters the rotary needs."""
    params = dict(params)
    theta = float(params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    params.pop("partial_rotary_factor", None)  # read by _rotary_dim
    kind = str(params.get("rope_type", params.get("type", "default")))
    kind = family.rope_aliases.get(kind, kind)
    if kind not in ROPE_TYPES:
        raise UnsupportedModel(f"{path}: rope type {kind!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    if kind == "default":
        return RopeConfig(theta)
    max_position = int(raw["max_position_embeddings"])
    original = params.get("original_max_position_embeddings", raw.get("original_max_position_embeddings"))
    try:
        if kind == "linear":
            scaling: dict[str, Any] = {"factor": float(params["factor"])}
        elif kind == "dynamic":
            scaling = {"factor": float(params["factor"])}
        elif kind == "llama3":
            scaling = {
                "factor": float(params["factor"]),
                "low_freq_factor": float(params["low_freq_factor"]),
                "high_freq_factor": float(params["high_freq_factor"]),
                "original_max_position_embeddings": int(params["original_max_position_embeddings"]),
            }
        elif kind == "yarn":
            scaling = _yarn(params, max_position, int(original))
        else:
            scaling = _longrope(params, max_position, int(original), head_dim, path)
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: {kind} rope scaling lacks or misstates {exc}") from None
    return RopeConfig(theta, {"rope_type": kind, **scaling})


def _yarn(params: dict[str, Any], max_position: int, original: int) -> dict[str, Any]:
    factor = params.get("factor")
    factor = float(factor) if factor is not None else max_position / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = params.get("attention_factor")
    if attention is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return {
        "factor": factor,
        "original_max_position_embeddings": original,
        "beta_fast": float(params.get("beta_fast") or 32),
        "beta_slow": float(params.get("beta_slow") or 1),
        "truncate": bool(params.get("truncate", True)),
        "attention_factor": float(attention),
    }


def _longrope(params: dict[str, Any], max_position: int, original: int, head_dim: int, path: Path) -> dict[str, Any]:
    factor = params.get("factor")
    factor = float(factor) if factor is not None else max_position / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {
        "original_max_position_embeddings": original,
        "short_factor": _float_list(params["short_factor"], head_dim // 2, "short_factor", path),
        "long_factor": _float_list(params["long_factor"], head_dim // 2, "long_factor", path),
        "attention_factor": float(attention),
    }


def _activation(raw: dict[str, Any], family: Family, path: Path) -> str:
    if family.gemma:
        act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise UnsupportedModel(f"{path}: activation {act!r} is not supported; supported: gelu_pytorch_tanh")
        return "gelu_tanh"
    if family.name == "gpt_oss":
        return "silu"  # hidden_act is unused: its experts' activation is the clamped SwiGLU
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModel(f"{path}: activation {act!r} is not supported; supported: silu")
    return "silu"


def _refuse(raw: dict[str, Any], family: Family, path: Path) -> None:
    """Config fields that change the math and are not implemented."""
    if raw.get("quantization_config"):
        method = (raw["quantization_config"] or {}).get("quant_method", "?")
        raise UnsupportedModel(f"{path}: quantized weights (quantization_config, {method}) are not supported")
    if raw.get("mlp_bias"):
        raise UnsupportedModel(f"{path}: MLP biases (mlp_bias) are not supported")
    if raw.get("use_bidirectional_attention"):
        raise UnsupportedModel(f"{path}: bidirectional attention (use_bidirectional_attention) is not supported")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if raw.get(key) and not family.gemma:
            raise UnsupportedModel(f"{path}: {key} is not supported for {family.name}")
    for key in ("shared_expert_intermediate_size", "num_shared_experts", "n_shared_experts"):
        if raw.get(key):
            raise UnsupportedModel(f"{path}: shared experts ({key}) are not supported")


def describe(raw: dict[str, Any], path: Path) -> dict[str, Any]:
    """config.json -> the family-determined fields of ModelConfig (all but the token ids, dtype and model id)."""
    family = family_of(raw, path)
    _refuse(raw, family, path)
    try:
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        head_dim = int(raw.get("head_dim") or hidden // heads)
        n = int(raw["num_hidden_layers"])
        sizes = dict(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=n,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps") or family.eps),
            max_model_len=int(raw["max_position_embeddings"]),
        )
        moe, sparse = family.moe(raw, path) if family.moe else (None, [False] * n)
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: missing or malformed field {exc}") from None
    if heads % kv_heads:
        raise CheckpointError(f"{path}: {heads} attention heads do not divide into {kv_heads} kv heads")
    if moe is not None and not 1 <= moe.top_k <= moe.num_experts:
        raise CheckpointError(f"{path}: {moe.top_k} experts per token of {moe.num_experts} experts")
    window = raw.get("sliding_window", family.default_window)
    slides = family.windows(raw, n) if family.windows else [True] * n
    if not window:
        slides = [False] * n
    rotary_dim = _rotary_dim(raw, family, head_dim, path)
    tables = {
        name: rope_config(params, raw, family, rotary_dim, path)
        for name, params in _rope_tables(raw, family, path).items()
    }
    if tables["global"].scaling and tables["global"].scaling["rope_type"] == "dynamic":
        # transformers rescales dynamic NTK by the current length past max_position_embeddings, which a cache of
        # already-rotated keys cannot follow; within it the rotary is the plain one, as here.
        tables["global"] = RopeConfig(tables["global"].theta)
    layers = tuple(
        LayerConfig(
            sliding_window=int(window) if slide else None,
            rope="local" if family.local_rope and slide else "global",
            moe=is_moe,
        )
        for slide, is_moe in zip(slides, sparse, strict=True)
    )
    gemma = family.gemma
    scalar = raw.get("query_pre_attn_scalar", 256) if gemma else None
    return dict(
        architecture=family.name,
        **sizes,
        rope_theta=tables["global"].theta,
        rope_scaling=tables["global"].scaling,
        ropes=tuple(tables.items()),
        layers=layers,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", family.tied)),
        attention_bias=family.qkv_bias(raw),
        output_bias=family.output_bias(raw),
        qk_norm=family.qk_norm,
        norm_offset=gemma,
        sandwich_norms=gemma,
        hidden_act=_activation(raw, family, path),
        attention_scale=float(scalar) ** -0.5 if scalar else None,
        attn_softcap=_softcap(raw, "attn_logit_softcapping", 50.0 if family.name == "gemma2" else None),
        final_softcap=_softcap(raw, "final_logit_softcapping", 30.0 if family.name == "gemma2" else None),
        embed_scale=gemma,
        attention_sinks=family.sinks,
        rotary_dim=rotary_dim if rotary_dim < head_dim else None,
        moe=moe,
    )


def _softcap(raw: dict[str, Any], key: str, default: float | None) -> float | None:
    value = raw.get(key, default)
    return float(value) if value else None
