"""`pagedkv bench peer --startup`: the schedule and its figures, the checkpoint it generates, the server timing,
and the whole command against the fake vLLM driver with the real `pagedkv serve` on a tiny model."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from common.net import free_port
from pagedkv.bench.peer import bench_peer
from pagedkv.bench.peer_startup import (
    BIG_CHECKPOINT,
    CASES,
    SYSTEMS,
    Launch,
    PeerFailed,
    StartupRecord,
    ensure_checkpoint,
    measure_server,
    run_startup_rounds,
    startup_schedule,
    summarize,
)

FAKE_DRIVER = Path(__file__).with_name("fake_vllm_driver.py")


def _invoke(*args: str, env: dict[str, str] | None = None):
    return CliRunner(env=env).invoke(bench_peer, ["--startup", *args], catch_exceptions=False)


# ---------------------------------------------------------------------------------------- schedule, figures


def test_round_zero_is_cold_then_rounds_alternate_the_systems() -> None:
    assert startup_schedule(["a", "b"], ["p", "v"], 1) == [
        (0, "a", "p"),
        (0, "a", "v"),
        (0, "b", "p"),
        (0, "b", "v"),
        (1, "a", "p"),
        (1, "a", "v"),
        (1, "b", "p"),
        (1, "b", "v"),
    ]
    assert len(startup_schedule(CASES, SYSTEMS, 3)) == 4 * 3 * 3


def test_medians_ratios_and_a_failed_peer() -> None:
    seconds = {
        # (case, system): round 0, 1, 2, 3
        ("load", "pagedkv"): [3.0, 1.0, 2.0, 9.0],
        ("load", "vllm-compiled"): [60.0, 20.0, 10.0, 30.0],
        ("load", "vllm-eager"): [8.0, 4.0, 5.0, 6.0],
    }
    seen: list[tuple[str, str, int]] = []

    def measure(case: str, system: str, round_: int) -> Launch:
        seen.append((case, system, round_))
        if case == "serve":
            if system == "vllm-eager":
                raise PeerFailed("it broke")
            return Launch({"pagedkv": 2.0, "vllm-compiled": 8.0}[system] + round_)
        return Launch(seconds[(case, system)][round_], launch_s=10.0 + round_)

    reported: list[StartupRecord] = []
    records = run_startup_rounds(["load", "serve"], SYSTEMS, 3, measure, reported.append)
    assert reported == records
    # The failed setting is tried once, then skipped; everything else runs every round.
    assert [s for s in seen if s[:2] == ("serve", "vllm-eager")] == [("serve", "vllm-eager", 0)]
    assert len(records) == 4 * 3 + 4 * 2 + 1
    assert all(len(r.load_before) in (0, 3) for r in records)

    load = summarize(records, "load")
    assert load.medians == {"pagedkv": 2.0, "vllm-compiled": 20.0, "vllm-eager": 5.0}  # warm rounds only
    assert load.cold == {"pagedkv": 3.0, "vllm-compiled": 60.0, "vllm-eager": 8.0}
    assert load.launch_medians == {"pagedkv": 12.0, "vllm-compiled": 12.0, "vllm-eager": 12.0}
    assert (load.best_vllm, load.ratio) == ("vllm-eager", pytest.approx(0.4))  # against the faster setting
    assert load.ratios == {"vllm-compiled": pytest.approx(0.1), "vllm-eager": pytest.approx(0.4)}
    assert load.cold_ratios == {"vllm-compiled": pytest.approx(0.05), "vllm-eager": pytest.approx(3 / 8)}

    serve = summarize(records, "serve")
    assert serve.errors == {"vllm-eager": "it broke"}
    assert serve.medians == {"pagedkv": 4.0, "vllm-compiled": 10.0}
    assert (serve.best_vllm, serve.ratio) == ("vllm-compiled", pytest.approx(0.4))
    assert serve.as_json()["errors"] == {"vllm-eager": "it broke"}


def test_a_failing_pagedkv_start_stops_the_rounds() -> None:
    import click

    def measure(case: str, system: str, round_: int) -> Launch:
        raise click.ClickException("pagedkv broke")

    with pytest.raises(click.ClickException, match="pagedkv broke"):
        run_startup_rounds(["load"], SYSTEMS, 1, measure)


# -------------------------------------------------------------------------------------------------- checkpoint


def test_the_big_checkpoint_is_about_a_gigabyte() -> None:
    o = BIG_CHECKPOINT
    head_dim = o["hidden_size"] // o["heads"]
    per_layer = (
        o["hidden_size"] * (o["heads"] + 2 * o["kv_heads"]) * head_dim  # q, k, v
        + o["heads"] * head_dim * o["hidden_size"]  # o
        + 3 * o["hidden_size"] * o["intermediate_size"]  # gate, up, down
        + 2 * o["hidden_size"]  # norms
    )
    params = o["layers"] * per_layer + 2 * o["vocab_size"] * o["hidden_size"] + o["hidden_size"]
    assert o["arch"] == "llama" and o["dtype"] == "float32"
    assert 0.95e9 < 4 * params < 1.1e9
    assert head_dim in (32, 64, 128)  # one pagedkv's kernels and vLLM's CPU attention take


def test_checkpoint_is_generated_once_then_reused(tmp_path: Path, tiny_options: dict) -> None:
    target = tmp_path / "models" / "big"
    options = {"arch": "llama", **tiny_options}
    assert ensure_checkpoint(target, options) == target
    assert (target / "model.safetensors").is_file()
    stamp = (target / "model.safetensors").stat().st_mtime_ns
    assert ensure_checkpoint(target, options) == target
    assert (target / "model.safetensors").stat().st_mtime_ns == stamp


def test_an_unwritable_or_foreign_checkpoint_directory_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    result = _invoke("--quick", "--startup-model", str(blocker / "model"), "--vllm-python", sys.executable)
    assert result.exit_code == 1
    assert f"cannot write the startup checkpoint into {blocker / 'model'}" in result.output
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    result = _invoke("--quick", "--startup-model", str(foreign), "--vllm-python", sys.executable)
    assert result.exit_code == 1
    assert "neither a complete checkpoint nor empty" in result.output
    assert (foreign / "notes.txt").read_text() == "mine"


def test_missing_vllm_environment_is_a_clear_error(tmp_path: Path) -> None:
    result = _invoke("--quick", "--vllm-python", str(tmp_path / "nowhere" / "python"))
    assert result.exit_code == 1
    assert "no vLLM environment" in result.output and "make peer-env" in result.output


# -------------------------------------------------------------------------------------------- server timing


def _measure_fake_server(tmp_path: Path, model: Path, **env: str):
    """`measure_server` on the fake vLLM's `serve`, with these environment variables for it."""
    port = free_port()
    return measure_server(
        [sys.executable, str(FAKE_DRIVER), "serve", str(model), "--port", str(port)],
        {**os.environ, **env},
        f"http://127.0.0.1:{port}/health",
        lambda response: response.status_code == 200,
        tmp_path / "serve.log",
        PeerFailed,
    )


def test_a_server_is_timed_to_healthy_and_stopped(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    launch = _measure_fake_server(tmp_path, tiny_models["llama"], FAKE_PEER_SERVE_DELAY="0.5")
    assert 0.5 <= launch.seconds < 30
    assert launch.detail["stopped_cleanly"] is True and launch.detail["exit"] == 0


def test_a_server_that_exits_first_is_reported(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    with pytest.raises(PeerFailed, match=r"(?s)exited \(3\) before .*asked to fail"):
        _measure_fake_server(tmp_path, tiny_models["llama"], FAKE_PEER_FAIL="serve")


# --------------------------------------------------------------------------------------- the whole command


def test_quick_startup_against_a_fake_peer(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    big = tmp_path / "startup-model"
    result = _invoke(
        "--quick",
        "--model",
        str(tiny_models["llama"]),
        "--startup-model",
        str(big),
        "--kv-cache-memory",
        "4MiB",
        "--vllm-python",
        sys.executable,
        "--vllm-driver",
        str(FAKE_DRIVER),
        env={"FAKE_PEER_LOAD": "config", "FAKE_PEER_LOAD_S": "0.05"},
    )
    assert result.exit_code == 0, result.output
    assert "generating the startup checkpoint" in result.stderr and (big / "model.safetensors").is_file()
    assert "round 0 (cold)" in result.stderr  # progress on stderr
    assert "pagedkv ÷ best vLLM" in result.stdout
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    startup = figures["startup"]
    cases = startup["cases"]
    assert set(cases) == set(CASES)
    for name, key in (("default", "ratio_default_model"), ("1gb", "ratio_1gb"), ("serve", "ratio_serve")):
        case = cases[name]
        assert set(case["medians_s"]) == set(SYSTEMS) and not case["errors"]
        best = case["best_vllm"]
        assert figures[key] == pytest.approx(case["medians_s"]["pagedkv"] / case["medians_s"][best], rel=1e-2)
        assert figures[key] == case["ratio"] > 0
    assert figures["serve_to_healthy_s"] == cases["serve"]["medians_s"]["pagedkv"] > 0
    assert set(figures["vllm_serve_to_healthy_s"]) == {"vllm-compiled", "vllm-eager"}

    runs = startup["runs"]
    assert [(r["round"], r["case"], r["system"]) for r in runs] == startup_schedule(CASES, SYSTEMS, 1)
    by = {(r["round"], r["case"], r["system"]): r for r in runs}
    for case in ("default", "1gb"):
        paged = by[(1, case, "pagedkv")]
        detail = paged["detail"]
        assert detail["model_s"] + detail["kv_cache_s"] + detail["register_s"] == pytest.approx(
            paged["seconds"], abs=2e-3
        )
        assert paged["launch_s"] > paged["seconds"] and detail["num_blocks"] > 0
        # vLLM: a cache root of its own per case and setting; round 0 finds it empty (cold), round 1 finds what
        # the compiled start wrote (warm).
        for system in ("vllm-compiled", "vllm-eager"):
            cold, warm = by[(0, case, system)]["detail"], by[(1, case, system)]["detail"]
            assert cold["cache_root"] == warm["cache_root"] and cold["cache_root"].endswith(f"{case}-{system}")
            assert cold["cache_files_before"] == 0
        assert by[(1, case, "vllm-compiled")]["detail"]["cache_files_before"] > 0
        assert by[(1, case, "vllm-compiled")]["seconds"] >= 0.05
    models = startup["models"]
    assert models["1gb"]["dir"] == str(big.resolve()) and models["default"]["dir"] == str(tiny_models["llama"])
    # pagedkv serve: launched, healthy, stopped cleanly; blockd and the executor said they were ready before.
    for round_ in (0, 1):
        serve = by[(round_, "serve", "pagedkv")]
        assert serve["detail"]["stopped_cleanly"] is True and serve["detail"]["exit"] == 0
        assert 0 < serve["detail"]["blockd_ready_s"] < serve["seconds"]
        assert 0 < serve["detail"]["executor-0_ready_s"] < serve["seconds"]
        assert by[(round_, "serve", "vllm-eager")]["detail"]["stopped_cleanly"] is True
    assert figures["logs"] is None  # removed: nothing failed


def test_a_failing_vllm_load_is_reported_and_the_rest_still_runs(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """Every vLLM load fails here (FAKE_PEER_FAIL=load); pagedkv and the vLLM servers still run once each."""
    result = _invoke(
        "--quick",
        "--runs",
        "1",
        "--model",
        str(tiny_models["llama"]),
        "--startup-model",
        str(tiny_models["llama"]),
        "--kv-cache-memory",
        "4MiB",
        "--vllm-python",
        sys.executable,
        "--vllm-driver",
        str(FAKE_DRIVER),
        env={"FAKE_PEER_FAIL": "load"},
    )
    assert result.exit_code == 1
    assert "vLLM failed to start in 1gb/vLLM compiled, 1gb/vLLM eager, default/vLLM compiled" in result.output
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["ratio_default_model"] is None and figures["ratio_1gb"] is None
    assert figures["ratio_serve"] > 0
    errors = figures["startup"]["cases"]["default"]["errors"]
    assert set(errors) == {"vllm-compiled", "vllm-eager"} and "asked to fail" in errors["vllm-eager"]
    failed = [r for r in figures["startup"]["runs"] if r["error"]]
    assert len(failed) == 4 and all(r["round"] == 0 for r in failed)  # tried once each, then skipped
    assert figures["logs"] and Path(figures["logs"]).is_dir()  # kept, for the failures' logs
    shutil.rmtree(figures["logs"])
