"""The checkpoint's tokenizer as transformers resolves it, computed once in a child process and cached.

This module is transformers-free (the gateway imports it): `resolve` runs `python -m common.tokenizer_resolution`
when no resolution of these tokenizer files is cached; the cache and its key are told in docs/architecture.md
("gateway").
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

import structlog

from common.home import pagedkv_home

log = structlog.get_logger("tokenizer")

# Bumped when what a resolution holds changes, so older cached ones are not read as new.
RESOLUTION_FORMAT = 1
RESOLVER_MODULE = "common.tokenizer_resolution"
RESOLVE_TIMEOUT_S = 600.0
# Weights and other large files AutoTokenizer never reads are left out of the fingerprint.
_NOT_TOKENIZER = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack", ".onnx", ".npz")
_TEMPLATE_DIR = "additional_chat_templates"


class TokenizerResolutionError(RuntimeError):
    """transformers could not load the checkpoint's tokenizer (the message names the directory and the cause)."""


def cache_dir() -> Path:
    return pagedkv_home() / "tokenizers"


def fingerprint(model_dir: Path | str) -> str:
    """A digest of what AutoTokenizer reads in `model_dir` and of the library versions that resolve it."""
    model_dir = Path(model_dir)
    digest = hashlib.sha256(f"format {RESOLUTION_FORMAT}\n".encode())
    for package in ("transformers", "tokenizers"):
        digest.update(f"{package} {_version(package)}\n".encode())
    files = [p for p in model_dir.iterdir() if p.is_file()]
    templates = model_dir / _TEMPLATE_DIR
    if templates.is_dir():
        files += [p for p in templates.iterdir() if p.is_file()]
    for path in sorted(files):
        if path.name.endswith(_NOT_TOKENIZER) or path.name.startswith("."):
            continue
        digest.update(f"{path.relative_to(model_dir).as_posix()} {path.stat().st_size}\n".encode())
        with path.open("rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "absent"


def resolve(model_dir: Path | str, cache: Path | None = None) -> dict[str, Any]:
    """The resolution of `model_dir`'s tokenizer: cached, or made now by the resolver in a child process."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise TokenizerResolutionError(f"cannot load the tokenizer of {model_dir}: no such directory")
    cache = cache_dir() if cache is None else cache
    path = cache / f"{fingerprint(model_dir)}.json"
    cached = _read(path)
    if cached is not None:
        return cached
    try:
        cache.mkdir(parents=True, exist_ok=True)
        writable = os.access(cache, os.W_OK)
    except OSError:
        writable = False
    target = path
    if not writable:  # a read-only home: resolve for this process only
        log.warning("tokenizer_cache_unwritable", cache=str(cache))
        target = Path(tempfile.mkdtemp(prefix="pagedkv-tokenizer-")) / path.name
    log.info("tokenizer_resolving", model_dir=str(model_dir), cache=str(target))
    try:
        _run_resolver(model_dir, target)
        resolution = _read(target)
    finally:
        if target != path:
            shutil.rmtree(target.parent, ignore_errors=True)
    if resolution is None:
        raise TokenizerResolutionError(f"cannot load the tokenizer of {model_dir}: the resolver wrote no resolution")
    return resolution


def _run_resolver(model_dir: Path, out: Path) -> None:
    command = [sys.executable, "-m", RESOLVER_MODULE, str(model_dir), str(out)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=RESOLVE_TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        raise TokenizerResolutionError(
            f"cannot load the tokenizer of {model_dir}: transformers took over {RESOLVE_TIMEOUT_S:.0f} s"
        ) from None
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        cause = lines[-1].strip() if lines else f"the resolver exited with status {done.returncode}"
        raise TokenizerResolutionError(f"cannot load the tokenizer of {model_dir} with transformers: {cause}")


def _read(path: Path) -> dict[str, Any] | None:
    """A resolution of this format, or None (absent, or unreadable: then it is made again)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if (
        not isinstance(data, dict)
        or data.get("format") != RESOLUTION_FORMAT
        or not isinstance(data.get("tokenizer"), str)
    ):
        return None
    return data
