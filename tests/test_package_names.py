"""No top-level package of ours takes a name another installed distribution provides: installed side by side, one
would shadow the other. (A top-level `kernels` shadowed Hugging Face's, which transformers 5.25 imports.)"""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

import transformers

import pagedkv_kernels

REPO = Path(__file__).resolve().parents[1]


def _ours() -> set[str]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    return set(config["tool"]["importlinter"]["root_packages"])


def _top_level(dist: importlib.metadata.Distribution) -> set[str]:
    listed = dist.read_text("top_level.txt")
    if listed is not None:
        return {line.strip() for line in listed.splitlines() if line.strip()}
    names = set()
    for file in dist.files or ():
        parts = file.parts
        if len(parts) > 1 and parts[1] == "__init__.py" and not parts[0].endswith((".dist-info", ".data")):
            names.add(parts[0])
    return names


def test_no_installed_distribution_provides_a_package_of_ours() -> None:
    ours = _ours()
    clashes = {
        (dist.metadata["Name"], name)
        for dist in importlib.metadata.distributions()
        if dist.metadata["Name"] != "pagedkv"
        for name in _top_level(dist) & ours
    }
    assert not clashes, f"installed distributions with a top-level package of ours: {sorted(clashes)}"


def test_transformers_models_import_beside_our_kernels() -> None:
    assert pagedkv_kernels.__file__.startswith(str(REPO))
    assert transformers.LlamaForCausalLM.__name__ == "LlamaForCausalLM"  # imports its activations and hub kernels
