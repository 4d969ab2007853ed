"""`/v1/embeddings` through a real stack (blockd, an executor started with `--task embed`, the gateway) with the
`openai` SDK unchanged: pooled hidden states equal transformers' `AutoModel` (last token, normalised), floats and
base64, batches of texts and token ids, `dimensions`, usage; bad input answered in OpenAI's error shape; the
generation endpoints refused on an embedding server."""

from __future__ import annotations

import base64
import json
from array import array
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
import transformers

from gateway.text import Tokenizer
from pagedkv.serve import LocalStack
from pagedkv.tools.model_gen import write_model
from tests.executor.harness import reference_run
from tests.support.gateway import local_stack
from tests.support.models import TINY

TEXTS = ["The quick brown fox", "jumps over the lazy dog, twice over and again"]
MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3-shaped checkpoint that says it was trained for Matryoshka truncation (as vLLM reads it)."""
    options = {**TINY, "arch": "qwen3", "head_dim": 32, "max_position": MAX_MODEL_LEN}
    path = write_model(tmp_path_factory.mktemp("embed-model") / "tiny-qwen3-embed", quiet=True, **options)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "is_matryoshka": True}))
    return path


@pytest.fixture(scope="module")
def stack(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    logs = tmp_path_factory.mktemp("embed-logs")
    with local_stack(model_dir, logs, executors=1, executor_args=["--runner", "pooling"]) as running:
        yield running


@pytest.fixture(scope="module")
def client(stack: LocalStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer(model_dir)


@pytest.fixture(scope="module")
def reference(model_dir: Path):
    """transformers' last_hidden_state of the prompt's last token (unnormalised)."""
    model = transformers.AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()

    def last_token(ids: list[int]) -> torch.Tensor:
        with reference_run():
            return model(torch.tensor([ids])).last_hidden_state[0, -1]

    return last_token


def unit(v: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(v, dim=-1)


def test_embeddings_equal_transformers_floats_and_base64(client, stack, tokenizer, reference) -> None:
    ids = [tokenizer.encode(t) for t in TEXTS]
    expected = torch.stack([unit(reference(i)) for i in ids])
    # The SDK's default asks for base64 and decodes it itself; "float" asks for JSON numbers.
    for fmt in (openai.NOT_GIVEN, "float"):
        result = client.embeddings.create(model=stack.model_name, input=TEXTS, encoding_format=fmt)
        assert [d.index for d in result.data] == [0, 1] and result.model == stack.model_name
        torch.testing.assert_close(torch.tensor([d.embedding for d in result.data]), expected, atol=1e-4, rtol=1e-4)
        assert result.usage.prompt_tokens == result.usage.total_tokens == sum(map(len, ids))
    raw = client.embeddings.create(model=stack.model_name, input=TEXTS[0], encoding_format="base64")
    values = array("f")
    values.frombytes(base64.b64decode(raw.data[0].embedding))
    torch.testing.assert_close(torch.tensor(values.tolist()), expected[0], atol=1e-4, rtol=1e-4)


def test_token_ids_batches_dimensions_and_normalize(client, stack, reference) -> None:
    one = client.embeddings.create(model=stack.model_name, input=[5, 6, 7, 8])
    torch.testing.assert_close(torch.tensor(one.data[0].embedding), unit(reference([5, 6, 7, 8])), atol=1e-4, rtol=1e-4)
    batch = client.embeddings.create(model=stack.model_name, input=[[5, 6, 7, 8], [9, 10]])
    assert len(batch.data) == 2 and batch.usage.prompt_tokens == 6
    mixed = httpx.post(f"{stack.url}/v1/embeddings", json={"input": ["hello", [9, 10]]}).json()
    torch.testing.assert_close(torch.tensor(mixed["data"][1]["embedding"]), torch.tensor(batch.data[1].embedding))
    short = client.embeddings.create(model=stack.model_name, input=[[5, 6, 7, 8]], dimensions=16)
    torch.testing.assert_close(
        torch.tensor(short.data[0].embedding), unit(reference([5, 6, 7, 8])[:16]), atol=1e-4, rtol=1e-4
    )
    plain = client.embeddings.create(
        model=stack.model_name, input=[9, 10], encoding_format="float", extra_body={"normalize": False}
    )
    torch.testing.assert_close(torch.tensor(plain.data[0].embedding), reference([9, 10]), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": [1] * (MAX_MODEL_LEN + 1)}, "input"),
        ({"input": 5}, "input"),
        ({"input": [1.5]}, "input"),
        ({"input": [True]}, "input"),
        ({"input": [100000]}, "input"),
        ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
        ({"input": "x", "dimensions": 0}, "dimensions"),
        ({"input": "x", "dimensions": TINY["hidden_size"] + 1}, "dimensions"),
        ({"input": "x", "pooling": "max"}, "pooling"),
    ],
)
def test_bad_input_is_answered_in_openai_shape(stack, body, param) -> None:
    response = httpx.post(f"{stack.url}/v1/embeddings", json={"model": stack.model_name, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"] and error["param"] == param


def test_too_long_has_its_code_and_the_sdk_raises(client, stack) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model=stack.model_name, input=[1] * (MAX_MODEL_LEN + 1))
    assert caught.value.code == "context_length_exceeded"


def test_generation_endpoints_are_refused_on_an_embedding_server(client, stack) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=stack.model_name, prompt="hi", max_tokens=2)
    assert caught.value.code == "wrong_task" and "/v1/embeddings" in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=stack.model_name, messages=[{"role": "user", "content": "hi"}])
    assert caught.value.code == "wrong_task"
