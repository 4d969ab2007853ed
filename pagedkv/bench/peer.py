"""`pagedkv bench peer`: pagedkv's engine against vLLM's offline `LLM.generate`, same model, requests and limits.

This module is the command; the pieces: `peer_workloads` (the workloads), `peer_systems` (both systems, the vLLM
driver's environment, the setup checks, the machine's load), `peer_rounds` (the alternated runs, pausing, the
busy neighbour), `peer_equality` (token equality and near ties), `peer_report` (tables, plot, JSON figures);
`--serve` is `peer_serve`, `--startup` is `peer_startup`. The method: docs/benchmarks.md ("pagedkv vs vLLM").
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from common.clicks import unless_given
from pagedkv.bench.common import blockd_process, threads_option
from pagedkv.bench.peer_equality import DEFAULT_TIE_TOLERANCE, equality
from pagedkv.bench.peer_report import WorkloadReport, plot_runs, report_lines, workloads_json
from pagedkv.bench.peer_rounds import RunRecord, medians, ratio_against_best, run_rounds
from pagedkv.bench.peer_serve import pagedkv_env, run_serve_bench
from pagedkv.bench.peer_startup import StartupConfig, run_startup
from pagedkv.bench.peer_systems import (
    DRIVER,
    PEER_PYTHON,
    PagedSystem,
    System,
    VllmSystem,
    check_setup,
    driver_env,
)
from pagedkv.bench.peer_workloads import QUICK_WORKLOADS, WORKLOADS, build_workload
from pagedkv.bench.shapes import DEFAULT_SHAPE, SHAPES, ensure_shape
from pagedkv.bench.throughput import bench_model, build_engine, special_ids

DEFAULT_KV = "1GiB"
DEFAULT_RUNS = 3


@click.command(
    "peer",
    help=f"""pagedkv against vLLM on this machine: the same requests to pagedkv's engine (a real blockd) and to
    vLLM's offline LLM.generate, run in vLLM's own virtual environment by path (--vllm-python; `make peer-env`
    builds .venv-peer).

    Workloads (seeded; greedy, ignore_eos, exactly each request's output length):
    default = {WORKLOADS["default"].describe()};
    long = {WORKLOADS["long"].describe()};
    prefix = {WORKLOADS["prefix"].describe()} (prefix caching on in both).
    Same model (vLLM loads the same directory), the same KV memory, max_num_seqs and max_num_batched_tokens.

    Model: --model DIR, or --model-shape, a random Llama generated once (progress on stderr) and cached under
    $PAGEDKV_HOME/models/bench by its spec:
    {"; ".join(shape.describe() for shape in SHAPES.values())}.
    Every workload runs on the chosen model; --serve takes the same.

    Each system gets an untimed warm-up, then --runs rounds alternate the systems (pagedkv, vLLM with its default
    threads, vLLM with VLLM_CPU_OMP_THREADS_BIND=--bind-cpus, ...), each timed over generation only. Reported:
    every run with the load average before it and the CPU seconds per token of its process tree; the median
    tok/s of each; the ratio pagedkv ÷ the faster vLLM setting; token equality of the outputs, with each
    divergence checked for a near tie against transformers' logits. Progress on stderr; the last line of stdout
    is one JSON object (ratio_default, ratio_long, ratio_prefix: null where not run).

    All systems stay loaded for the whole bench; during each timed run the others' processes are paused
    (SIGSTOP, then SIGCONT; --no-pause-idle keeps them running): an idle vLLM's engine core polls, taking about
    a tenth of a core, which slows whichever system is being timed.

    --noisy-neighbour: after each workload's rounds, the same rounds again with another process saturating a
    core beside each run (a bounded busy loop the bench starts just before and stops after it); reported: each
    system's median with the neighbour and its fall from the quiet median, and whether pagedkv falls by no more
    than the vLLM setting the ratio is taken against (JSON: noisy_ok_default, ...).

    --quick: tiny workloads and one round, for tests; the figures mean nothing.

    --serve: serving instead, side by side: `vllm serve` and `pagedkv serve` (one executor) in turn, never both at
    once, with the same model, KV memory, max_num_seqs and max_num_batched_tokens (vLLM bound to --bind-cpus
    unless --vllm-threads default), each driven by vLLM's own client, `vllm bench serve --backend openai-chat`:
    random prompts of 256 tokens, 64 output tokens (ignore_eos), --serve-prompts per load, seeded; loads
    concurrent16 (16 in flight) and rate4 (Poisson, 4 req/s). Reported per load: both systems' output tok/s,
    TTFT and TPOT, and pagedkv ÷ vLLM of each (aim: tok/s >= 1, TTFT and TPOT p50 <= 1); the last line of stdout
    is one JSON object (serve_ratios). With --quick: 16 prompts of 32 tokens, 8 output tokens.

    --startup measures startup instead (see pagedkv/bench/peer_startup.py): loading the default model and a ~1 GB
    checkpoint (generated once, or --startup-model) in pagedkv against vLLM's LLM(...) construction, compiled and
    enforce_eager, cold (fresh vLLM caches) then warm; and `pagedkv serve` against `vllm serve` until /health is
    healthy. Each start is a new process; --runs warm rounds, medians; the last line of stdout is one JSON object
    (ratio_default_model, ratio_1gb, ratio_serve: pagedkv seconds ÷ the faster vLLM setting's, below 1.0 is
    faster; serve_to_healthy_s). With --quick: a tiny checkpoint instead of 1 GB.""",
)
@click.option("--startup", is_flag=True, help="Measure startup (load and serve-to-healthy times) instead.")
@click.option(
    "--startup-model",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="--startup's ~1 GB checkpoint: used if this directory holds one, generated into it otherwise "
    "(default: under $PAGEDKV_HOME/models/bench).",
)
@click.option(
    "--workload",
    "workloads",
    type=click.Choice([*WORKLOADS, "all"]),
    multiple=True,
    default=("all",),
    show_default=True,
    help="Which workloads to run (repeatable).",
)
@click.option("--runs", type=click.IntRange(min=1), default=DEFAULT_RUNS, show_default=True, help="Rounds.")
@click.option("--quick", is_flag=True, help="Tiny workloads and one round, for tests.")
@click.option(
    "--noisy-neighbour",
    is_flag=True,
    help="Also run every round with a core-saturating busy loop beside it, and report each system's fall.",
)
@click.option(
    "--pause-idle/--no-pause-idle",
    default=True,
    show_default=True,
    help="Pause (SIGSTOP) the other systems' processes during each timed run: a loaded, idle vLLM polls.",
)
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write a PNG of tok/s per run for both systems here (needs matplotlib).",
)
@click.option(
    "--vllm-python",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help=f"The vLLM environment's interpreter (default: {PEER_PYTHON}, in the current directory or the repository).",
)
@click.option(
    "--vllm-driver",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=DRIVER,
    show_default="peer_driver.py beside this module",
    help="The script --vllm-python runs (tests give a fake).",
)
@click.option(
    "--vllm-threads",
    type=click.Choice(["both", "default", "bind"]),
    default="both",
    show_default=True,
    help="vLLM's thread settings to run: its default, VLLM_CPU_OMP_THREADS_BIND=--bind-cpus, or both.",
)
@click.option(
    "--bind-cpus",
    default=f"0-{(os.cpu_count() or 1) - 1}",
    show_default=True,
    help="VLLM_CPU_OMP_THREADS_BIND of the bound setting.",
)
@click.option("--vllm-eager", is_flag=True, help="vLLM without torch.compile (enforce_eager).")
@click.option(
    "--model",
    "model_dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="Checkpoint directory (default: the generated default llama).",
)
@click.option(
    "--model-shape",
    type=click.Choice(list(SHAPES)),
    default=None,
    help=f"A generated model of this shape instead of --model (default: {DEFAULT_SHAPE}, the default model; "
    "see above).",
)
@click.option("--kv-cache-memory", default=DEFAULT_KV, show_default=True, help="KV memory of each system.")
@click.option("--block-size", type=click.IntRange(min=1), default=16, show_default=True, help="pagedkv's block size.")
@click.option("--max-num-seqs", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--max-num-batched-tokens", type=click.IntRange(min=1), default=2048, show_default=True)
@click.option(
    "--tie-tolerance",
    type=click.FloatRange(min=0),
    default=DEFAULT_TIE_TOLERANCE,
    show_default=True,
    help="Largest gap between transformers' top two logits that makes a divergence a near tie.",
)
@threads_option("pagedkv's torch intra-op threads (default: torch's own choice, one per core).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the workloads.")
@click.option(
    "--serve",
    is_flag=True,
    help="Serving instead: `vllm serve` and `pagedkv serve` in turn, driven by `vllm bench serve` (see below).",
)
@click.option(
    "--serve-prompts",
    type=click.IntRange(min=1),
    default=None,
    help="--serve: prompts per load (default 200; --quick: 16).",
)
@click.option(
    "--serve-load",
    "serve_loads",
    type=click.Choice(["concurrent16", "rate4", "all"]),
    multiple=True,
    default=("all",),
    show_default=True,
    help="--serve: which loads to run (repeatable).",
)
@click.option(
    "--serve-pagedkv-env",
    "serve_pagedkv_env",
    multiple=True,
    metavar="NAME=VALUE",
    help="--serve: an environment variable for `pagedkv serve` (repeatable), which is how its services take "
    "options it has no flags for: PAGEDKV_EXECUTOR_MAX_STEP_MS=0, PAGEDKV_GATEWAY_EXECUTOR_TIMEOUT=1, ...",
)
@click.option(
    "--vllm-cli",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=Path(__file__).with_name("vllm_cli.py"),
    show_default="vllm_cli.py beside this module",
    help="--serve: the script --vllm-python runs as vLLM's command line (tests give a fake).",
)
@click.pass_context
def bench_peer(
    ctx: click.Context,
    startup: bool,
    startup_model: Path | None,
    workloads: tuple[str, ...],
    runs: int,
    quick: bool,
    noisy_neighbour: bool,
    pause_idle: bool,
    plot_path: Path | None,
    vllm_python: Path | None,
    vllm_driver: Path,
    vllm_threads: str,
    bind_cpus: str,
    vllm_eager: bool,
    model_dir: Path | None,
    model_shape: str | None,
    kv_cache_memory: str,
    block_size: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    tie_tolerance: float,
    threads: int | None,
    seed: int,
    serve: bool,
    serve_prompts: int | None,
    serve_loads: tuple[str, ...],
    serve_pagedkv_env: tuple[str, ...],
    vllm_cli: Path,
) -> None:
    if model_shape is not None:
        if model_dir is not None:
            raise click.UsageError("give --model or --model-shape, not both")
        if startup:
            raise click.UsageError("--model-shape is for the offline and --serve benches; --startup has --model")
        check_setup(max_num_seqs, max_num_batched_tokens, kv_cache_memory, vllm_python)  # before generating
        model_dir = ensure_shape(model_shape)
    if serve:
        run_serve_bench(
            loads=serve_loads,
            prompts=serve_prompts,
            quick=quick,
            vllm_python=vllm_python,
            vllm_cli=vllm_cli,
            vllm_threads=str(unless_given(ctx, vllm_threads, "vllm_threads", "bind")),
            bind_cpus=bind_cpus,
            vllm_eager=vllm_eager,
            model_dir=model_dir,
            kv_cache_memory=kv_cache_memory,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            threads=threads,
            seed=seed,
            pagedkv_env=pagedkv_env(serve_pagedkv_env),
        )
        return
    if quick:
        runs = unless_given(ctx, runs, "runs", 1)
    if startup:
        run_startup(StartupConfig.from_params({**ctx.params, "runs": runs}))
        return
    # torch (and the executor's runner, which imports it) only for an offline run: --help, --serve and --startup
    # need neither.
    import torch

    from executor.runner import kv_bytes_per_block

    echo = click.echo
    specs = QUICK_WORKLOADS if quick else WORKLOADS
    names = list(specs) if "all" in workloads else list(dict.fromkeys(workloads))
    budget, python = check_setup(max_num_seqs, max_num_batched_tokens, kv_cache_memory, vllm_python)
    if threads is not None:
        torch.set_num_threads(threads)
    pagedkv_threads = torch.get_num_threads()
    settings: list[tuple[str, str | None]] = []
    if vllm_threads in ("both", "default"):
        settings.append(("vllm-default", None))
    if vllm_threads in ("both", "bind"):
        settings.append(("vllm-bind", bind_cpus))
    labels = {"pagedkv": "pagedkv", "vllm-default": "vLLM default threads", "vllm-bind": f"vLLM bind {bind_cpus}"}

    model_dir, config = bench_model(model_dir)
    special = special_ids(model_dir, config)
    plans = {name: build_workload(specs[name], config.vocab_size, special, seed) for name in names}
    max_len = max(len(r.prompt) + r.output_len for reqs in plans.values() for r in reqs)
    if max_len > config.max_model_len:
        raise click.ClickException(
            f"the workloads need {max_len} tokens a sequence; the model holds {config.max_model_len}"
        )
    per_block = kv_bytes_per_block(config, block_size, torch.float32)
    num_blocks = budget // per_block
    if (num_blocks - max(1, num_blocks // 100)) * block_size < max_len:
        raise click.BadParameter(
            f"{budget:,} bytes hold no sequence of {max_len} tokens", param_hint="'--kv-cache-memory'"
        )

    echo(
        f"model:    {model_dir} ({config.architecture}, {config.num_layers} layers, hidden {config.hidden_size}, "
        f"{config.num_heads} heads / {config.num_kv_heads} KV heads of {config.head_dim}, vocab {config.vocab_size}"
        f"{f'; shape {model_shape}' if model_shape else ''}); cpu, float32; pagedkv: {pagedkv_threads} torch threads, "
        f"{num_blocks:,} blocks of {block_size}; {os.cpu_count()} cores"
    )
    echo(
        f"limits:   KV {budget / 2**30:.3g} GiB each, max_num_seqs {max_num_seqs}, max_num_batched_tokens "
        f"{max_num_batched_tokens}, longest sequence {max_len}; vLLM: {python}"
        + (", enforce_eager" if vllm_eager else "")
    )

    reports: dict[str, WorkloadReport] = {}
    vllm_info: dict[str, dict[str, Any]] = {}
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pagedkv-bench-peer-")))
        endpoint, blockd = stack.enter_context(
            blockd_process(tmp / "blockd.log", "--no-persistence", "--lease-timeout", "3600")
        )
        click.echo(f"starting vLLM ({', '.join(labels[n] for n, _ in settings)}) and loading pagedkv", err=True)
        peers: list[VllmSystem] = []
        for name, bind in settings:
            peer = VllmSystem(name, python, vllm_driver, driver_env(bind), tmp / f"{name}.log", tmp)
            stack.callback(peer.close)
            peers.append(peer)
        load_msg = {
            "op": "load",
            "model": str(Path(model_dir).resolve()),
            "dtype": "float32",
            "kv_cache_bytes": budget,
            "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens,
            "max_model_len": max_len,
            "enable_prefix_caching": True,
            "enforce_eager": vllm_eager,
            "seed": 0,
        }
        for peer in peers:  # both load at once; nothing is timed yet
            peer.send(load_msg)
        engine = build_engine(
            model_dir,
            endpoint,
            device=torch.device("cpu"),
            dtype=torch.float32,
            num_blocks=num_blocks,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
        )
        stack.callback(_quietly, engine.pool.client.close)
        stack.callback(_quietly, engine.pool.unregister)
        for peer in peers:
            peer.info = peer.receive()
            vllm_info[peer.name] = {k: v for k, v in peer.info.items() if k != "ok"}
            info = peer.info
            click.echo(
                f"  {labels[peer.name]}: vLLM {info.get('vllm')} (torch {info.get('torch')}) loaded in "
                f"{info.get('load_s', 0):.1f} s; blocks of {info.get('block_size')}, compilation "
                f"{info.get('compilation')}, VLLM_CPU_OMP_THREADS_BIND={info.get('threads_bind')}",
                err=True,
            )
        systems: list[System] = [PagedSystem(engine, blockd.pid), *peers]

        for name in names:
            spec, requests = specs[name], plans[name]
            total = sum(r.output_len for r in requests)
            click.echo(f"[{name}] {spec.describe()}; {total:,} output tokens; warm-up, then {runs} rounds", err=True)

            def progress(record: RunRecord, name: str = name) -> None:
                where = f"{name}, busy neighbour" if record.neighbour else name
                click.echo(
                    f"  [{where}] run {record.round} {labels[record.system]:>22}: {record.output_tokens:,} tokens in "
                    f"{record.seconds:.2f} s = {record.tok_s:,.1f} tok/s (load before "
                    f"{' '.join(f'{x:.2f}' for x in record.load_before)})",
                    err=True,
                )

            records, outputs = run_rounds(name, requests, systems, runs, progress, pause_idle=pause_idle)
            report = WorkloadReport(spec, records, medians(records))
            report.ratio, report.best_vllm = ratio_against_best(report.medians)
            report.equality = equality(requests, outputs, model_dir, tie_tolerance, labels)
            if noisy_neighbour:
                click.echo(f"[{name}] again, each run with a busy-loop neighbour on one core", err=True)
                report.noisy_records, _ = run_rounds(
                    name, requests, systems, runs, progress, warm_up=False, neighbour=True, pause_idle=pause_idle
                )
                report.noisy_medians = medians(report.noisy_records)
            reports[name] = report

    plot_note = None
    if plot_path is not None:
        plot_note = plot_runs(
            plot_path, [r for rep in reports.values() for r in (*rep.records, *rep.noisy_records)], labels
        )
        click.echo(f"plot: {plot_path}" if plot_note is None else f"no plot: {plot_note}", err=True)

    for line in report_lines(
        reports,
        labels,
        [n for n, _ in settings],
        runs=runs,
        pause_idle=pause_idle,
        quick=quick,
        noisy_neighbour=noisy_neighbour,
    ):
        echo(line)
    echo(
        json.dumps(
            {
                **workloads_json(reports, noisy_neighbour=noisy_neighbour),
                "vllm": vllm_info,
                "vllm_python": str(python),
                "model": str(model_dir),
                "model_shape": model_shape,
                "kv_cache_bytes": budget,
                "block_size": block_size,
                "num_blocks": num_blocks,
                "max_num_seqs": max_num_seqs,
                "max_num_batched_tokens": max_num_batched_tokens,
                "pagedkv_threads": pagedkv_threads,  # as configured: the thread governor may have changed it since
                "runs": runs,
                "pause_idle": pause_idle,
                "seed": seed,
                "tie_tolerance": tie_tolerance,
                "plot": None if plot_path is None or plot_note else str(plot_path),
                "cpu_count": os.cpu_count(),
                "quick": quick,
            }
        )
    )


def _quietly(fn: Callable[[], object]) -> None:
    with contextlib.suppress(Exception):
        fn()
