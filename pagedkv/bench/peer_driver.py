"""The vLLM side of `pagedkv bench peer`: a small driver run by the vLLM environment's interpreter, by path.

    .venv-peer/bin/python pagedkv/bench/peer_driver.py          # JSON lines: load, generate, quit
    .venv-peer/bin/python pagedkv/bench/peer_driver.py serve ARGS...   # `vllm serve ARGS...`

It imports nothing of pagedkv and only the standard library at the top, so the bench may import its helpers
(`tree_cpu_seconds`, ...) without vLLM. Every reply has "ok"; a failed command answers {"ok": false, "error"}.
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import os
import sys
import time
import traceback
from typing import Any


def _stat_fields(pid: int | str) -> list[bytes] | None:
    """The fields of /proc/<pid>/stat after the command name (state first), or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: fields after it follow the last ")".
    return data[data.rindex(b")") + 2 :].split()


def process_state(pid: int) -> str | None:
    """The one-letter state of a process ("T" stopped, "S" sleeping, "R" running, "Z" zombie...), or None."""
    fields = _stat_fields(pid)
    return None if fields is None else fields[0].decode()


def _proc_stat(pid: int | str) -> tuple[int, int] | None:
    """(parent pid, CPU clock ticks of the process: its own user + system and its reaped children's), or None."""
    fields = _stat_fields(pid)
    if fields is None:
        return None
    ppid = int(fields[1])
    utime, stime, cutime, cstime = (int(x) for x in fields[11:15])
    return ppid, utime + stime + cutime + cstime


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process (all its threads, and its children that it has reaped)."""
    stat = _proc_stat(pid)
    return 0.0 if stat is None else stat[1] / os.sysconf("SC_CLK_TCK")


def _proc_table() -> tuple[dict[int, list[int]], dict[int, int]]:
    """(children of each pid, CPU ticks of each pid) of every live process (Linux /proc; empty elsewhere)."""
    parents: dict[int, int] = {}
    ticks: dict[int, int] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return {}, {}
    for entry in entries:
        if not entry.isdigit():
            continue
        stat = _proc_stat(entry)
        if stat is not None:
            parents[int(entry)], ticks[int(entry)] = stat
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    return children, ticks


def _tree(root: int, children: dict[int, list[int]]) -> list[int]:
    """`root` and its descendants in `children`, parents before children."""
    found, todo = [], [root]
    while todo:
        pid = todo.pop(0)
        found.append(pid)
        todo.extend(children.get(pid, ()))
    return found


def tree_pids(root: int) -> list[int]:
    """`root` and every live descendant, parents before children (Linux /proc; [root] elsewhere)."""
    return _tree(root, _proc_table()[0])


def tree_cpu_seconds(root: int) -> float:
    """User + system CPU seconds of `root` and every live descendant (Linux /proc; 0.0 elsewhere).

    A descendant that exits between two readings takes its time with it unless its parent in the tree reaped it
    (then it is in the parent's children's time): differences over a span are a lower bound."""
    children, ticks = _proc_table()
    return sum(ticks.get(pid, 0) for pid in _tree(root, children)) / os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------------------------------------------ driver


class Driver:
    def __init__(self) -> None:
        self.llm: Any = None

    def load(self, msg: dict[str, Any]) -> dict[str, Any]:
        """{"op": "load", "model", "dtype", "kv_cache_bytes", "max_num_seqs", "max_num_batched_tokens",
        "max_model_len", "enable_prefix_caching", "enforce_eager", "seed", "speculative_config" (optional: vLLM's
        dict)} -> {"ok", "load_s", "vllm", "torch",
        "threads_bind", "block_size", "compilation", "cache_root"}; `load_s` is the `vllm.LLM(...)` construction
        alone (vLLM imported before it)."""
        # vLLM (and its torch) only in the driver's process: the bench imports this module's helpers without them.
        import torch
        import vllm

        started = time.perf_counter()
        extra = {"speculative_config": msg["speculative_config"]} if msg.get("speculative_config") else {}
        self.llm = vllm.LLM(
            **extra,
            model=msg["model"],
            tokenizer=msg["model"],
            dtype=msg.get("dtype", "float32"),
            seed=msg.get("seed", 0),
            kv_cache_memory_bytes=msg["kv_cache_bytes"],
            max_num_seqs=msg["max_num_seqs"],
            max_num_batched_tokens=msg["max_num_batched_tokens"],
            max_model_len=msg["max_model_len"],
            enable_prefix_caching=msg.get("enable_prefix_caching", True),
            enforce_eager=msg.get("enforce_eager", False),
        )
        load_s = time.perf_counter() - started
        cache = self.llm.llm_engine.vllm_config.cache_config
        compilation = self.llm.llm_engine.vllm_config.compilation_config
        return {
            "ok": True,
            "load_s": load_s,
            "vllm": vllm.__version__,
            "torch": torch.__version__,
            "threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto (unset)"),
            "block_size": cache.block_size,
            "compilation": f"mode {getattr(compilation, 'mode', '?')}, backend {getattr(compilation, 'backend', '?')}",
            "cache_root": os.environ.get("VLLM_CACHE_ROOT"),
        }

    def generate(self, msg: dict[str, Any]) -> dict[str, Any]:
        """{"op": "generate", "requests": [{"id", "prompt": [int], "output_len"}], "reset_prefix_cache"} -> {"ok",
        "outputs": {id: [int]}, "seconds", "cpu_s", "output_tokens"}: greedy, exactly output_len tokens each, all in
        one `LLM.generate` call; `seconds` and `cpu_s` (this process and all its descendants, vLLM's engine-core
        process included) cover that call only."""
        from vllm import SamplingParams  # as in load: vLLM only in the driver's process
        from vllm.inputs import TokensPrompt

        if self.llm is None:
            raise RuntimeError("generate before load")
        requests = msg["requests"]
        if msg.get("reset_prefix_cache", True):
            self.llm.reset_prefix_cache()
        prompts = [TokensPrompt(prompt_token_ids=r["prompt"]) for r in requests]
        params = [
            SamplingParams(
                temperature=0.0,
                max_tokens=r["output_len"],
                # ignore_eos alone runs to max_tokens, as pagedkv does. min_tokens would also ban every stop and
                # EOS id (the generation config's too) from the logits: another distribution than pagedkv's.
                ignore_eos=True,
                detokenize=False,
            )
            for r in requests
        ]
        me = os.getpid()
        cpu0, t0 = tree_cpu_seconds(me), time.perf_counter()
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        seconds, cpu_s = time.perf_counter() - t0, tree_cpu_seconds(me) - cpu0
        tokens = {r["id"]: list(out.outputs[0].token_ids) for r, out in zip(requests, outputs)}
        return {
            "ok": True,
            "outputs": tokens,
            "seconds": seconds,
            "cpu_s": cpu_s,
            "output_tokens": sum(len(t) for t in tokens.values()),
        }


def serve(args: list[str]) -> int:
    """vLLM's `vllm serve ARGS` in this process (its API server; the engine core is a child process). Not the
    environment's `vllm` console script: it fails with PackageNotFoundError, the distribution being vllm-cpu."""
    real_version = metadata.version

    def version(name: str) -> str:
        # What vLLM's platform detection falls back to when "vllm" is not found: vllm-cpu's version + "+cpu".
        return real_version("vllm-cpu") + "+cpu" if name == "vllm" else real_version(name)

    metadata.version = version
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm.entrypoints.cli.main import main as vllm_main  # only now: vLLM reads both at import

    sys.argv = ["vllm", "serve", *args]
    vllm_main()
    return 0


def main() -> int:
    # Run by path, Python puts this file's folder first on sys.path, where pagedkv's benchmark modules (kernels.py
    # among them) would shadow packages vLLM imports by the same names.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    if sys.argv[1:2] == ["serve"]:
        return serve(sys.argv[2:])
    # Replies go to the original stdout only; everything printed after this (vLLM logs) goes to stderr.
    reply_fd = os.dup(1)
    os.dup2(2, 1)
    replies = os.fdopen(reply_fd, "w", buffering=1, encoding="utf-8")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    driver = Driver()
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            msg = json.loads(line)
            op = msg.get("op")
            if op == "quit":
                replies.write(json.dumps({"ok": True}) + "\n")
                return 0
            if op == "load":
                reply = driver.load(msg)
            elif op == "generate":
                reply = driver.generate(msg)
            else:
                reply = {"ok": False, "error": f"unknown op {op!r}"}
        except Exception as exc:  # every failure is answered; the bench decides what to do
            traceback.print_exc()
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        replies.write(json.dumps(reply) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
