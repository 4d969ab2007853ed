"""The model shapes the peer bench runs on (`--model-shape`): random checkpoints generated once, cached by spec.

Also `ensure_checkpoint`, the generate-once step `--startup`'s checkpoint shares. The shapes and where they are
cached: docs/benchmarks.md ("Model shapes").
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import click

from common.default_model import DEFAULT_MODEL_GENERATION, ensure_default_model, is_complete_model
from common.home import pagedkv_home
from pagedkv.tools.model_gen.spec import ModelSpec, ModelSpecError


@dataclass(frozen=True)
class ModelShape:
    name: str
    about: str  # what it stands for, for --help
    options: Mapping[str, Any] | None  # write_model's options; None: the default model

    @property
    def spec(self) -> ModelSpec:
        return ModelSpec(**(self.options or {}))

    def describe(self) -> str:
        s = self.spec
        return (
            f"{self.name}: hidden {s.hidden_size}, {s.layers} layers, {s.heads} heads / {s.kv_heads} KV heads of "
            f"{s.resolved_head_dim}, intermediate {s.resolved_intermediate_size}, vocab {s.vocab_size}, "
            f"{parameter_count(s) / 1e6:.0f}M parameters; {self.about}"
        )


SHAPES: dict[str, ModelShape] = {
    "tiny": ModelShape("tiny", "the default model (per-step overhead rules)", None),
    "mid": ModelShape(
        "mid",
        "head_dim 128 and GQA 4:1 as Llama 3 / Qwen2.5 / Qwen3 (per-token work rules)",
        dict(arch="llama", hidden_size=1024, layers=8, heads=8, kv_heads=2, vocab_size=4096, max_position=4096),
    ),
}
DEFAULT_SHAPE = "tiny"


def parameter_count(spec: ModelSpec) -> int:
    """A Llama's parameters from its spec alone (nothing built): embeddings, attention, MLP, norms, LM head."""
    h, d = spec.hidden_size, spec.resolved_head_dim
    attention = h * spec.heads * d * 2 + h * spec.kv_heads * d * 2
    layer = attention + 3 * h * spec.resolved_intermediate_size + 2 * h
    embeddings = spec.vocab_size * h * (1 if spec.tied else 2)
    return embeddings + spec.layers * layer + h


def shape_key(shape: ModelShape) -> str:
    """The cache directory's name: the shape and a digest of its resolved spec and the generator's generation."""
    text = json.dumps({"spec": asdict(shape.spec), "generation": DEFAULT_MODEL_GENERATION}, sort_keys=True)
    return f"shape-{shape.name}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def shape_dir(shape: ModelShape) -> Path:
    return pagedkv_home() / "models" / "bench" / shape_key(shape)


def ensure_shape(name: str) -> Path:
    """The shape's checkpoint directory, generated on first use (progress on stderr) and reused after."""
    shape = SHAPES[name]
    if shape.options is None:
        return ensure_default_model()
    return ensure_checkpoint(shape_dir(shape), dict(shape.options), what=f"the {name} model shape", option=None)


def ensure_checkpoint(directory: Path, options: dict[str, Any], *, what: str, option: str | None) -> Path:
    """The checkpoint in `directory`, generated there (write_model's progress on stderr) unless it holds a
    complete one; ClickException when it cannot be written or holds something else. `option` names the command's
    option that chose `directory`, if one did, for the message."""
    if is_complete_model(directory):
        return directory
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        held = f"{option} {directory}" if option else str(directory)
        raise click.ClickException(f"{held} is neither a complete checkpoint nor empty: give an empty or new directory")
    hint = f" (give {option} a writable directory)" if option else " (set PAGEDKV_HOME to a writable directory)"
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory.parent, prefix=".write-check-"):
            pass
    except OSError as exc:
        raise click.ClickException(f"cannot write {what} into {directory}: {exc.strerror or exc}{hint}") from None
    click.echo(f"generating {what} in {directory} (once; reused after)", err=True)
    from pagedkv.tools.model_gen import write_model  # transformers and tokenizers: only when generating

    try:
        with contextlib.redirect_stdout(sys.stderr):  # write_model's progress lines: stderr, not the tables
            write_model(directory, **options)
    except (OSError, ModelSpecError) as exc:
        raise click.ClickException(f"cannot write {what} into {directory}: {exc}") from None
    return directory
