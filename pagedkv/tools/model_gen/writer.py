"""Writing a whole checkpoint directory atomically: `write_model`, and the default model's generation."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

import click

from common.default_model import is_complete_model
from common.units import parse_size
from pagedkv.tools.model_gen.spec import (
    ARCHITECTURES,
    BOS,
    EOS,
    IM_END,
    IM_START,
    MOE_ARCHS,
    ModelSpec,
    ModelSpecError,
)
from pagedkv.tools.model_gen.tokenizer import _write_tokenizer
from pagedkv.tools.model_gen.weights import _build_model


@contextlib.contextmanager
def _no_progress_bars() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _is_empty_dir(path: Path) -> bool:
    return path.is_dir() and not any(path.iterdir())


def _check_target(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ModelSpecError("--out", f"{out} exists and is not a directory")
    if out.is_dir() and not _is_empty_dir(out):
        if not force:
            raise ModelSpecError("--out", f"{out} is not empty; pass --force to replace the model in it")
        if not (out / "config.json").is_file():
            # --force deletes the directory: only ever one that holds a model.
            raise ModelSpecError("--out", f"{out} is not empty and holds no config.json; refusing to replace it")


def _human(nbytes: int) -> str:
    if nbytes < 1024:
        return f"{nbytes} B"
    value = float(nbytes)
    for unit in ("KiB", "MiB", "GiB"):
        value /= 1024
        if value < 1024 or unit == "GiB":
            break
    return f"{value:.1f} {unit}"


def write_model(
    out: str | Path,
    *,
    max_shard_size: int | str | None = None,
    force: bool = False,
    quiet: bool = False,
    **options: Any,
) -> Path:
    """Write a random-weight checkpoint into `out` and return it; ModelSpecError for bad options.

    `options` are ModelSpec's fields (arch, hidden_size, layers, heads, kv_heads, head_dim, sliding_window,
    experts, ...; see ModelSpec). The files are written into a temporary sibling directory and renamed into
    place, so `out` never holds a half-written model. `tie_embeddings=None` ties for qwen2 and Gemma only;
    `initializer_range=None` aims the logits at a std of ~4 (see TARGET_LOGIT_STD); `max_shard_size` ("1MiB",
    bytes) shards the weights.
    """
    known = {f.name for f in fields(ModelSpec)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"write_model got unknown options {unknown}; ModelSpec has {sorted(known)}")
    if options.get("rope_theta") is not None:
        options["rope_theta"] = float(options["rope_theta"])
    if "mlp_only_layers" in options:
        options["mlp_only_layers"] = tuple(options["mlp_only_layers"])
    spec = ModelSpec(**options)
    spec.validate()
    shard_bytes = None
    if max_shard_size is not None:
        try:
            shard_bytes = parse_size(max_shard_size) if isinstance(max_shard_size, str) else int(max_shard_size)
        except ValueError as exc:
            raise ModelSpecError("--max-shard-size", str(exc)) from None
        if shard_bytes < 1:
            raise ModelSpecError("--max-shard-size", "--max-shard-size must be positive")
    out = Path(out).expanduser().absolute()
    _check_target(out, force)
    say = (lambda _msg: None) if quiet else click.echo
    out.parent.mkdir(parents=True, exist_ok=True)

    started = time.perf_counter()
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    staging.chmod(0o755)  # mkdtemp's 0700 would follow the directory through the rename
    try:
        say(f"training a byte-level BPE tokenizer ({spec.vocab_size} tokens)")
        ids = _write_tokenizer(staging, spec)
        say(f"building {ARCHITECTURES[spec.arch]} with random weights (seed {spec.seed})")
        model = _build_model(spec, ids)
        say("writing config.json, generation_config.json and safetensors weights")
        with _no_progress_bars():  # our own progress lines say what is written; tqdm output would garble them
            model.save_pretrained(str(staging), **({"max_shard_size": shard_bytes} if shard_bytes else {}))
        _replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if not quiet:
        files = sorted(p for p in out.iterdir() if p.is_file())
        total = sum(p.stat().st_size for p in files)
        params = sum(p.numel() for p in model.parameters())
        say(f"wrote {out} in {time.perf_counter() - started:.1f} s")
        say(
            f"  arch {spec.arch} ({ARCHITECTURES[spec.arch]}), {params:,} parameters, {spec.dtype}, "
            f"{'tied' if spec.tied else 'untied'} embeddings"
        )
        say(
            f"  {spec.layers} layers, hidden {spec.hidden_size}, intermediate {spec.resolved_intermediate_size}, "
            f"{spec.heads} heads / {spec.kv_heads} kv heads of {spec.resolved_head_dim}, "
            f"rope {spec.rope_scaling} theta {spec.resolved_rope_theta:g}, max position {spec.max_position}"
        )
        if spec.resolved_window:
            say(f"  sliding window {spec.resolved_window}, layers {spec.layer_types or 'all sliding'}")
        if spec.arch in MOE_ARCHS:
            say(f"  {spec.experts} experts, {spec.experts_per_token} per token")
        say(
            f"  vocab {spec.vocab_size}: bos {ids[BOS]}, eos {ids[EOS]}, im_start {ids[IM_START]}, im_end {ids[IM_END]}"
        )
        for path in files:
            say(f"  {path.name:<40} {_human(path.stat().st_size):>12}")
        say(f"  {len(files)} files, {total:,} bytes ({_human(total)})")
    return out


def _replace(staging: Path, out: Path) -> None:
    """Move the finished staging directory to `out`, replacing an empty or (checked) model directory."""
    if out.is_dir():
        if _is_empty_dir(out):
            out.rmdir()
        else:
            shutil.rmtree(out)
    os.replace(staging, out)


def generate_default_model(target: Path) -> Path:
    """Generate the default small llama model (write_model's defaults) into `target` unless it is there.

    write_model stages into a temporary directory and renames it, so a model found here is complete; two
    processes racing both generate and the loser of the rename uses the winner's identical files.
    """
    if is_complete_model(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.build.", dir=target.parent))
    try:
        built = write_model(staging / "model", quiet=True)
        try:
            os.rename(built, target)
        except OSError as exc:
            if not is_complete_model(target):  # not a lost race: something else is in the way
                raise RuntimeError(f"{target} exists but holds no complete model; remove it") from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
