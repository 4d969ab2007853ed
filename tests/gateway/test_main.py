"""`pagedkv-gateway`'s options (gateway/main.py), without serving: --max-queued-sequences says what it counts, and
--max-queue, its old spelling, is still taken (hidden, with a warning in the log)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from gateway import main as gateway_main
from gateway.state import GatewayConfig


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[GatewayConfig]:
    """The configs the command would serve (run_gateway replaced: nothing listens; no tokenizer to resolve)."""
    configs: list[GatewayConfig] = []
    monkeypatch.setattr("common.tokenizer_cache.resolve", lambda model_dir: None)
    monkeypatch.setattr(gateway_main, "run_gateway", lambda config, **_: configs.append(config))
    return configs


def invoke(*args: str, **env: str) -> Any:
    return CliRunner().invoke(gateway_main.main, ["--model", str(Path("/nowhere")), *args], env=env)


def test_the_bound_counts_sequences_and_says_so() -> None:
    help_text = " ".join(CliRunner().invoke(gateway_main.main, ["--help"]).output.split())
    assert (
        "--max-queued-sequences INTEGER RANGE Sequences (a request's prompts x n) in flight at once, waiting or "
        "generating; a request that would pass it gets 429, one that alone exceeds it 400 (too_many_generations). "
        "[default: 512; x>=1]"
    ) in help_text
    assert "--max-queue " not in help_text  # the old spelling is hidden


def test_max_queued_sequences_reaches_the_config(served: list[GatewayConfig]) -> None:
    result = invoke("--max-queued-sequences", "7")
    assert result.exit_code == 0, result.output
    assert [c.max_queued_sequences for c in served] == [7]
    assert "deprecated" not in result.output
    assert invoke().exit_code == 0 and served[-1].max_queued_sequences == 512


@pytest.mark.parametrize(
    ("args", "env"), [(("--max-queue", "9"), {}), ((), {"PAGEDKV_GATEWAY_MAX_QUEUE": "9"})], ids=["flag", "env"]
)
def test_the_old_spelling_is_taken_with_a_warning(
    served: list[GatewayConfig], args: tuple[str, ...], env: dict[str, str]
) -> None:
    result = invoke(*args, **env)
    assert result.exit_code == 0, result.output
    assert [c.max_queued_sequences for c in served] == [9]
    assert "deprecated_option" in result.output and "--max-queued-sequences" in result.output


def test_both_spellings_at_once_are_a_usage_error(served: list[GatewayConfig]) -> None:
    result = invoke("--max-queued-sequences", "7", "--max-queue", "9")
    assert result.exit_code == 2 and "give --max-queued-sequences only" in result.output
    assert served == []
