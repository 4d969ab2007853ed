"""The child `pagedkv bench peer --startup` times pagedkv's load in (`python -m pagedkv.bench.peer_load_child SPEC`):
one JSON reply on stdout, everything else to stderr. It imports nothing of pagedkv's at the top, so that the
process start the bench measures (launch_s) holds no import the load itself does not need."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
from typing import Any


def load(spec: dict[str, Any]) -> dict[str, Any]:
    """In the child: torch and the executor imported, then the timed part: the engine as `build_engine` builds
    it with a real blockd (model loaded, KV cache allocated, pool registered); unregistered again after."""
    started_imports = time.perf_counter()
    # Imported here, in the child, where their import is timed (imports_s) apart from the load.
    import torch

    from executor.engine import Engine, EngineLimits
    from executor.runner import kv_bytes_per_block, load_model

    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    imported = time.perf_counter()
    cpu0 = time.process_time()
    loaded = load_model(spec["model"], torch.device("cpu"), torch.float32)
    model_done = time.perf_counter()
    num_blocks = spec["kv_cache_bytes"] // kv_bytes_per_block(loaded.config, spec["block_size"], torch.float32)
    engine = Engine.assemble(
        loaded,
        spec["endpoint"],
        pool_id=spec["pool_id"],
        num_blocks=num_blocks,
        block_size=spec["block_size"],
        limits=EngineLimits(spec["max_num_seqs"], spec["max_num_batched_tokens"]),
        seed=0,
        timeout_s=10.0,
    )
    kv_done = time.perf_counter()
    engine.pool.register()
    done = time.perf_counter()
    cpu_s = time.process_time() - cpu0
    with contextlib.suppress(Exception):
        engine.pool.unregister()
    with contextlib.suppress(Exception):
        engine.pool.client.close()
    return {
        "ok": True,
        "load_s": done - imported,
        "model_s": model_done - imported,
        "kv_cache_s": kv_done - model_done,
        "register_s": done - kv_done,
        "imports_s": imported - started_imports,
        "cpu_s": cpu_s,
        "num_blocks": num_blocks,
        "parameters": sum(p.numel() for p in loaded.model.parameters()),
        "torch_threads": torch.get_num_threads(),
    }


def main(argv: list[str]) -> int:
    replies = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)  # anything printed goes to the log; the one reply to the original stdout
    try:
        reply = load(json.loads(argv[0]))
    except Exception as exc:
        traceback.print_exc()
        reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    replies.write(json.dumps(reply) + "\n")
    return 0 if reply.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
