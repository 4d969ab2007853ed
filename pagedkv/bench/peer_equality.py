"""Output equality in `pagedkv bench peer`: pagedkv's outputs against each vLLM setting's, token for token, each
divergence checked for a near tie (the two systems' tokens are transformers' top two, within a tolerance)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pagedkv.bench.throughput import BenchRequest

DEFAULT_TIE_TOLERANCE = 1e-3
#: Divergences checked against transformers per comparison at most (each is one forward pass).
MAX_TIE_CHECKS = 64


@dataclass(frozen=True)
class Divergence:
    request_id: str
    position: int  # index into the output of the first token that differs (or where one output ends)
    ours: int | None
    theirs: int | None


def compare_outputs(
    requests: Sequence[BenchRequest], ours: dict[str, list[int]], theirs: dict[str, list[int]]
) -> list[Divergence]:
    """The first difference of every request whose outputs differ, in workload order."""
    found = []
    for r in requests:
        a, b = ours.get(r.request_id, []), theirs.get(r.request_id, [])
        if a == b:
            continue
        position = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        found.append(
            Divergence(
                r.request_id,
                position,
                a[position] if position < len(a) else None,
                b[position] if position < len(b) else None,
            )
        )
    return found


@dataclass(frozen=True)
class TieCheck:
    divergence: Divergence
    top: tuple[int, int]  # transformers' two most likely tokens at that point
    gap: float  # their logits' difference
    near_tie: bool  # the two systems' tokens are those two, and the gap is within the tolerance


def check_near_tie(
    logits_at: Callable[[list[int]], Sequence[float]],
    request: BenchRequest,
    divergence: Divergence,
    common: list[int],
    tolerance: float,
) -> TieCheck:
    """Whether a divergence is a near tie: `logits_at(ids)` gives the next-token logits after `ids` (transformers
    in the command); `common` is the output the two systems agree on before the divergence."""
    logits = list(logits_at(list(request.prompt) + common[: divergence.position]))
    order = sorted(range(len(logits)), key=lambda t: logits[t], reverse=True)[:2]
    top = (order[0], order[1])
    gap = float(logits[top[0]] - logits[top[1]])
    tokens = {divergence.ours, divergence.theirs}
    return TieCheck(divergence, top, gap, tokens == set(top) and gap <= tolerance)


def hf_logits_fn(model_dir: Path) -> Callable[[list[int]], list[float]]:
    """transformers' float32 next-token logits after a sequence of token ids."""
    # Only when outputs differ: most comparisons need neither torch nor transformers loaded.
    import torch
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def logits_at(ids: list[int]) -> list[float]:
        with torch.inference_mode():
            return model(torch.tensor([ids])).logits[0, -1].tolist()

    return logits_at


def equality(
    requests: Sequence[BenchRequest],
    outputs: dict[str, list[dict[str, list[int]]]],
    model_dir: Path,
    tolerance: float,
    labels: dict[str, str],
) -> dict[str, Any]:
    """Token equality of pagedkv's first run against each vLLM setting's first run (near ties checked), and of
    each system's runs among themselves."""
    lines: list[str] = []
    result: dict[str, Any] = {"requests": len(requests), "against": {}, "repeatable": {}}
    logits_at: Callable[[list[int]], list[float]] | None = None
    by_id = {r.request_id: r for r in requests}
    ours = outputs["pagedkv"][0]
    for system, runs in outputs.items():
        same = all(run == runs[0] for run in runs[1:])
        result["repeatable"][system] = same
        if not same:
            lines.append(f"{labels[system]}: its runs' outputs differ from each other")
    for system, runs in outputs.items():
        if system == "pagedkv":
            continue
        found = compare_outputs(requests, ours, runs[0])
        checks: list[TieCheck] = []
        if found and logits_at is None:
            logits_at = hf_logits_fn(model_dir)
        for d in found[:MAX_TIE_CHECKS]:
            assert logits_at is not None
            checks.append(check_near_tie(logits_at, by_id[d.request_id], d, ours[d.request_id], tolerance))
        ties = sum(c.near_tie for c in checks)
        text = f"outputs: pagedkv = {labels[system]} on {len(requests) - len(found)}/{len(requests)} requests"
        if found:
            text += f"; of {len(checks)} divergences checked, {ties} near ties (top-two logits within {tolerance:g})"
            if len(found) > len(checks):
                text += f", {len(found) - len(checks)} not checked"
        lines.append(text)
        for c in checks:
            if not c.near_tie:
                d = c.divergence
                agrees = {d.ours: "pagedkv", d.theirs: labels[system]}.get(c.top[0], "neither")
                lines.append(
                    f"  NOT a near tie: request {d.request_id} at output token {d.position}: pagedkv {d.ours}, "
                    f"{labels[system]} {d.theirs}; transformers' top two {c.top} {c.gap:.3g} apart "
                    f"(transformers picks {c.top[0]}: {agrees})"
                )
        result["against"][system] = {
            "equal_requests": len(requests) - len(found),
            "divergences": [
                {
                    **asdict(c.divergence),
                    "top_two": list(c.top),
                    "gap": c.gap,
                    "near_tie": c.near_tie,
                    "transformers_agrees_with": (
                        "pagedkv"
                        if c.top[0] == c.divergence.ours
                        else system
                        if c.top[0] == c.divergence.theirs
                        else None
                    ),
                }
                for c in checks
            ],
            "unchecked": max(0, len(found) - len(checks)),
            "near_ties": ties,
        }
    result["lines"] = lines
    return result
