"""Where the default model lives, and making sure it is there; the generator itself is a tool, not imported here.

Services (executor, gateway) start on the default model when given none. They find it through this module; when
it is missing it is generated once by the tool (`python -m pagedkv.tools.model_gen DIR`) in a child process, so
no service imports the generator, transformers' model classes or the tokenizer trainer.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from common import processes
from common.home import pagedkv_home

DEFAULT_MODEL_NAME = "default-llama"
# Bumped whenever the generator writes a different default model (its chat template now renders tools): a model
# cached by an older pagedkv is left where it is and a new one is generated beside it, not served stale.
DEFAULT_MODEL_GENERATION = 2
_REQUIRED_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


class DefaultModelUnavailable(RuntimeError):
    """The default model is missing and could not be generated; the message says why."""


def default_model_dir() -> Path:
    """Where the default model lives: $PAGEDKV_HOME/models/v<generation>/default-llama (~/.cache/pagedkv by
    default)."""
    return pagedkv_home() / "models" / f"v{DEFAULT_MODEL_GENERATION}" / DEFAULT_MODEL_NAME


def is_complete_model(path: Path) -> bool:
    """Whether `path` holds a whole checkpoint: configs, tokenizer and its weights (one file, or every shard)."""
    if not all((path / name).is_file() for name in _REQUIRED_FILES):
        return False
    if (path / "model.safetensors").is_file():
        return True
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        return False
    try:
        shards = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        return False
    return bool(shards) and all((path / shard).is_file() for shard in shards)


def ensure_default_model(path: str | Path | None = None) -> Path:
    """The default model's directory, generated on first use (one child process) and reused after."""
    target = Path(path).expanduser() if path is not None else default_model_dir()
    if is_complete_model(target):
        return target
    with tempfile.TemporaryDirectory(prefix="pagedkv-model-gen-") as tmp:
        log = Path(tmp) / "model_gen.log"
        # Stopped by the kernel should this process die first: no generator left writing behind it.
        generator = processes.start(
            [sys.executable, "-m", "pagedkv.tools.model_gen", str(target)], log, die_with_parent=True
        )
        try:
            code = generator.wait()
        finally:
            processes.stop([generator])  # at once when it is done; on Ctrl-C here, the generator too
        if code != 0 or not is_complete_model(target):
            detail = processes.tail(log, 1).strip() or "no output"
            raise DefaultModelUnavailable(f"could not generate the default model in {target}: {detail}")
    return target
