"""common.tokenizer_cache: the resolution made once in a child process (transformers there, not here), cached
by the tokenizer files' fingerprint, made again when they change, and clear errors when transformers fails."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner
from transformers import AutoTokenizer

from common import tokenizer_cache
from common.tokenizer_cache import TokenizerResolutionError, fingerprint, resolve
from gateway.main import main as gateway_main
from gateway.text import Tokenizer
from pagedkv.tools.model_gen.tokenizer import write_family_tokenizer


@pytest.fixture
def qwen(tmp_path: Path) -> Path:
    """A Qwen2Tokenizer checkpoint whose tokenizer.json alone would tokenize otherwise."""
    model_dir = write_family_tokenizer(tmp_path / "qwen", "qwen2")
    (model_dir / "model.safetensors").write_bytes(b"weights are not the tokenizer's")
    return model_dir


def test_resolved_in_a_child_once_then_cached(qwen: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The gateway's Tokenizer(model_dir) resolves into $PAGEDKV_HOME/tokenizers, once."""
    monkeypatch.setenv("PAGEDKV_HOME", str(tmp_path / "home"))
    tokenizer = Tokenizer(qwen)
    cache = tmp_path / "home" / "tokenizers"
    assert [p.name for p in cache.iterdir()] == [f"{fingerprint(qwen)}.json"], "one file, no temporaries left"
    hf = AutoTokenizer.from_pretrained(str(qwen), local_files_only=True)
    text = "It'S 2024: 日本語 e\u0301  spaced\n\n<|im_start|>x"
    assert tokenizer.tokenizer_class == "Qwen2Tokenizer" and tokenizer.encode(text) == hf.encode(text)
    resolution = resolve(qwen, cache)

    monkeypatch.setattr(tokenizer_cache, "RESOLVER_MODULE", "no.such.resolver")  # a second child would fail
    assert resolve(qwen, cache) == resolution
    (qwen / "model.safetensors").write_bytes(b"new weights")
    assert resolve(qwen, cache) == resolution, "the weights are not part of the fingerprint"
    copy = shutil.copytree(qwen, tmp_path / "copy")
    assert fingerprint(copy) == fingerprint(qwen), "content, not the path, keys the cache"

    (cache / f"{fingerprint(copy)}.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(TokenizerResolutionError, match=r"no\.such\.resolver"):
        resolve(copy, cache)  # an unreadable cached file is made again, not trusted

    monkeypatch.undo()
    config = json.loads((qwen / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["extra_special_tokens"] = ["<|tool|>"]
    (qwen / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    (tmp_path / "not-a-directory").write_text("", encoding="utf-8")
    temporaries = set(Path(tempfile.gettempdir()).glob("pagedkv-tokenizer-*"))
    edited = resolve(qwen, tmp_path / "not-a-directory" / "cache")  # an edited config is resolved again,
    assert edited["vocab_size"] == resolution["vocab_size"] + 1  # into a temporary cache here
    assert set(Path(tempfile.gettempdir()).glob("pagedkv-tokenizer-*")) <= temporaries, "and that is removed"


def test_a_tokenizer_transformers_cannot_load_stops_the_gateway_with_a_clear_error(
    qwen: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAGEDKV_HOME", str(tmp_path / "home"))
    (qwen / "tokenizer.json").write_text('{"model": "broken"', encoding="utf-8")
    args = ["--model", str(qwen), "--executors", "tcp://127.0.0.1:9", "--blockd", "tcp://127.0.0.1:9"]
    result = CliRunner().invoke(gateway_main, args)
    assert result.exit_code == 1, result.output
    message = result.output.strip().splitlines()[-1]  # after the log line that it is resolving
    assert message.startswith(f"Error: cannot load the tokenizer of {qwen} with transformers: JSONDecodeError")
    assert "Traceback" not in result.output
    assert not list((tmp_path / "home" / "tokenizers").iterdir()), "nothing is cached for a failure"
    with pytest.raises(TokenizerResolutionError, match="no such directory"):
        resolve(tmp_path / "absent", tmp_path / "cache")
