"""The repetitive workload of `pagedkv bench throughput --workload repeat` (speculative decoding's): a model that
repeats, and prompts that hold the text its output repeats.

A random-weight model's greedy text never repeats, so no proposal would ever be accepted; a trained model
copying an extraction's input does. The stand-in: the generated model with its attention's output projections
zeroed (`attention_scale` 0), so each next token is a function of the current one: greedy text falls into
cycles and follows any earlier text of the model's, as a copying model's output follows its input (scaled by
as little as 0.05 the random attention already breaks that). Every layer still runs in full, so a step costs
what the unscaled model's does. The prompts are a document (the model's own greedy text from a random start)
and its first tokens again: the output repeats the document, as an extraction would.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file


def write_repeating_model(out: Path, attention_scale: float = 0.0, **options: Any) -> Path:
    """A generated checkpoint (pagedkv.tools.model_gen.write_model's `options`) whose attention output
    projections are multiplied by `attention_scale`; written once (kept if `out` holds one)."""
    from pagedkv.tools.model_gen import write_model

    if (out / "config.json").exists():
        return out
    staging = out.with_name(out.name + ".staging")
    write_model(staging, quiet=True, force=True, **options)
    weights_file = staging / "model.safetensors"
    weights = load_file(weights_file)
    for name, tensor in weights.items():
        if name.endswith("self_attn.o_proj.weight"):
            weights[name] = (tensor.float() * attention_scale).to(tensor.dtype)
    save_file(weights, weights_file, metadata={"format": "pt"})
    staging.rename(out)
    return out


def documents(count: int, length: int, vocab: int, seed: int, greedy: Any) -> list[list[int]]:
    """`count` documents of `length` tokens: `greedy(prompts, n)` (the model's greedy continuations) from random
    4-token starts."""
    g = torch.Generator().manual_seed(seed)
    starts = [torch.randint(0, vocab, (4,), generator=g).tolist() for _ in range(count)]
    return [s + out for s, out in zip(starts, greedy(starts, length - 4), strict=True)]


def repeat_prompt(document: list[int], head: int = 8) -> list[int]:
    """The document, then its first `head` tokens again: what follows is the document once more."""
    return document + document[:head]
