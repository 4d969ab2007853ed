"""`pagedkv serve --tensor-parallel-size 2` through the OpenAI API: each executor a group of two processes (gloo),
its greedy completions equal to `--tensor-parallel-size 1`'s and to transformers', each chosen token's logprob
within 2e-3 of both, on Llama, Qwen3 (its one KV head replicated on both ranks) and Qwen3-MoE."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from pagedkv.serve import LocalStack
from pagedkv.tools.model_gen import write_model
from tests.executor.harness import hf_greedy_ignoring_eos, hf_logprobs, random_prompts
from tests.support.models import FAMILY_SPECS, TINY

MAX_TOKENS = 8
MODELS = {
    "llama": dict(arch="llama"),
    "qwen3": FAMILY_SPECS["qwen3-hd64-gqa4-tied"],
    "qwen3_moe": FAMILY_SPECS["qwen3_moe-e4k2"],
}


def _complete(model: Path, prompt: list[int], tensor_parallel_size: int, logs: Path) -> tuple[list[int], list[float]]:
    """A greedy completion through the OpenAI API of a `pagedkv serve` stack: its token ids and their logprobs."""
    with LocalStack(
        model_dir=model,
        port=0,
        kv_cache_memory="16MiB",
        persistence=False,
        log_dir=logs,
        progress=None,
        tensor_parallel_size=tensor_parallel_size,
    ) as stack:
        if tensor_parallel_size > 1:
            assert "tensor_parallel_group_joined" in stack.log_path("executor-0").read_text()
        response = httpx.post(
            f"{stack.base_url}/completions",
            json={
                "model": stack.model_name,
                "prompt": prompt,
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
                "logprobs": 1,
                "return_tokens_as_token_ids": True,
            },
            timeout=60,
        )
    assert response.status_code == 200, response.text
    logprobs = response.json()["choices"][0]["logprobs"]
    return [int(t.removeprefix("token_id:")) for t in logprobs["tokens"]], logprobs["token_logprobs"]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_serve_tp2_completions_match_tp1_and_transformers(name: str, tmp_path: Path) -> None:
    model = write_model(tmp_path / f"tp-{name}", quiet=True, **{**TINY, **MODELS[name]})
    prompt = random_prompts([19], vocab=512, seed=43)[0]
    tokens, logprobs = _complete(model, prompt, 2, tmp_path / "logs-tp2")
    assert tokens == hf_greedy_ignoring_eos(model, prompt, MAX_TOKENS)
    reference = hf_logprobs(model, prompt, tokens)
    for position, (token, logprob) in enumerate(zip(tokens, logprobs, strict=True)):
        assert abs(logprob - reference[position, token].item()) < 2e-3
    one_tokens, one_logprobs = _complete(model, prompt, 1, tmp_path / "logs-tp1")
    assert one_tokens == tokens
    assert all(abs(a - b) < 2e-3 for a, b in zip(logprobs, one_logprobs, strict=True))
