"""`pagedkv bench peer --serve`: reading vLLM's result JSON, the ratios and table, the client's command line, the
`vllm` distribution alias, and the whole command with a fake vLLM (server and client, `fake_vllm_cli.py`) against a
real `pagedkv serve`. The real vLLM only with PAGEDKV_TEST_VLLM_SERVE=<the vLLM environment's python>."""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import shutil
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from pagedkv.bench.peer import bench_peer
from pagedkv.bench.peer_serve import (
    LOADS,
    QUICK_SERVE_WORKLOAD,
    SERVE_WORKLOAD,
    ResultError,
    ServeFigures,
    Server,
    ServeSetup,
    check_complete,
    client_argv,
    comparison_table,
    load_seed,
    meets_aim,
    parse_result,
    serve_ratios,
)
from pagedkv.bench.vllm_cli import alias_distributions

FAKE_CLI = Path(__file__).with_name("fake_vllm_cli.py")

#: The shape of `vllm bench serve --save-result --save-detailed`'s JSON (vLLM 0.32), shortened to 3 requests.
VLLM_RESULT = {
    "date": "20261201-101500",
    "endpoint_type": "openai-chat",
    "backend": "openai-chat",
    "label": None,
    "model_id": "default-llama",
    "tokenizer_id": "/models/default-llama",
    "num_prompts": 3,
    "request_rate": "inf",
    "burstiness": 1.0,
    "max_concurrency": 16,
    "duration": 2.5,
    "completed": 3,
    "failed": 0,
    "total_input_tokens": 780,
    "total_output_tokens": 192,
    "request_throughput": 1.2,
    "request_goodput": None,
    "output_throughput": 76.8,
    "total_token_throughput": 388.8,
    "input_lens": [260, 260, 260],
    "output_lens": [64, 64, 64],
    "ttfts": [0.1, 0.2, 0.3],
    "itls": [[0.01] * 63] * 3,
    "generated_texts": ["x", "y", "z"],
    "errors": ["", "", ""],
    "max_output_tokens_per_s": 96.0,
    "max_concurrent_requests": 3,
    "mean_ttft_ms": 200.0,
    "median_ttft_ms": 200.0,
    "std_ttft_ms": 81.6,
    "p50_ttft_ms": 200.0,
    "p99_ttft_ms": 298.0,
    "mean_tpot_ms": 10.5,
    "median_tpot_ms": 10.25,
    "std_tpot_ms": 0.3,
    "p50_tpot_ms": 10.25,
    "p99_tpot_ms": 11.0,
    "median_itl_ms": 10.0,
    "p99_itl_ms": 12.0,
    "median_e2el_ms": 850.0,
}


def figures(tok_s: float, ttft: float, tpot: float) -> ServeFigures:
    return ServeFigures(
        completed=16,
        failed=0,
        duration_s=1.0,
        input_tokens=512,
        output_tokens=128,
        requests_per_s=16.0,
        output_tok_s=tok_s,
        ttft_p50_ms=ttft,
        tpot_p50_ms=tpot,
    )


# ------------------------------------------------------------------------------------------ vLLM's results


def test_parse_result_reads_vllms_keys() -> None:
    f = parse_result(VLLM_RESULT)
    assert (f.completed, f.failed, f.output_tokens, f.input_tokens) == (3, 0, 192, 780)
    assert (f.output_tok_s, f.ttft_p50_ms, f.tpot_p50_ms) == (76.8, 200.0, 10.25)
    assert (f.ttft_p99_ms, f.tpot_p99_ms, f.itl_p50_ms, f.e2el_p50_ms) == (298.0, 11.0, 10.0, 850.0)
    assert f.output_lens == [64, 64, 64] and f.errors == []
    json_figures = f.as_json()
    assert json_figures["output_tok_s"] == 76.8 and "output_lens" not in json_figures


def test_parse_result_without_the_compared_figures_is_an_error() -> None:
    for key in ("output_throughput", "median_ttft_ms", "median_tpot_ms", "completed"):
        broken = {k: v for k, v in VLLM_RESULT.items() if k != key}
        with pytest.raises(ResultError, match=key):
            parse_result(broken)
    # Without --save-detailed: no per-request lists, and figures vLLM did not print are None.
    lean = {k: v for k, v in VLLM_RESULT.items() if k not in ("output_lens", "errors", "p99_tpot_ms")}
    f = parse_result(lean)
    assert f.output_lens is None and f.errors == [] and f.tpot_p99_ms is None


def test_check_complete_wants_every_request_at_its_full_length() -> None:
    workload = SERVE_WORKLOAD.__class__(prompts=3, input_len=256, output_len=64, warmups=0)
    check_complete(parse_result(VLLM_RESULT), workload, "x")
    failed = parse_result(
        VLLM_RESULT | {"completed": 2, "failed": 1, "errors": ["", "aiohttp: 500 Internal Server Error", ""]}
    )
    with pytest.raises(Exception, match=r"2 of 3 requests completed, 1 failed; the first error: aiohttp: 500"):
        check_complete(failed, workload, "vLLM under load rate4")
    short = parse_result(VLLM_RESULT | {"output_lens": [64, 12, 64], "total_output_tokens": 140})
    with pytest.raises(Exception, match=r"140 output tokens, not 192.*1 requests of another length"):
        check_complete(short, workload, "pagedkv under load concurrent16")


# ---------------------------------------------------------------------------------------- ratios and table


def test_ratios_are_pagedkv_over_vllm() -> None:
    ours, theirs = figures(120.0, 50.0, 9.0), figures(100.0, 100.0, 10.0)
    ratios = serve_ratios(ours, theirs)
    assert ratios == {"tok_s": 1.2, "ttft_p50": 0.5, "tpot_p50": 0.9}
    assert meets_aim(ratios) is True
    assert meets_aim(serve_ratios(figures(99.0, 50.0, 9.0), theirs)) is False  # tok/s below vLLM's
    assert meets_aim(serve_ratios(ours, figures(100.0, 40.0, 10.0))) is False  # TTFT above vLLM's
    assert meets_aim(serve_ratios(ours, figures(100.0, 100.0, 8.0))) is False  # TPOT above vLLM's
    assert serve_ratios(ours, figures(0.0, 100.0, 10.0))["tok_s"] is None
    assert meets_aim({"tok_s": None, "ttft_p50": 1.0, "tpot_p50": 1.0}) is None


def test_comparison_table() -> None:
    results = {
        "concurrent16": {"vllm": figures(100.0, 100.0, 10.0), "pagedkv": figures(120.0, 50.0, 9.0)},
        "rate4": {"vllm": figures(50.0, 20.0, 5.0), "pagedkv": figures(40.0, 30.0, 6.0)},
    }
    lines = comparison_table(results)
    assert lines[0].split()[:3] == ["load", "system", "output"]
    assert len(lines) == 1 + 3 * 2
    assert "concurrent16  vLLM" in lines[1] and "pagedkv" in lines[2]
    assert "pagedkv ÷ vLLM (aim met)" in lines[3] and lines[3].split()[-3:] == ["1.20", "0.50", "0.90"]
    assert "pagedkv ÷ vLLM (aim missed)" in lines[6] and lines[6].split()[-3:] == ["0.80", "1.50", "1.20"]


# ------------------------------------------------------------------------------------------------- client


def test_loads_are_the_issues() -> None:
    assert list(LOADS) == ["concurrent16", "rate4"]
    assert LOADS["concurrent16"].client_args() == ["--request-rate", "inf", "--max-concurrency", "16"]
    assert LOADS["rate4"].client_args() == ["--request-rate", "4"]
    assert math.isinf(LOADS["concurrent16"].request_rate)
    assert (SERVE_WORKLOAD.prompts, SERVE_WORKLOAD.input_len, SERVE_WORKLOAD.output_len) == (200, 256, 64)
    assert (QUICK_SERVE_WORKLOAD.prompts, QUICK_SERVE_WORKLOAD.input_len, QUICK_SERVE_WORKLOAD.output_len) == (
        16,
        32,
        8,
    )
    # The same prompts for both servers; each load its own.
    assert load_seed(7, "concurrent16") == 7 and load_seed(7, "rate4") == 8


def test_client_argv_is_vllm_bench_serve(tmp_path: Path) -> None:
    setup = ServeSetup(
        model_dir=Path("/models/default-llama"),
        model_name="default-llama",
        kv_cache_bytes=2**30,
        max_num_seqs=256,
        max_num_batched_tokens=2048,
        block_size=16,
        vllm_python=Path("/venv/bin/python"),
        vllm_cli=Path("/src/vllm_cli.py"),
        vllm_bind="0-1",
        vllm_eager=False,
        pagedkv_threads=None,
    )
    server = Server("pagedkv", ["x"], env={}, log=tmp_path / "log", port=8123, model_name="default-llama")
    argv = client_argv(setup, server, LOADS["concurrent16"], SERVE_WORKLOAD, 3, tmp_path, "r.json")
    assert argv[:4] == ["/venv/bin/python", "/src/vllm_cli.py", "bench", "serve"]
    text = " ".join(argv)
    for needle in (
        "--backend openai-chat",
        "--base-url http://127.0.0.1:8123",
        "--endpoint /v1/chat/completions",
        "--model default-llama",
        "--tokenizer /models/default-llama",
        "--dataset-name random",
        "--random-input-len 256",
        "--random-output-len 64",
        "--num-prompts 200",
        "--ignore-eos",
        "--seed 3",
        "--request-rate inf --max-concurrency 16",
        "--save-result",
        f"--result-dir {tmp_path}",
        "--result-filename r.json",
    ):
        assert needle in text


def test_vllm_cli_aliases_a_missing_distribution() -> None:
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("no-such-dist-pagedkv")
    undo = alias_distributions({"no-such-dist-pagedkv": ("also-missing", "click")})
    try:
        assert importlib.metadata.version("no-such-dist-pagedkv") == importlib.metadata.version("click")
        assert importlib.metadata.metadata("no_such_dist_pagedkv")["Name"].lower() == "click"
        assert importlib.metadata.version("pytest") == pytest.__version__  # real names are untouched
        with pytest.raises(importlib.metadata.PackageNotFoundError):
            importlib.metadata.version("another-missing-dist")
        alias_distributions({"x": ("y",)})()  # a second call changes nothing (and its undo does nothing)
        assert importlib.metadata.version("no-such-dist-pagedkv") == importlib.metadata.version("click")
    finally:
        undo()
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("no-such-dist-pagedkv")


# --------------------------------------------------------------------------------------- the whole command


def _invoke(*args: str, env: dict[str, str] | None = None):
    return CliRunner(env=env).invoke(bench_peer, list(args), catch_exceptions=False)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_help_mentions_serve() -> None:
    from pagedkv.cli import main

    result = CliRunner().invoke(main, ["bench", "peer", "--help"])
    assert result.exit_code == 0
    for needle in ("--serve", "--serve-prompts", "--serve-load", "--vllm-cli", "vllm bench serve"):
        assert needle in result.output


def test_serve_without_a_vllm_environment_is_a_clear_error(tmp_path: Path) -> None:
    result = _invoke("--serve", "--quick", "--vllm-python", str(tmp_path / "nowhere" / "python"))
    assert result.exit_code == 1
    assert "no vLLM environment" in result.output and "make peer-env" in result.output


def test_serve_runs_one_vllm_thread_setting(tmp_path: Path) -> None:
    result = CliRunner().invoke(bench_peer, ["--serve", "--vllm-threads", "both", "--vllm-python", sys.executable])
    assert result.exit_code == 2 and "--serve runs one vLLM setting" in result.output


def _serve_args(model: Path, *extra: str) -> list[str]:
    return [
        "--serve",
        "--quick",
        "--model",
        str(model),
        "--kv-cache-memory",
        "4MiB",
        "--vllm-python",
        sys.executable,
        "--vllm-cli",
        str(FAKE_CLI),
        *extra,
    ]


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.timeout(180)
def test_serve_quick_against_a_fake_vllm(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    record = tmp_path / "record.jsonl"
    model = tiny_models["llama"]
    result = _invoke(*_serve_args(model), env={"FAKE_VLLM_RECORD": str(record)})
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout.strip().splitlines()[-1])

    assert set(out["serve_ratios"]) == {"concurrent16", "rate4"}
    for name, ratios in out["serve_ratios"].items():
        assert set(ratios) == {"tok_s", "ttft_p50", "tpot_p50"} and all(v > 0 for v in ratios.values())
        load = out["loads"][name]
        for system in ("vllm", "pagedkv"):
            # Every request completed with exactly its output length (the bench checks it), as vLLM's client saw.
            assert load[system]["completed"] == 16 and load[system]["failed"] == 0
            assert load[system]["output_tokens"] == 16 * 8 and load[system]["output_tok_s"] > 0
            assert len(load[system]["load_before"]) == 3
        # The ratios are rounded to 4 places: 5e-5 apart at most, a lot of a small ratio on a loaded machine.
        assert ratios["tok_s"] == pytest.approx(
            load["pagedkv"]["output_tok_s"] / load["vllm"]["output_tok_s"], 1e-3, 5e-5
        )
        assert ratios["ttft_p50"] == pytest.approx(
            load["pagedkv"]["ttft_p50_ms"] / load["vllm"]["ttft_p50_ms"], 1e-3, 5e-5
        )
        assert out["aim_met"][name] in (True, False)
    assert out["loads"]["concurrent16"]["load"]["request_rate"] == "inf"
    assert out["workload"] == {"prompts": 16, "input_len": 32, "output_len": 8, "warmups": 4}
    assert out["served_model_name"] == model.name and out["kv_cache_bytes"] == 4 * 2**20
    assert out["vllm_threads_bind"] == f"0-{(os.cpu_count() or 1) - 1}"

    # vLLM's server: the same model, KV budget and limits, on the CPU, bound threads, without PYTHONPATH.
    calls = _records(record)
    serves = [c for c in calls if c["argv"][0] == "serve"]
    clients = [c for c in calls if c["argv"][:2] == ["bench", "serve"]]
    assert len(serves) == 1 and len(clients) == 4
    argv = " ".join(serves[0]["argv"])
    for needle in (
        f"serve {model.resolve()}",
        f"--served-model-name {model.name}",
        f"--kv-cache-memory-bytes {4 * 2**20}",
        "--max-num-seqs 256",
        "--max-num-batched-tokens 2048",
        "--dtype float32",
        "--enable-prefix-caching",
    ):
        assert needle in argv
    assert "--enforce-eager" not in argv
    assert serves[0]["env"] == {
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_OMP_THREADS_BIND": out["vllm_threads_bind"],
        "PYTHONPATH": None,
    }
    assert not _alive(serves[0]["child"])  # the server's whole process group went

    # The client: vLLM first, then pagedkv, both loads each; the same seed per load for both, another per load.
    def flag(call: dict, name: str) -> str:
        return call["argv"][call["argv"].index(name) + 1]

    urls = [flag(c, "--base-url") for c in clients]
    assert urls[0] == urls[1] != urls[2] == urls[3]
    assert [flag(c, "--seed") for c in clients] == ["0", "1", "0", "1"]
    assert [flag(c, "--request-rate") for c in clients] == ["inf", "4", "inf", "4"]
    assert all(c["env"]["PYTHONPATH"] is None for c in clients)

    assert "pagedkv ÷ vLLM" in result.stdout and "concurrent16" in result.stdout
    assert "vLLM ready in" in result.stderr and "pagedkv ready in" in result.stderr  # progress on stderr
    from common.net import check_port_free

    for url in urls:  # both servers are gone
        check_port_free("127.0.0.1", int(url.rsplit(":", 1)[1]))


def test_a_failing_vllm_server_is_reported_with_its_log(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    result = _invoke(*_serve_args(tiny_models["llama"]), env={"FAKE_VLLM_FAIL": "serve"})
    assert result.exit_code == 1
    assert "vLLM exited with code 3" in result.output
    assert "RuntimeError: fake vLLM asked to fail in serve" in result.output  # the log's tail
    assert "starting pagedkv" not in result.stderr  # nothing after vLLM's failure
    kept = Path(result.stderr.split("the logs are kept in ", 1)[1].split()[0])
    assert "asked to fail" in (kept / "vllm-serve.log").read_text()  # kept after a failure
    shutil.rmtree(kept)


def test_a_failing_client_stops_the_server(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    record = tmp_path / "record.jsonl"
    result = _invoke(
        *_serve_args(tiny_models["llama"], "--serve-load", "rate4", "--vllm-eager"),
        env={"FAKE_VLLM_FAIL": "bench", "FAKE_VLLM_RECORD": str(record)},
    )
    assert result.exit_code == 1
    assert "vLLM's client exited with code 3" in result.output
    assert "fake vLLM asked to fail in bench" in result.output
    [serve] = [c for c in _records(record) if c["argv"][0] == "serve"]
    assert "--enforce-eager" in serve["argv"]
    assert not _alive(serve["child"])
    shutil.rmtree(serve["cwd"])  # the kept logs


@pytest.mark.skipif(
    not os.environ.get("PAGEDKV_TEST_VLLM_SERVE"),
    reason="the real vLLM takes minutes: PAGEDKV_TEST_VLLM_SERVE=<the vLLM environment's python> runs it",
)
@pytest.mark.timeout(1800)
def test_serve_quick_against_real_vllm(tiny_models: dict[str, Path]) -> None:
    result = _invoke(
        "--serve",
        "--quick",
        "--vllm-eager",
        "--model",
        str(tiny_models["llama"]),
        "--kv-cache-memory",
        "64MiB",
        "--vllm-python",
        os.environ["PAGEDKV_TEST_VLLM_SERVE"],
    )
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout.strip().splitlines()[-1])
    for ratios in out["serve_ratios"].values():
        assert all(v is not None and v > 0 for v in ratios.values())
