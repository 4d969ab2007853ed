"""`pagedkv bench speculative`: the engine with and without `--speculative-config` on a repetitive workload.

The workload and its model are pagedkv.bench.spec_workload's (a generated model whose greedy text repeats, and
prompts holding the document the output repeats: an extraction). Each concurrency (1 and 8 by default) runs the
same requests through a plain engine and a speculating one, alternately, after a warm-up of each; greedy outputs
must be equal token for token. The last stdout line is one JSON object; progress goes to stderr.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import click

from executor.params import SamplingParams
from executor.speculative import SpeculativeConfig, SpeculativeConfigError
from pagedkv.bench.common import table_lines, threads_option
from pagedkv.bench.spec_workload import documents, repeat_prompt, write_repeating_model

DEFAULT_SPEC = '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 1}'


def _greedy(engine: Any, prompts: list[list[int]], max_tokens: int, salt: str) -> tuple[list[list[int]], float]:
    """Every prompt's greedy continuation (all submitted at once; max_num_seqs bounds the concurrency), and the
    seconds the engine took."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outputs: dict[str, list[int]] = {}
    started = time.perf_counter()
    for i, prompt in enumerate(prompts):
        outputs[f"{salt}-{i}"] = []
        engine.add_request(f"{salt}-{i}", prompt, params, cache_salt=salt)
    while engine.has_work():
        for delta in engine.step():
            outputs[delta.request_id] += delta.token_ids
    return [outputs[f"{salt}-{i}"] for i in range(len(prompts))], time.perf_counter() - started


def _vllm_runs(
    model_dir: Path, prompts: list[list[int]], output_tokens: int, level: int, spec_text: str, rounds: int
) -> dict[str, Any]:
    """vLLM's LLM on the same prompts (greedy, ignore_eos), without and with the same speculative config: the
    best of `rounds` timed runs each (after a warm-up), tok/s and outputs."""
    import tempfile

    from pagedkv.bench.peer_systems import VllmSystem, default_vllm_python, driver_env

    python = default_vllm_python()
    if not python.exists():
        raise click.UsageError(f"--vllm: no vLLM environment at {python} (`make peer-env`)")
    driver = Path(__file__).with_name("peer_driver.py")
    out: dict[str, Any] = {}
    requests = [{"id": f"r{i}", "prompt": p, "output_len": output_tokens} for i, p in enumerate(prompts)]
    for name, config in (("plain", None), ("spec", json.loads(spec_text))):
        with tempfile.TemporaryDirectory(prefix="bench-spec-vllm-") as tmp:
            system = VllmSystem(f"vllm-{name}", python, driver, driver_env(None), Path(tmp) / "driver.log", Path(tmp))
            try:
                system.call(
                    {
                        "op": "load",
                        "model": str(model_dir),
                        "dtype": "float32",
                        "kv_cache_bytes": 256 * 2**20,
                        "max_num_seqs": level,
                        "max_num_batched_tokens": max(512, level),
                        "max_model_len": max(len(p) for p in prompts) + output_tokens + 16,
                        "speculative_config": config,
                    }
                )
                system.call({"op": "generate", "requests": requests[:level], "reset_prefix_cache": True})
                best = float("inf")
                for r in range(rounds):
                    reply = system.call({"op": "generate", "requests": requests, "reset_prefix_cache": True})
                    best = min(best, reply["seconds"])
                    click.echo(f"concurrency {level} round {r + 1}: vllm {name} {reply['seconds']:.2f} s", err=True)
                out[f"{name}_tok_s"] = round(len(prompts) * output_tokens / best, 1)
                out[f"{name}_outputs"] = [reply["outputs"][f"r{i}"] for i in range(len(prompts))]
            finally:
                system.close()
    return out


@click.command(
    "speculative",
    help="""Single-stream and concurrent decode tok/s with and without speculative decoding, on prompts that
    hold the text the output repeats (an extraction), with a generated model whose greedy text repeats
    (pagedkv/bench/spec_workload.py). Greedy outputs are checked equal. The last stdout line is one JSON
    object.""",
)
@click.option(
    "--model",
    "model_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="A checkpoint to run instead of the generated repeating model (cached under --cache-dir).",
)
@click.option(
    "--cache-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("~/.cache/pagedkv/bench-speculative").expanduser(),
    show_default=True,
    help="Where the generated repeating model is kept.",
)
@click.option(
    "--speculative-config",
    "spec_text",
    default=DEFAULT_SPEC,
    show_default=True,
    help="The speculating engine's --speculative-config.",
)
@click.option("--concurrency", default="1,8", show_default=True, help="Comma-separated concurrent requests.")
@click.option(
    "--requests",
    "num_requests",
    type=click.IntRange(min=1),
    default=8,
    show_default=True,
    help="Requests per run (at least the concurrency).",
)
@click.option(
    "--document-tokens",
    type=click.IntRange(min=16),
    default=256,
    show_default=True,
    help="Length of each prompt's document.",
)
@click.option(
    "--output-tokens", type=click.IntRange(min=1), default=192, show_default=True, help="Tokens generated per request."
)
@click.option(
    "--rounds",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="Timed runs of each engine per concurrency (alternated; the best counts).",
)
@threads_option("torch intra-op threads.")
@click.option(
    "--vllm",
    "with_vllm",
    is_flag=True,
    help="Also run vLLM (its CPU build in .venv-peer, `make peer-env`) on the same prompts, with and "
    "without the same --speculative-config.",
)
@click.option("--quick", is_flag=True, help="A tiny run for tests: 2 requests at concurrency 1 and 2, short texts.")
def bench_speculative(
    model_dir: Path | None,
    cache_dir: Path,
    spec_text: str,
    concurrency: str,
    num_requests: int,
    document_tokens: int,
    output_tokens: int,
    rounds: int,
    threads: int | None,
    with_vllm: bool,
    quick: bool,
) -> None:
    import torch

    from pagedkv.bench.throughput import build_engine

    try:
        spec = SpeculativeConfig.parse(spec_text)
    except SpeculativeConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="--speculative-config") from None
    if quick:
        concurrency, num_requests, document_tokens, output_tokens, rounds = "1,2", 2, 48, 24, 1
    levels = [int(c) for c in concurrency.split(",")]
    if threads is not None:
        torch.set_num_threads(threads)
    if model_dir is None:
        model_dir = write_repeating_model(cache_dir / "repeating-default")
    block_size = 16
    per_seq = -(-(document_tokens + 8 + output_tokens + block_size * 2) // block_size)
    results = []
    for level in levels:
        common = dict(
            device=torch.device("cpu"),
            dtype=None,
            num_blocks=per_seq * max(level, 1) + 16,
            block_size=block_size,
            max_num_seqs=level,
            max_num_batched_tokens=max(512, level),
        )
        plain = build_engine(model_dir, None, **common)
        spec_engine = build_engine(model_dir, None, **common, speculative=spec)
        vocab = plain.config.vocab_size
        count = max(num_requests, level)

        def greedy(starts: list[list[int]], n: int, engine: Any = plain) -> list[list[int]]:
            return _greedy(engine, starts, n, "doc")[0]

        prompts = [repeat_prompt(d) for d in documents(count, document_tokens, vocab, seed=level, greedy=greedy)]
        _greedy(plain, prompts[:level], 8, "warm")
        _greedy(spec_engine, prompts[:level], 8, "warm")
        best = {"plain": float("inf"), "spec": float("inf")}
        outputs: dict[str, list[list[int]]] = {}
        stats = spec_engine.speculator.stats
        proposed0, accepted0, steps0 = stats.proposed_tokens, stats.accepted_tokens, spec_engine.steps
        plain_steps0 = plain.steps
        for r in range(rounds):
            for name, engine in (("plain", plain), ("spec", spec_engine)):
                out, seconds = _greedy(engine, prompts, output_tokens, f"{name}-{r}")
                best[name] = min(best[name], seconds)
                outputs[name] = out
                click.echo(f"concurrency {level} round {r + 1}: {name} {seconds:.2f} s", err=True)
        equal = outputs["plain"] == outputs["spec"]
        tokens = count * output_tokens
        proposed, accepted = stats.proposed_tokens - proposed0, stats.accepted_tokens - accepted0
        vllm = _vllm_runs(model_dir, prompts, output_tokens, level, spec_text, rounds) if with_vllm else {}
        if vllm:
            vllm["plain_equal"] = vllm.pop("plain_outputs") == outputs["plain"]
            vllm["spec_equal"] = vllm.pop("spec_outputs") == outputs["plain"]
        results.append(
            {
                "concurrency": level,
                **({"vllm": vllm} if vllm else {}),
                "requests": count,
                "output_tokens": tokens,
                "plain_tok_s": round(tokens / best["plain"], 1),
                "spec_tok_s": round(tokens / best["spec"], 1),
                "speedup": round(best["plain"] / best["spec"], 3),
                "acceptance_rate": round(accepted / proposed, 3) if proposed else 0.0,
                "tokens_per_step": round(tokens * rounds / max(spec_engine.steps - steps0, 1), 2),
                "plain_steps": (plain.steps - plain_steps0) // rounds,
                "greedy_equal": equal,
            }
        )
    header = ["concurrency", "plain tok/s", "spec tok/s", "speedup", "acceptance", "tokens/step", "greedy equal"]
    rows = [
        [
            str(r["concurrency"]),
            f"{r['plain_tok_s']:.1f}",
            f"{r['spec_tok_s']:.1f}",
            f"{r['speedup']:.2f}x",
            f"{r['acceptance_rate']:.2f}",
            f"{r['tokens_per_step']:.2f}",
            "yes" if r["greedy_equal"] else "NO",
        ]
        for r in results
    ]
    click.echo(f"model {model_dir}, --speculative-config {spec_text}")
    for line in table_lines(header, rows):
        click.echo(line)
    if with_vllm:
        vheader = ["concurrency", "vLLM tok/s", "vLLM spec tok/s", "vLLM speedup", "pagedkv spec / vLLM spec", "equal"]
        vrows = [
            [
                str(r["concurrency"]),
                f"{r['vllm']['plain_tok_s']:.1f}",
                f"{r['vllm']['spec_tok_s']:.1f}",
                f"{r['vllm']['plain_tok_s'] and r['vllm']['spec_tok_s'] / r['vllm']['plain_tok_s']:.2f}x",
                f"{r['spec_tok_s'] / r['vllm']['spec_tok_s']:.2f}",
                "yes" if r["vllm"]["plain_equal"] and r["vllm"]["spec_equal"] else "NO",
            ]
            for r in results
        ]
        for line in table_lines(vheader, vrows):
            click.echo(line)
    click.echo(json.dumps({"model": str(model_dir), "speculative_config": json.loads(spec_text), "runs": results}))
    if not all(r["greedy_equal"] for r in results):
        raise SystemExit("greedy outputs differ with speculation")
