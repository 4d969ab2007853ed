"""The shared KV tier with real processes (blockd, two executors on one shared directory, the gateway, the `openai`
client): a prefix computed on one executor is served on the other from the shared tier (`cached_tokens` its length,
transformers' greedy text); after kill -9 of the whole stack, a new stack on the same directory hits it again; a
stream whose executor is killed goes on on the other, loading the prompt and the tokens already generated from the
shared tier where they were written behind, and its text is an uninterrupted run's; a full tier discards its
oldest blocks' files and still serves its newest.
"""

from __future__ import annotations

import random
from pathlib import Path

import openai
import pytest

from pagedkv.serve import LocalStack
from tests.support.gateway import blockd_stats, local_stack, metric, reference_text, tiny_model, wait_for

BS = 16
PROMPT_BLOCKS = 4
LONG = 300  # generated tokens of the migrated stream: the kill comes well inside it


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("shared-tier-model"), "tiny-shared-tier")


def _stack(model_dir: Path, shared: Path, logs: Path, *extra: str, size: str = "4MiB") -> LocalStack:
    return local_stack(
        model_dir,
        logs,
        routing="round-robin",  # the second request goes to the other executor whatever it holds
        executor_args=["--block-size", str(BS), "--shared-kv-dir", str(shared), "--shared-kv-size", size, *extra],
        gateway_args=["--report-cached-tokens", "--executor-timeout", "2"],
    )


def _shared(stack: LocalStack) -> dict[str, dict]:
    """Per pool, its row of the shared tier in `blockd-cli stats --json`."""
    return {
        pool["pool_id"]: next(t for t in pool["tiers"] if t["medium"] == "SHARED")
        for pool in blockd_stats(stack)["pools"]
    }


def _complete(client: openai.OpenAI, stack: LocalStack, prompt: list[int], n: int) -> tuple[str, str, int]:
    raw = client.completions.with_raw_response.create(
        model=stack.model_name, prompt=prompt, max_tokens=n, temperature=0, extra_body={"ignore_eos": True}
    )
    completion = raw.parse()
    usage = completion.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    return raw.headers["x-pagedkv-executor"], completion.choices[0].text, usage.prompt_tokens_details.cached_tokens or 0


def _client(stack: LocalStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=120)


def _wait_written(stack: LocalStack, blocks: int) -> None:
    wait_for(
        lambda: max(t["blocks"] for t in _shared(stack).values()) >= blocks,
        timeout_s=30,
        what=f"{blocks} blocks written to the shared tier and reported to blockd",
    )


@pytest.fixture
def shared_dir(tmp_path: Path) -> Path:
    return tmp_path / "shared-kv"


def test_a_prefix_computed_on_one_executor_is_served_on_the_other_and_after_a_whole_stack_kill(
    model_dir: Path, shared_dir: Path, tmp_path: Path
) -> None:
    prompt = [random.Random(7).randrange(4, 500) for _ in range(PROMPT_BLOCKS * BS + 1)]
    want, _ = reference_text(model_dir, prompt, 8)
    with _stack(model_dir, shared_dir, tmp_path / "logs-1") as stack:
        client = _client(stack)
        first, text, cached = _complete(client, stack, prompt, 8)
        assert (text, cached) == (want, 0)
        _wait_written(stack, PROMPT_BLOCKS)
        second, text, cached = _complete(client, stack, prompt, 8)
        assert second != first
        assert (text, cached) == (want, PROMPT_BLOCKS * BS), "the other executor loads the prefix from the shared tier"
        rows = _shared(stack)
        assert rows[second]["counters"]["loads"] == PROMPT_BLOCKS and rows[second]["counters"]["hits"] == PROMPT_BLOCKS
        assert rows[first]["counters"]["demotions"] >= PROMPT_BLOCKS  # its writes
        for name in ["gateway", "executor-0", "executor-1", "blockd"]:  # kill -9 of everything, as a crash
            stack.kill(name)
    with _stack(model_dir, shared_dir, tmp_path / "logs-2") as stack:  # a new blockd: no index, no device KV
        _, text, cached = _complete(_client(stack), stack, prompt, 8)
        assert (text, cached) == (want, PROMPT_BLOCKS * BS), "the files on the volume hit after the restart"


def test_a_migrated_stream_loads_what_was_written_behind_and_reads_as_one_run(
    model_dir: Path, shared_dir: Path, tmp_path: Path
) -> None:
    prompt = [random.Random(8).randrange(4, 500) for _ in range(PROMPT_BLOCKS * BS + 3)]
    want, _ = reference_text(model_dir, prompt, LONG)
    # Step 60 stalls for 4 s (the executor alive, its heartbeat reporting its writes meanwhile): the tiny model would
    # otherwise finish the whole answer before the test sees the writes in blockd and kills it.
    with _stack(model_dir, shared_dir, tmp_path / "logs", "--fault-stall-step", "60:4") as stack:
        response = _client(stack).completions.with_raw_response.create(
            model=stack.model_name,
            prompt=prompt,
            max_tokens=LONG,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        serving = response.headers["x-pagedkv-executor"]
        other = ({"executor-0", "executor-1"} - {serving}).pop()
        chunks = iter(response.parse())
        head = [next(chunks) for _ in range(3 * BS)]  # three blocks' worth of generated tokens out
        _wait_written(stack, PROMPT_BLOCKS + 2)  # the prompt and generated tokens, written behind as computed
        stack.kill(serving)
        rest = list(chunks)
        text = "".join(c.choices[0].text for c in [*head, *rest] if c.choices)
        assert text == want, "one uninterrupted stream, transformers' greedy text"
        assert metric(stack.url, "pagedkv_gateway_migrations_total") == 1
        loads = _shared(stack)[other]["counters"]["loads"]
        assert loads >= PROMPT_BLOCKS + 2, "the continuation loads the prompt and the tokens out from the shared tier"


def test_a_full_shared_tier_discards_its_oldest_files_and_serves_the_newest(
    model_dir: Path, shared_dir: Path, tmp_path: Path
) -> None:
    rng = random.Random(9)
    prompts = [[rng.randrange(4, 500) for _ in range(PROMPT_BLOCKS * BS + 1)] for _ in range(3)]
    with _stack(model_dir, shared_dir, tmp_path / "logs", size="120KiB") as stack:  # 7 blocks' files
        client = _client(stack)
        capacity = _shared(stack)["executor-0"]["capacity_blocks"]
        assert capacity < 2 * PROMPT_BLOCKS + PROMPT_BLOCKS  # three prompts' blocks do not fit
        served = []
        for prompt in prompts:
            served.append(_complete(client, stack, prompt, 4)[0])
            _wait_written(stack, min(capacity, PROMPT_BLOCKS * len(served)))
        files = list(shared_dir.glob("*/*.kvb"))
        rows = _shared(stack)
        assert all(row["blocks"] <= capacity for row in rows.values())
        assert len(files) <= capacity, "the discarded blocks' files are deleted"
        # The newest prompt is on the volume whole: the executor that did not compute it loads it.
        want, _ = reference_text(model_dir, prompts[-1], 4)
        executor, text, cached = _complete(client, stack, prompts[-1], 4)
        if executor == served[-1]:  # (round robin: the next one is the other executor)
            executor, text, cached = _complete(client, stack, prompts[-1], 4)
        assert executor != served[-1] and (text, cached) == (want, PROMPT_BLOCKS * BS)
