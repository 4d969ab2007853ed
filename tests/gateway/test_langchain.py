"""langchain-openai, unchanged and in a virtual environment of its own (`make langchain-env`: .venv-langchain, or
$LANGCHAIN_VENV), against a stack serving the random-weight default model: tools/compat/langchain_check.py's
bind_tools (tool_choice auto, any, a named tool) and with_structured_output (json_schema, json_mode,
function_calling) all succeed, which needs JSON grammars a weak model can finish (compact by default)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagedkv.serve import LocalStack
from pagedkv.tools.model_gen import write_model
from tests.support.gateway import local_stack

ROOT = Path(__file__).resolve().parents[2]
PYTHON = Path(os.environ.get("LANGCHAIN_VENV") or ROOT / ".venv-langchain") / "bin" / "python"
CHECK = ROOT / "tools" / "compat" / "langchain_check.py"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    model_dir = write_model(tmp_path_factory.mktemp("langchain-model") / "default-llama", quiet=True)
    logs = tmp_path_factory.mktemp("langchain-logs")
    with local_stack(model_dir, logs, executors=1, gateway_args=["--tool-call-parser", "hermes"]) as running:
        yield running


def test_langchain_tools_and_structured_output_succeed(stack: LocalStack) -> None:
    if not PYTHON.exists():
        pytest.skip(f"{PYTHON} is missing: run `make langchain-env` (tools/compat/langchain-requirements.txt)")
    env = {**os.environ, "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}
    done = subprocess.run(
        [str(PYTHON), str(CHECK), stack.base_url, "default-llama"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert "failed" not in done.stdout.split("=== summary")[1]
