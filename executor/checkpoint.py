"""Reading a Hugging Face-style checkpoint directory: config.json, generation_config.json and safetensors weights.

No transformers model classes are used here: the executor runs its own model code and only needs the shapes,
the per-layer attention options, the rope settings, the stop tokens and the tensors by name. Each family's
config is read by its description in `executor.models.families` into one normalised `ModelConfig`. Both config
spellings are read: transformers 5 writes `rope_parameters` (with `rope_theta` inside) and `dtype`;
transformers 4 wrote `rope_theta` and `rope_scaling` at the top level and `torch_dtype`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from executor.model_config import CheckpointError, ModelConfig
from executor.models.families import describe

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Bytes sampled per weight file for the model id: enough to tell two checkpoints of one shape apart (random
# or fine-tuned weights differ nearly everywhere) without reading gigabytes at every start.
_FINGERPRINT_SAMPLES, _FINGERPRINT_BYTES = 8, 4096


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
    fields = describe(raw, path)
    eos = _token_ids(raw.get("eos_token_id"))
    generation = model_dir / "generation_config.json"
    if generation.is_file():
        eos += _token_ids(_read_json(generation).get("eos_token_id"))
    files = weight_files(model_dir)
    return ModelConfig(
        **fields,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(eos)),
        torch_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
        model_id=f"{model_dir.resolve().name}-{_fingerprint(model_dir, files)}",
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
