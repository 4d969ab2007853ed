"""`pagedkv bench peer --model-shape`: the shapes' specs, their cache key, and the command generating a shape once
and reusing it, against the fake vLLM driver. The mid shape itself is never generated here: a tiny stand-in takes
its name (the same code path, a model built in well under a second)."""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from safetensors import safe_open

from pagedkv.bench import shapes
from pagedkv.bench.peer import bench_peer
from pagedkv.bench.peer_workloads import WORKLOADS
from pagedkv.bench.shapes import SHAPES, ModelShape, parameter_count, shape_dir, shape_key
from pagedkv.tools.model_gen.spec import ModelSpec
from tests.support.models import TINY

FAKE_DRIVER = Path(__file__).with_name("fake_vllm_driver.py")
FAKE_CLI = Path(__file__).with_name("fake_vllm_cli.py")
STAND_IN = ModelShape("mid", "a tiny stand-in for the tests", dict(arch="llama", **TINY))


def test_the_mid_shape_is_the_issues() -> None:
    spec = SHAPES["mid"].spec
    spec.validate()
    assert spec.arch == "llama"  # both servers count the same prompt tokens with its tokenizer and template
    assert (spec.hidden_size, spec.layers, spec.heads, spec.kv_heads) == (1024, 8, 8, 2)
    assert spec.resolved_head_dim == 128 and spec.heads // spec.kv_heads == 4
    assert 90e6 <= parameter_count(spec) <= 110e6
    longest = max(w.prefix_len + w.prompt_range[1] + w.output_range[1] for w in WORKLOADS.values())
    assert spec.max_position >= longest  # every workload runs on it


def test_tiny_is_the_default_model() -> None:
    assert SHAPES["tiny"].options is None and SHAPES["tiny"].spec == ModelSpec()
    assert SHAPES["tiny"].spec.resolved_head_dim == 32


def test_parameter_count_is_a_generated_models(tiny_models: dict[str, Path]) -> None:
    with safe_open(str(tiny_models["llama"] / "model.safetensors"), "pt") as f:
        names = f.keys()  # a safetensors file object, not a mapping
        written = sum(math.prod(f.get_slice(name).get_shape()) for name in names)
    assert parameter_count(ModelSpec(arch="llama", **TINY)) == written


def test_the_cache_key_follows_the_whole_spec(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    same = ModelShape("mid", "other words", dict(STAND_IN.options or {}))
    other = ModelShape("mid", "", {**(STAND_IN.options or {}), "layers": 3})
    assert shape_key(STAND_IN) == shape_key(same) != shape_key(other)
    spelled_out = ModelShape("mid", "", {**(STAND_IN.options or {}), "rope_scaling": "none"})  # a default, given
    assert shape_key(spelled_out) == shape_key(STAND_IN)
    monkeypatch.setenv("PAGEDKV_HOME", str(tmp_path))
    assert shape_dir(STAND_IN) == tmp_path / "models" / "bench" / shape_key(STAND_IN)


def test_help_explains_each_shape() -> None:
    from pagedkv.cli import main

    result = CliRunner().invoke(main, ["bench", "peer", "--help"])
    assert result.exit_code == 0
    flat = " ".join(result.output.split())
    assert "--model-shape [tiny|mid]" in flat
    assert "tiny: hidden 256" in flat and "mid: hidden 1024, 8 layers, 8 heads / 2 KV heads of 128" in flat


def _offline_args(*extra: str) -> list[str]:
    return [
        "--quick",
        "--workload",
        "default",
        "--vllm-threads",
        "bind",
        "--model-shape",
        "mid",
        "--kv-cache-memory",
        "4MiB",
        "--vllm-python",
        sys.executable,
        "--vllm-driver",
        str(FAKE_DRIVER),
        *extra,
    ]


def _invoke(args: list[str]):
    return CliRunner().invoke(bench_peer, args, catch_exceptions=False)


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The mid shape replaced by the tiny stand-in, cached under a fresh $PAGEDKV_HOME; its directory."""
    monkeypatch.setitem(shapes.SHAPES, "mid", STAND_IN)
    monkeypatch.setenv("PAGEDKV_HOME", str(tmp_path / "home"))
    return shape_dir(STAND_IN)


def test_a_shape_is_generated_once_then_reused(stand_in: Path) -> None:
    first = _invoke(_offline_args())
    assert first.exit_code == 0, first.output
    assert f"generating the mid model shape in {stand_in}" in first.stderr
    assert "training a byte-level BPE tokenizer" in first.stderr  # the generator's progress, on stderr
    figures = json.loads(first.stdout.strip().splitlines()[-1])
    assert figures["model"] == str(stand_in) and figures["model_shape"] == "mid"
    assert "shape mid" in first.stdout
    work = figures["workloads"]["default"]
    check = work["equality"]["against"]["vllm-bind"]
    assert check["equal_requests"] + check["near_ties"] == work["spec"]["requests"]  # vLLM's side loaded it too
    weights = stand_in / "model.safetensors"
    written = weights.stat().st_mtime_ns

    # Again, the driver failing at its load (FAKE_PEER_FAIL): enough to see the model resolved, and fast.
    again = CliRunner(env={"FAKE_PEER_FAIL": "load"}).invoke(bench_peer, _offline_args(), catch_exceptions=False)
    assert again.exit_code == 1 and "the vLLM driver failed" in again.output
    assert f"model:    {stand_in}" in again.stdout
    assert "generating" not in again.stderr and weights.stat().st_mtime_ns == written


def test_serve_takes_the_shape(stand_in: Path) -> None:
    # vLLM's server fails at once (the fake's FAKE_VLLM_FAIL): enough to see which model it was given.
    args = ["--serve", "--quick", "--model-shape", "mid", "--kv-cache-memory", "4MiB"]
    args += ["--vllm-python", sys.executable, "--vllm-cli", str(FAKE_CLI)]
    result = CliRunner(env={"FAKE_VLLM_FAIL": "serve"}).invoke(bench_peer, args, catch_exceptions=False)
    assert result.exit_code == 1 and "vLLM exited with code 3" in result.output
    assert f"model:    {stand_in}" in result.stdout and (stand_in / "model.safetensors").is_file()
    shutil.rmtree(result.stderr.split("the logs are kept in ", 1)[1].split()[0])


def test_nothing_is_generated_without_a_vllm_environment(stand_in: Path, tmp_path: Path) -> None:
    result = _invoke(["--model-shape", "mid", "--vllm-python", str(tmp_path / "nowhere" / "python")])
    assert result.exit_code == 1 and "make peer-env" in result.output
    assert not stand_in.exists()


def test_model_and_model_shape_together_are_a_usage_error(tiny_models: dict[str, Path]) -> None:
    result = _invoke(["--model", str(tiny_models["llama"]), "--model-shape", "tiny"])
    assert result.exit_code == 2 and "give --model or --model-shape, not both" in result.output
    result = _invoke(["--startup", "--model-shape", "mid"])
    assert result.exit_code == 2 and "--startup has --model" in result.output


def test_an_unwritable_home_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(shapes.SHAPES, "mid", STAND_IN)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("PAGEDKV_HOME", str(blocker))
    result = _invoke(_offline_args())
    assert result.exit_code == 1
    assert "cannot write the mid model shape into" in result.output and "PAGEDKV_HOME" in result.output
