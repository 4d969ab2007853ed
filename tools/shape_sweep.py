"""A sweep of checkpoint shapes the tests do not use, every family, engine output against transformers.

Each case is a `pagedkv make-model` option set, optionally with config.json fields rewritten afterwards (fields
that change the math but not the weights' shapes: softcaps, query_pre_attn_scalar, layer_types, rope factors).
The engine (real blockd process, prefix caching on) runs prompts past the window in two waves, the second
sharing the first's prefix; greedy tokens must equal transformers' and logprobs be within 2e-3 (float32).
A case the generator or the loader refuses is reported with its error (a refusal naming a field is a pass
when the case expects one).

    python -m tools.shape_sweep [-k SUBSTRING] [--list]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Several shapes per family that tests/support/models.py's FAMILY_SPECS do not use. Sizes over TINY.
TINY: dict[str, Any] = dict(hidden_size=128, layers=2, heads=4, kv_heads=2, vocab_size=512, max_position=512, seed=3)


@dataclass(frozen=True)
class Case:
    name: str
    options: dict[str, Any]
    config: dict[str, Any] = field(default_factory=dict)  # config.json fields set after generation
    refused: str | None = None  # a substring the refusal must name, when the case must be refused
    known: str | None = None  # a difference from transformers known and documented: reported, not counted


CASES: list[Case] = [
    # llama
    Case("llama-hd80-l3", dict(arch="llama", head_dim=80, layers=3)),
    Case("llama-gqa8-hd32", dict(arch="llama", heads=8, kv_heads=1, head_dim=32)),
    Case("llama-mha-hd128-tied", dict(arch="llama", heads=2, kv_heads=2, tie_embeddings=True, head_dim=128)),
    Case("llama3-rope-l5", dict(arch="llama", layers=5, rope_scaling="llama3")),
    Case("llama-hd256-l1", dict(arch="llama", heads=2, kv_heads=1, head_dim=256, layers=1)),
    Case("llama-linear-f4", dict(arch="llama", rope_scaling="linear"), {"rope_parameters.factor": 4.0}),
    Case(
        "llama-dynamic-original32",
        dict(arch="llama", rope_scaling="dynamic"),
        {"rope_parameters.original_max_position_embeddings": 32},
    ),
    Case(
        "qwen3-yarn-attention-factor",
        dict(arch="qwen3", rope_scaling="yarn"),
        {"rope_parameters.attention_factor": 1.3, "rope_parameters.truncate": True},
    ),
    Case(
        "qwen3-yarn-mscale",
        dict(arch="qwen3", rope_scaling="yarn"),
        {"rope_parameters.mscale": 0.707, "rope_parameters.mscale_all_dim": 0.707},
    ),
    Case(
        "phi3-longrope-past-original",
        dict(arch="phi3", rope_scaling="longrope", max_position=128),
        known="prompts past the original context: transformers turns every position by the long factors",
    ),
    Case("mixtral-tied", dict(arch="mixtral", tie_embeddings=True)),
    Case("gpt_oss-tied-l1", dict(arch="gpt_oss", tie_embeddings=True, layers=1, sliding_window=9)),
    Case("llama-hd48", dict(arch="llama", head_dim=48), refused="head"),
    Case("llama-hd16", dict(arch="llama", head_dim=16), refused="head"),
    # mistral
    Case("mistral-w13-hd96", dict(arch="mistral", sliding_window=13, head_dim=96)),
    Case("mistral-w200-mha", dict(arch="mistral", sliding_window=200, kv_heads=4)),
    Case("mistral-w33-l3-gqa4", dict(arch="mistral", sliding_window=33, layers=3, kv_heads=1)),
    # qwen2
    Case("qwen2-w13-untied", dict(arch="qwen2", sliding_window=13, tie_embeddings=False)),
    Case("qwen2-hd128-gqa2", dict(arch="qwen2", heads=2, kv_heads=1, head_dim=128)),
    Case(
        "qwen2-max-window-layers",
        dict(arch="qwen2", sliding_window=17, layers=3),
        {"max_window_layers": 1, "layer_types": None},
    ),
    # qwen3
    Case("qwen3-hd128-h2", dict(arch="qwen3", heads=2, kv_heads=1, head_dim=128)),
    Case("qwen3-hd256-untied", dict(arch="qwen3", heads=2, kv_heads=2, head_dim=256, tie_embeddings=False)),
    Case("qwen3-gqa8-hd32-l3", dict(arch="qwen3", heads=8, kv_heads=1, head_dim=32, layers=3)),
    Case("qwen3-w13-p3-l5", dict(arch="qwen3", sliding_window=13, sliding_pattern=3, layers=5)),
    Case("qwen3-yarn-hd80", dict(arch="qwen3", head_dim=80, rope_scaling="yarn")),
    # qwen3_moe
    Case("qwen3_moe-e16k1", dict(arch="qwen3_moe", experts=16, experts_per_token=1)),
    Case("qwen3_moe-e3k3-hd80", dict(arch="qwen3_moe", experts=3, experts_per_token=3, head_dim=80)),
    Case(
        "qwen3_moe-step2-l5",
        dict(
            arch="qwen3_moe", layers=5, decoder_sparse_step=2, experts=6, experts_per_token=2, moe_intermediate_size=48
        ),
    ),
    Case("qwen3_moe-w21-gqa4", dict(arch="qwen3_moe", kv_heads=1, sliding_window=21)),
    Case("qwen3_moe-nonorm-l3", dict(arch="qwen3_moe", layers=3, norm_topk_prob=False, mlp_only_layers=(0, 2))),
    # mixtral
    Case("mixtral-e2k1", dict(arch="mixtral", experts=2, experts_per_token=1)),
    Case("mixtral-e6k3-w50-hd64", dict(arch="mixtral", experts=6, experts_per_token=3, sliding_window=50, head_dim=64)),
    Case("mixtral-l3-gqa4-w11", dict(arch="mixtral", layers=3, kv_heads=1, sliding_window=11)),
    # gemma2
    Case("gemma2-w13-l5", dict(arch="gemma2", sliding_window=13, layers=5)),
    Case("gemma2-qpas64-hd128", dict(arch="gemma2", head_dim=128, sliding_window=20), {"query_pre_attn_scalar": 64}),
    Case(
        "gemma2-softcaps",
        dict(arch="gemma2", sliding_window=18),
        {"attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0},
    ),
    Case(
        "gemma2-nocaps-hd256",
        dict(arch="gemma2", heads=2, kv_heads=1, head_dim=256, sliding_window=40),
        {"attn_logit_softcapping": None, "final_logit_softcapping": None},
    ),
    Case("gemma2-mha-w200", dict(arch="gemma2", kv_heads=4, sliding_window=200)),
    # gemma3
    Case("gemma3-l7-default-pattern-w13", dict(arch="gemma3", layers=7, sliding_window=13)),
    Case(
        "gemma3-layer-types",
        dict(arch="gemma3", layers=5, sliding_window=19),
        {
            "layer_types": [
                "sliding_attention",
                "full_attention",
                "sliding_attention",
                "sliding_attention",
                "full_attention",
            ]
        },
    ),
    Case(
        "gemma3-linear8-hd256",
        dict(
            arch="gemma3",
            heads=2,
            kv_heads=1,
            head_dim=256,
            sliding_window=24,
            rope_scaling="linear",
            sliding_pattern=2,
        ),
        {"rope_parameters.full_attention.factor": 8.0},
    ),
    Case(
        "gemma3-qpas100",
        dict(arch="gemma3", layers=3, sliding_window=17, sliding_pattern=3),
        {"query_pre_attn_scalar": 100},
    ),
    Case(
        "gemma3-softcaps",
        dict(arch="gemma3", layers=2, sliding_window=14, sliding_pattern=2),
        {"attn_logit_softcapping": 8.0, "final_logit_softcapping": 4.0},
    ),
    Case("gemma3-gqa4-untied", dict(arch="gemma3", layers=4, kv_heads=1, sliding_window=29, tie_embeddings=False)),
    # phi3
    Case("phi3-gqa4-w13", dict(arch="phi3", kv_heads=1, sliding_window=13)),
    Case("phi3-hd96-l3", dict(arch="phi3", hidden_size=384, heads=4, kv_heads=2, layers=3)),
    Case("phi3-longrope-mha", dict(arch="phi3", kv_heads=4, rope_scaling="longrope")),
    Case("phi3-tied", dict(arch="phi3", tie_embeddings=True)),
    Case(
        "phi3-partial-rotary-l3",
        dict(arch="phi3", layers=3, sliding_window=21),
        {"rope_parameters.partial_rotary_factor": 0.75},
    ),
    Case(
        "llama-partial-rotary",
        dict(arch="llama"),
        {"rope_parameters.partial_rotary_factor": 0.5},
        refused="partial_rotary_factor",
    ),
    # gpt_oss
    Case("gpt_oss-w13-e16k1", dict(arch="gpt_oss", sliding_window=13, experts=16, experts_per_token=1)),
    Case("gpt_oss-gqa8-l3", dict(arch="gpt_oss", heads=8, kv_heads=1, head_dim=32, layers=3, sliding_window=20)),
    Case("gpt_oss-hd80-e3k3", dict(arch="gpt_oss", head_dim=80, experts=3, experts_per_token=3, sliding_window=31)),
    Case(
        "gpt_oss-layer-types",
        dict(arch="gpt_oss", layers=3, sliding_window=17),
        {"layer_types": ["full_attention", "sliding_attention", "sliding_attention"]},
    ),
    Case("gpt_oss-yarn-w200", dict(arch="gpt_oss", rope_scaling="yarn", sliding_window=200)),
]


def _set(config: dict[str, Any], dotted: str, value: Any) -> None:
    *path, last = dotted.split(".")
    for key in path:
        config = config.setdefault(key, {})
    if value is None and last == "layer_types":
        config.pop(last, None)
    else:
        config[last] = value


def _write(case: Case, root: Path) -> Path:
    from pagedkv.tools.model_gen import write_model

    out = write_model(root / case.name, quiet=True, dtype="float32", **{**TINY, **case.options})
    if case.config:
        path = out / "config.json"
        config = json.loads(path.read_text())
        for key, value in case.config.items():
            _set(config, key, value)
        path.write_text(json.dumps(config, indent=2))
    return out


def _compare(model: Path, blockd_endpoint: str, name: str) -> str:
    from executor.params import SamplingParams
    from tests.executor.harness import drive, hf_greedy_ignoring_eos, hf_logprobs, make_engine, random_prompts

    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=1)
    vocab = TINY["vocab_size"]
    shared = random_prompts([40], vocab=vocab, seed=51)[0]
    prompts = {
        "first": [*shared, *random_prompts([23], vocab=vocab, seed=52)[0]],
        "long": random_prompts([90], vocab=vocab, seed=53)[0],
        "short": random_prompts([5], vocab=vocab, seed=54)[0],
    }
    engine = make_engine(model, blockd_endpoint, pool_id=f"sweep-{name}")
    results = drive(
        engine,
        {0: [(k, p, params) for k, p in prompts.items() if k != "short"], 2: [("short", prompts["short"], params)]},
    )
    prompts["second"] = [*shared, 7, 8, 9]
    results |= drive(engine, {0: [("second", prompts["second"], params)]})
    notes = []
    if results["second"][0].cached_tokens != 32:
        notes.append(f"cached {results['second'][0].cached_tokens} != 32")
    worst = 0.0
    for key, prompt in prompts.items():
        choice = results[key][0]
        expected = hf_greedy_ignoring_eos(model, prompt, 10)
        reference = hf_logprobs(model, prompt, choice.tokens)
        for pos, entry in enumerate(choice.logprobs):
            worst = max(worst, abs(entry.logprob - reference[pos, entry.token_id].item()))
        if choice.tokens != expected:
            pos = next(i for i, (a, b) in enumerate(zip(choice.tokens, expected, strict=True)) if a != b)
            top = reference[pos].topk(2).values
            notes.append(f"{key}: tokens differ at {pos} (reference top-2 gap {float(top[0] - top[1]):.2e})")
    if worst >= 2e-3:
        notes.append(f"logprob diff {worst:.2e}")
    return "; ".join(notes) if notes else f"ok (max logprob diff {worst:.1e})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", default="", help="only cases whose name contains this")
    parser.add_argument("--list", action="store_true")
    args = parser.parse_args()
    cases = [c for c in CASES if args.k in c.name]
    if args.list:
        print("\n".join(c.name for c in cases))
        return 0
    from tests.support.processes import BlockdProcess

    failures = 0
    with tempfile.TemporaryDirectory(prefix="shape-sweep-") as tmp:
        root = Path(tmp)
        blockd = BlockdProcess(["--no-persistence"], root / "blockd.log")
        blockd.start()
        try:
            for case in cases:
                started = time.perf_counter()
                try:
                    model = _write(case, root)
                    outcome = _compare(model, blockd.endpoint, case.name)
                    ok = outcome.startswith("ok") and case.refused is None
                    if case.refused is not None:
                        outcome = f"NOT REFUSED: {outcome}"
                except Exception as exc:  # every case reports, whatever fails
                    message = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
                    ok = case.refused is not None and case.refused in str(exc)
                    outcome = f"refused: {message}" if ok else f"FAILED {message}\n{traceback.format_exc(limit=-4)}"
                if not ok and case.known is not None:
                    outcome = f"{outcome} (known: {case.known})"
                failures += not ok and case.known is None
                verdict = "PASS" if ok else "KNOWN" if case.known is not None else "FAIL"
                print(f"{verdict:<5} {case.name:<32} {time.perf_counter() - started:5.1f}s {outcome}", flush=True)
        finally:
            blockd.kill9()
    print(f"{len(cases) - failures}/{len(cases)} cases pass or are known differences")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
