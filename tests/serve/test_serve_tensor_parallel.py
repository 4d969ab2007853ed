"""`pagedkv serve --tensor-parallel-size 2` through the OpenAI API: each executor a group of two processes (gloo),
its greedy completions equal to transformers' and each chosen token's logprob within 2e-3, on Llama, Qwen3 (its
one KV head replicated on both ranks) and Qwen3-MoE."""

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


@pytest.mark.parametrize("name", sorted(MODELS))
def test_serve_tp2_completions_match_transformers(name: str, tmp_path: Path) -> None:
    model = write_model(tmp_path / f"tp-{name}", quiet=True, **{**TINY, **MODELS[name]})
    prompt = random_prompts([19], vocab=512, seed=43)[0]
    with LocalStack(
        model_dir=model,
        port=0,
        kv_cache_memory="16MiB",
        persistence=False,
        log_dir=tmp_path / "logs",
        progress=None,
        tensor_parallel_size=2,
    ) as stack:
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
    tokens = [int(t.removeprefix("token_id:")) for t in logprobs["tokens"]]
    assert tokens == hf_greedy_ignoring_eos(model, prompt, MAX_TOKENS)
    reference = hf_logprobs(model, prompt, tokens)
    for position, (token, logprob) in enumerate(zip(tokens, logprobs["token_logprobs"], strict=True)):
        assert abs(logprob - reference[position, token].item()) < 2e-3
