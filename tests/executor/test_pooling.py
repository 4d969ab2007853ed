"""Embeddings at the executor: pooled hidden states against transformers' `AutoModel` (last_hidden_state, after
the final norm) on a Qwen3-shaped and a Llama-shaped tiny checkpoint, and the pooling configs read from
sentence-transformers' files."""

from __future__ import annotations

import json
from array import array
from pathlib import Path

import pytest
import torch
import transformers

from common.tokens import pack_tokens, unpack_tokens
from executor import protocol as ep
from executor.embedding import EmbedJob, start_embedding
from executor.pooling import (
    Embedder,
    PoolingConfig,
    PoolingConfigError,
    PoolingType,
    finish,
    read_pooling_config,
)
from executor.runner import load_model
from pagedkv.tools.model_gen import write_model
from tests.executor.harness import reference_run
from tests.support.models import TINY

ARCHS = {"qwen3": dict(arch="qwen3", head_dim=32), "llama": dict(arch="llama")}
# Prompts of several lengths (past one block of 16, one of a single token), sharing a prefix.
PROMPTS = [[5, 9, 200, 31, 7] * 7, [5, 9, 200], [42], list(range(3, 60))]


@pytest.fixture(scope="module", params=sorted(ARCHS))
def checkpoint(request, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp(f"embed-{request.param}")
    return write_model(root / request.param, quiet=True, **{**TINY, **ARCHS[request.param]})


def reference(model_dir: Path, prompts: list[list[int]], kind: PoolingType) -> torch.Tensor:
    model = transformers.AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = []
    with reference_run():
        for prompt in prompts:
            hidden = model(torch.tensor([prompt])).last_hidden_state[0]
            rows.append({"last": hidden[-1], "cls": hidden[0], "mean": hidden.mean(0)}[kind.value])
    return torch.stack(rows)


def embedder(model_dir: Path, kind: PoolingType, max_batch_tokens: int = 64, **pooling) -> Embedder:
    loaded = load_model(model_dir, torch.device("cpu"), torch.float32)
    config = PoolingConfig(kind, **pooling)
    return Embedder(
        loaded.model,
        loaded.config,
        config,
        device=loaded.device,
        dtype=loaded.dtype,
        block_size=16,
        max_batch_tokens=max_batch_tokens,
    )


@pytest.mark.parametrize("kind", list(PoolingType))
def test_pooled_hidden_states_equal_transformers(checkpoint, kind) -> None:
    expected = reference(checkpoint, PROMPTS, kind)
    # max_batch_tokens 64: the prompts go in two passes, so batching and the scratch cache's reuse are covered.
    got = embedder(checkpoint, kind).embed(PROMPTS, None, normalize=False)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    normed = embedder(checkpoint, kind).embed(PROMPTS, None, normalize=True)
    torch.testing.assert_close(normed, torch.nn.functional.normalize(expected, dim=-1), atol=1e-4, rtol=1e-4)


def test_matryoshka_truncates_then_normalises() -> None:
    v = torch.tensor([[3.0, 4.0, 12.0]])
    torch.testing.assert_close(finish(v, 2, True), torch.tensor([[0.6, 0.8]]))
    torch.testing.assert_close(finish(v, None, False), v)


def test_embed_request_answers_and_refuses(checkpoint) -> None:
    e = embedder(checkpoint, PoolingType.LAST)
    config = e.config

    def ask(prompts: list[bytes], **fields) -> ep.Embedded | ep.Rejected:
        job = start_embedding(e, ep.Embed(request_id="r", prompts=prompts, **fields), config)
        if not isinstance(job, EmbedJob):
            return job
        passes = 1
        while (answer := job.step()) is None:
            passes += 1
        assert passes == len(e.batches([unpack_tokens(p) for p in prompts]))
        return answer

    answer = ask([pack_tokens(p) for p in PROMPTS])  # in two passes (max_batch_tokens 64)
    assert type(answer) is ep.Embedded and len(answer.embeddings) == len(PROMPTS)
    assert answer.prompt_tokens == sum(map(len, PROMPTS))
    whole = e.embed(PROMPTS, None, normalize=True)
    last = array("f")
    last.frombytes(answer.embeddings[3])
    torch.testing.assert_close(torch.tensor(last.tolist()), whole[3])
    assert len(answer.embeddings[0]) == 4 * config.hidden_size
    codes = {
        "empty list": ask([]).code,
        "empty prompt": ask([b""]).code,
        "ragged bytes": ask([b"\x01\x02\x03"]).code,
        "out of vocab": ask([pack_tokens([config.vocab_size])]).code,
        "too long": ask([pack_tokens([1] * (config.max_model_len + 1))]).code,
        "dimensions without matryoshka": ask([pack_tokens([1])], dimensions=8).code,
    }
    assert codes == {
        "empty list": "invalid_request",
        "empty prompt": "invalid_request",
        "ragged bytes": "invalid_request",
        "out of vocab": "invalid_request",
        "too long": "context_length_exceeded",
        "dimensions without matryoshka": "invalid_request",
    }
    assert start_embedding(None, ep.Embed(request_id="r", prompts=[pack_tokens([1])]), config).code == "wrong_task"


def test_pooling_config_from_sentence_transformers(tmp_path) -> None:
    (tmp_path / "1_Pooling").mkdir()
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    (tmp_path / "config.json").write_text(json.dumps({"matryoshka_dimensions": [32, 64]}))
    config = read_pooling_config(tmp_path)
    assert config == PoolingConfig(PoolingType.MEAN, normalize=False, matryoshka=True, matryoshka_dimensions=(32, 64))
    modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    assert read_pooling_config(tmp_path).normalize is True
    assert read_pooling_config(tmp_path, "CLS").type is PoolingType.CLS  # --pooling-type wins
    assert read_pooling_config(tmp_path, allow_any_dimensions=True).matryoshka_dimensions is None
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(PoolingConfigError, match="pooling_mode_max_tokens"):
        read_pooling_config(tmp_path)
    assert read_pooling_config(tmp_path, "last").type is PoolingType.LAST  # an override needs no readable config
    assert read_pooling_config(tmp_path / "absent") == PoolingConfig()  # no files: last token, normalised
