"""A checkpoint's tokenizer as transformers' AutoTokenizer builds it, resolved into data the gateway can load.

Run as `python -m common.tokenizer_resolution MODEL_DIR OUT_FILE` by common.tokenizer_cache, once per checkpoint,
so that the gateway never imports transformers (nor torch); why AutoTokenizer must build it is told in
docs/architecture.md ("gateway"). Exit status 1 and one line on stderr when it cannot load the checkpoint.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from common.tokenizer_cache import RESOLUTION_FORMAT


def resolve(model_dir: Path | str) -> dict[str, Any]:
    """What AutoTokenizer.from_pretrained(model_dir) (local files only, no remote code) tokenizes with."""
    import transformers
    from transformers import AutoTokenizer

    # mistral-common's tokenizer (picked for a tekken.json when that package is installed) is no `tokenizers`
    # pipeline: the checkpoint's Hugging Face files are asked for, as vLLM's `--tokenizer-mode hf` does.
    tokenizer = AutoTokenizer.from_pretrained(
        str(model_dir), local_files_only=True, trust_remote_code=False, mistral_format=False
    )
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise TypeError(f"AutoTokenizer loaded {type(tokenizer).__name__}, which has no `tokenizers` backend")
    pipeline = json.loads(backend.to_str())
    # transformers' encode and decode run without the file's truncation and padding (they are call options).
    pipeline["truncation"] = None
    pipeline["padding"] = None
    clean_up = bool(tokenizer.clean_up_tokenization_spaces) and (
        type(backend.model).__name__ != "BPE"
        or bool(getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False))
    )
    return {
        "format": RESOLUTION_FORMAT,
        "transformers_version": transformers.__version__,
        "tokenizer_class": type(tokenizer).__name__,
        "tokenizer": json.dumps(pipeline, ensure_ascii=False),
        "special_tokens": dict(tokenizer.special_tokens_map),  # what chat templates see by name
        "all_special_ids": sorted(set(tokenizer.all_special_ids)),
        "clean_up_tokenization_spaces": clean_up,  # as transformers' decode applies it (never for BPE)
        "split_special_tokens": bool(tokenizer.split_special_tokens),
        "byte_fallback": bool(pipeline.get("model", {}).get("byte_fallback", False)),  # <0x00>.. byte tokens
        "vocab_size": len(tokenizer),
    }


def write_resolution(model_dir: Path | str, out: Path | str) -> dict[str, Any]:
    """Resolve and write it to `out` atomically (readers never see half a file, concurrent writers agree)."""
    resolution = resolve(model_dir)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(resolution, handle, ensure_ascii=False)
        os.replace(temporary, out)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return resolution


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m common.tokenizer_resolution MODEL_DIR OUT_FILE", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local checkpoint: never the network
    try:
        write_resolution(args[0], args[1])
    except Exception as exc:  # one line for the gateway's error, whatever transformers raised
        cause = " ".join(str(exc).split()) or "no message"
        print(f"{type(exc).__name__}: {cause}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
