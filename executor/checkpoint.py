"""Reading a Hugging Face-style checkpoint directory: config.json, generation_config.json and safetensors weights.

No transformers model classes are used here: the executor runs its own model code and only needs the shapes,
the rope settings, the stop tokens and the tensors by name. Both config spellings are read: transformers 5
writes `rope_parameters` (with `rope_theta` inside) and `dtype`; transformers 4 wrote `rope_theta` and
`rope_scaling` at the top level and `torch_dtype`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}
SUPPORTED_ROPE_TYPES = ("default", "llama3")
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Bytes sampled per weight file for the model id: enough to tell two checkpoints of one shape apart (random
# or fine-tuned weights differ nearly everywhere) without reading gigabytes at every start.
_FINGERPRINT_SAMPLES, _FINGERPRINT_BYTES = 8, 4096


class UnsupportedModel(ValueError):
    """The checkpoint is well formed but describes a model this executor does not implement."""


class CheckpointError(ValueError):
    """The checkpoint directory is missing a file or holds one that cannot be read."""


@dataclass(frozen=True)
class ModelConfig:
    """What the executor needs to know about a decoder-only checkpoint, normalised across config spellings."""

    architecture: str  # "llama" | "mistral" | "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # None, or {"rope_type": "llama3", "factor", "low_freq_factor", ...}
    max_model_len: int  # capped by an active sliding window, so attention within it is exact full attention
    tie_word_embeddings: bool
    attention_bias: bool  # bias on the q/k/v projections
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str
    model_id: str  # "{dir name}-{fingerprint}": the same files give the same id (prefix-cache key)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} cannot be read as JSON: {exc}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} does not hold a JSON object")
    return data


def _architecture(raw: dict[str, Any], path: Path) -> str:
    """Our short name for the checkpoint's architecture, or UnsupportedModel naming what is supported."""
    supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
    found = raw.get("architectures") or []
    if isinstance(found, list) and found:
        for name in found:
            if name in SUPPORTED_ARCHITECTURES:
                return SUPPORTED_ARCHITECTURES[name]
        raise UnsupportedModel(
            f"{path}: architecture {', '.join(map(str, found))} is not supported; supported: {supported}"
        )
    # Some configs carry only model_type; accept it when it names a supported family.
    model_type = raw.get("model_type")
    if model_type in SUPPORTED_ARCHITECTURES.values():
        return str(model_type)
    raise UnsupportedModel(
        f"{path}: no supported architecture (architectures={found!r}, model_type={model_type!r}); "
        f"supported: {supported}"
    )


def _rope(raw: dict[str, Any], path: Path) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, normalised rope_scaling) from either the transformers 5 or the transformers 4 spelling."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        # transformers 5 keys rope parameters by layer type when layers differ; ours must all agree.
        distinct = {json.dumps(v, sort_keys=True) for v in params.values()}
        if len(distinct) != 1:
            raise UnsupportedModel(f"{path}: rope parameters differ between layer types: {params}")
        params = next(iter(params.values()))
    if isinstance(params, dict):
        scaling: dict[str, Any] = dict(params)
        theta = scaling.pop("rope_theta", raw.get("rope_theta", 10000.0))
    else:
        scaling = dict(raw.get("rope_scaling") or {})
        theta = raw.get("rope_theta", 10000.0)
    if float(raw.get("partial_rotary_factor", scaling.pop("partial_rotary_factor", 1.0))) != 1.0:
        raise UnsupportedModel(f"{path}: partial rotary embeddings are not supported")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModel(
            f"{path}: rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return float(theta), None
    try:
        normalised = {
            "rope_type": "llama3",
            "factor": float(scaling["factor"]),
            "low_freq_factor": float(scaling["low_freq_factor"]),
            "high_freq_factor": float(scaling["high_freq_factor"]),
            "original_max_position_embeddings": int(scaling["original_max_position_embeddings"]),
        }
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: llama3 rope scaling lacks or misstates {exc}") from None
    return float(theta), normalised


def _sliding_window(raw: dict[str, Any], arch: str) -> int | None:
    """The sliding window some layer actually uses, or None when every layer attends to everything."""
    window = raw.get("sliding_window")
    if not window:
        return None
    layer_types = raw.get("layer_types")
    if isinstance(layer_types, list) and layer_types:
        return int(window) if "sliding_attention" in layer_types else None
    if arch == "mistral":  # Mistral has no switch: a window in the config is a window in use
        return int(window)
    if arch == "qwen2" and raw.get("use_sliding_window"):
        # Qwen2 slides only from layer max_window_layers on.
        return int(window) if int(raw.get("max_window_layers", 0)) < int(raw["num_hidden_layers"]) else None
    return None


def _token_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _fingerprint(model_dir: Path, files: list[Path]) -> str:
    """A short hash of config.json, the index, and each weight file's name, size and sampled bytes."""
    digest = hashlib.blake2b(digest_size=6)
    digest.update((model_dir / "config.json").read_bytes())
    if (model_dir / INDEX_FILE).is_file():
        digest.update((model_dir / INDEX_FILE).read_bytes())
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with path.open("rb") as f:
            for k in range(_FINGERPRINT_SAMPLES):
                f.seek(size * k // _FINGERPRINT_SAMPLES)
                digest.update(f.read(_FINGERPRINT_BYTES))
            f.seek(max(0, size - _FINGERPRINT_BYTES))
            digest.update(f.read())
    return digest.hexdigest()


def load_config(model_dir: str | Path) -> ModelConfig:
    """Read and check config.json (and generation_config.json's stop tokens) of a checkpoint directory."""
    model_dir = Path(model_dir)
    path = model_dir / "config.json"
    raw = _read_json(path)
    arch = _architecture(raw, path)
    if raw.get("hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"{path}: activation {raw['hidden_act']!r} is not supported; supported: silu")
    if raw.get("mlp_bias"):
        raise UnsupportedModel(f"{path}: MLP biases are not supported")
    try:
        hidden_size = int(raw["hidden_size"])
        num_heads = int(raw["num_attention_heads"])
        num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
        head_dim = int(raw.get("head_dim") or hidden_size // num_heads)
        max_model_len = int(raw["max_position_embeddings"])
        fields = dict(
            vocab_size=int(raw["vocab_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: missing or malformed field {exc}") from None
    if num_heads % num_kv_heads:
        raise CheckpointError(f"{path}: {num_heads} attention heads do not divide into {num_kv_heads} kv heads")
    window = _sliding_window(raw, arch)
    if window is not None:
        max_model_len = min(max_model_len, window)
    rope_theta, rope_scaling = _rope(raw, path)

    eos = _token_ids(raw.get("eos_token_id"))
    generation = model_dir / "generation_config.json"
    if generation.is_file():
        eos += _token_ids(_read_json(generation).get("eos_token_id"))
    files = weight_files(model_dir)
    return ModelConfig(
        architecture=arch,
        hidden_size=hidden_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_model_len=max_model_len,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=True if arch == "qwen2" else bool(raw.get("attention_bias", False)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(eos)),
        torch_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
        model_id=f"{model_dir.resolve().name}-{_fingerprint(model_dir, files)}",
        **fields,
    )


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files holding the weights: model.safetensors, or every shard the index names."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index} has no weight_map")
        files = [model_dir / name for name in sorted(set(map(str, weight_map.values())))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} names shards that are missing: {', '.join(missing)}")
        return files
    single = model_dir / SINGLE_FILE
    if single.is_file():
        return [single]
    others = sorted(p.name for p in model_dir.glob("*.bin")) if model_dir.is_dir() else []
    hint = f" (found {', '.join(others)}: only safetensors weights are read)" if others else ""
    raise CheckpointError(f"{model_dir} holds neither {SINGLE_FILE} nor {INDEX_FILE}{hint}")


def iter_weights(model_dir: str | Path, device: str | torch.device = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor by its checkpoint name, one shard open at a time so peak memory stays one shard."""
    from safetensors import safe_open

    for path in weight_files(model_dir):
        try:
            handle = safe_open(str(path), framework="pt", device=str(device))
        except Exception as exc:  # safetensors raises its own error types for a truncated or foreign file
            raise CheckpointError(f"{path} cannot be read as safetensors: {exc}") from None
        with handle as f:
            for name in f.keys():  # noqa: SIM118 (safe_open handles are not iterable)
                yield name, f.get_tensor(name)
