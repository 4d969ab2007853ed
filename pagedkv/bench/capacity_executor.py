"""`pagedkv bench capacity --executor`: the real executor on a Gemma-3-shaped tiny model (5 sliding layers per
global one), its KV in layer groups against every layer allocated in full, in the same bytes.

Both runs take the same requests (prompts several windows long, all arriving at once) through the engine with an
in-process blockd; it reports the sequences running at once and the blocks in use, and checks that both produce
the same greedy tokens (the layout changes where KV lives, never what is computed).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The tiny model: 6 layers (5 sliding, 1 global), 2 KV heads of 32.
MODEL: dict[str, Any] = dict(
    arch="gemma3", hidden_size=64, layers=6, heads=2, kv_heads=2, head_dim=32, sliding_pattern=6, vocab_size=512,
    max_position=1024, dtype="float32", seed=0,
)  # fmt: skip


@dataclass
class ExecutorRun:
    name: str
    num_blocks: int
    max_running: int = 0
    mean_running: float = 0.0  # over the steps with requests waiting
    max_blocks_in_use: int = 0
    steps: int = 0
    preemptions: int = 0
    seconds: float = 0.0


def run_executor(
    model_dir: Path,
    *,
    grouped: bool,
    kv_bytes: int,
    block_size: int,
    prompts: list[list[int]],
    output_len: int,
    max_num_batched_tokens: int = 256,
) -> tuple[ExecutorRun, dict[str, list[int]]]:
    """One run: the engine with layer groups (or every layer in one group) in `kv_bytes` of KV cache."""
    import torch

    from blockd.client import PoolClient
    from blockd.inprocess import InProcessBlockd
    from executor.engine import Engine, EngineLimits
    from executor.layer_groups import layer_groups
    from executor.params import SamplingParams
    from executor.runner import ModelRunner, kv_bytes_per_block, load_model

    loaded = load_model(model_dir, torch.device("cpu"))
    layout = layer_groups(loaded.config, grouped=grouped)
    num_blocks = kv_bytes // kv_bytes_per_block(loaded.config, block_size, loaded.kv_dtype, layout)
    runner = ModelRunner(loaded, num_blocks=num_blocks, block_size=block_size, layout=layout)
    pool = PoolClient(
        InProcessBlockd(timeout_s=30.0),
        pool_id="bench-capacity-executor",
        num_blocks=num_blocks,
        block_size=block_size,
        model_id=loaded.pool_model_id,
        sliding_window=layout.window,
        groups=layout.pool_groups,
    )
    engine = Engine(runner, pool, EngineLimits(len(prompts), max_num_batched_tokens), seed=0, adapt_threads=False)
    pool.register()
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
        tokens[f"r{i}"] = []
    run = ExecutorRun("grouped-window" if grouped else "grouped-full", num_blocks)
    running: list[int] = []
    started = time.perf_counter()
    while engine.loop.has_work():
        for delta in engine.step():
            tokens[delta.request_id] += getattr(delta, "token_ids", [])
        scheduler = engine.scheduler
        run.max_running = max(run.max_running, len(scheduler.running))
        run.max_blocks_in_use = max(run.max_blocks_in_use, pool.blocks_in_use)
        if scheduler.waiting:
            running.append(len(scheduler.running))
    run.seconds = time.perf_counter() - started
    run.steps = engine.steps
    run.preemptions = engine.scheduler.num_preemptions
    run.mean_running = statistics.fmean(running) if running else float(run.max_running)
    if pool.blocks_in_use or pool.client.manager.check():  # type: ignore[attr-defined]
        raise RuntimeError(f"{run.name}: blocks left in use or blockd's invariants broken after the run")
    return run, tokens


def compare(
    *,
    window: int,
    requests: int,
    prompt_len: int,
    output_len: int,
    block_size: int,
    full_sequences: int,
    max_num_batched_tokens: int = 256,
) -> tuple[ExecutorRun, ExecutorRun]:
    """Both runs in the KV bytes that hold `full_sequences` sequences with every layer in full."""
    import torch

    from executor.checkpoint import load_config
    from pagedkv.tools.model_gen import write_model

    with tempfile.TemporaryDirectory(prefix="pagedkv-capacity-") as scratch:
        model_dir = write_model(Path(scratch) / "gemma3", quiet=True, **MODEL, sliding_window=window)
        config = load_config(model_dir)
        per_seq_blocks = -(-(prompt_len + output_len) // block_size) + 2  # (and the room reserved ahead)
        layer_block = 2 * block_size * config.num_kv_heads * config.head_dim * 4  # float32 K and V, one layer
        kv_bytes = full_sequences * per_seq_blocks * config.num_layers * layer_block
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, config.vocab_size, (prompt_len,), generator=g).tolist() for _ in range(requests)]
        common = dict(
            kv_bytes=kv_bytes,
            block_size=block_size,
            prompts=prompts,
            output_len=output_len,
            max_num_batched_tokens=max_num_batched_tokens,
        )
        full, full_tokens = run_executor(model_dir, grouped=False, **common)  # type: ignore[arg-type]
        hybrid, hybrid_tokens = run_executor(model_dir, grouped=True, **common)  # type: ignore[arg-type]
    if full_tokens != hybrid_tokens:
        raise RuntimeError("the grouped and the full layout produced different greedy tokens")
    return full, hybrid
