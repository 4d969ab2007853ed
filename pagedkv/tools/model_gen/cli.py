"""`pagedkv make-model`: the command line over write_model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from pagedkv.tools.model_gen.spec import (
    ARCHITECTURES,
    DTYPES,
    MIN_VOCAB,
    ROPE_SCALINGS,
    ModelSpecError,
)
from pagedkv.tools.model_gen.writer import write_model


@click.command("make-model")
@click.option(
    "--arch",
    type=click.Choice(list(ARCHITECTURES)),
    default="llama",
    show_default=True,
    help="Model family: the transformers class and config fields it is written with.",
)
@click.option(
    "--out",
    "out",
    type=click.Path(file_okay=False, path_type=Path),
    required=True,
    help="Directory to write the checkpoint into (created; must be empty unless --force).",
)
@click.option(
    "--hidden-size", type=click.IntRange(min=1), default=256, show_default=True, help="Width of the residual stream."
)
@click.option(
    "--intermediate-size",
    type=click.IntRange(min=1),
    default=None,
    help="Width of the MLP; default ~2.7x hidden rounded up to a multiple of 16.",
)
@click.option("--layers", type=click.IntRange(min=1), default=4, show_default=True, help="Decoder layers.")
@click.option("--heads", type=click.IntRange(min=1), default=8, show_default=True, help="Attention (query) heads.")
@click.option(
    "--kv-heads",
    type=click.IntRange(min=1),
    default=4,
    show_default=True,
    help="Key/value heads (grouped-query attention); must divide --heads.",
)
@click.option(
    "--head-dim",
    type=click.IntRange(min=2),
    default=None,
    help="Per-head width; default hidden-size / heads. Need not make heads x head-dim = hidden.",
)
@click.option(
    "--vocab-size",
    type=click.IntRange(min=1),
    default=4096,
    show_default=True,
    help=f"Tokens of the trained BPE tokenizer and of the embedding (at least {MIN_VOCAB}).",
)
@click.option(
    "--max-position",
    type=click.IntRange(min=1),
    default=4096,
    show_default=True,
    help="max_position_embeddings: the longest context the model accepts.",
)
@click.option(
    "--rope-theta",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="Rotary embedding base; default 10000 (Gemma 3's global layers 1e6, gpt-oss 150000).",
)
@click.option(
    "--rope-scaling",
    type=click.Choice(ROPE_SCALINGS),
    default="none",
    show_default=True,
    help="llama3: Llama 3.1's (factor 8, original context max-position / 8); linear, dynamic: factor 2; "
    "yarn: factor 4, original context max-position / 4 (gpt-oss's betas); longrope: rising short and long "
    "factors, original context max-position / 4.",
)
@click.option(
    "--sliding-window",
    type=click.IntRange(min=1),
    default=None,
    help="Sliding-window attention of this many positions (default: none; Gemma 4096, gpt-oss 128).",
)
@click.option(
    "--sliding-pattern",
    type=click.IntRange(min=1),
    default=None,
    help="Every k-th layer attends globally, the others slide (qwen2/qwen3: default all slide; gemma2 and "
    "gpt_oss: 2; gemma3: 6). Written as layer_types.",
)
@click.option("--experts", type=click.IntRange(min=1), default=4, show_default=True, help="MoE: experts per layer.")
@click.option(
    "--experts-per-token", type=click.IntRange(min=1), default=2, show_default=True, help="MoE: experts routed to."
)
@click.option(
    "--moe-intermediate-size",
    type=click.IntRange(min=1),
    default=None,
    help="qwen3_moe: width of each expert (default about half --intermediate-size); mixtral and gpt_oss use "
    "--intermediate-size.",
)
@click.option(
    "--norm-topk-prob/--no-norm-topk-prob",
    default=True,
    show_default=True,
    help="qwen3_moe: renormalise the chosen experts' probabilities.",
)
@click.option(
    "--decoder-sparse-step",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="qwen3_moe: every k-th layer is sparse.",
)
@click.option(
    "--mlp-only-layers",
    default="",
    help="qwen3_moe: comma-separated layer indices that keep a dense MLP.",
)
@click.option(
    "--tie-embeddings/--no-tie-embeddings",
    default=None,
    help="Share the embedding with the LM head; default tied for qwen2, untied otherwise.",
)
@click.option(
    "--dtype",
    type=click.Choice(DTYPES),
    default="float32",
    show_default=True,
    help="Weight dtype as stored and as named in config.json.",
)
@click.option(
    "--seed",
    type=int,
    default=0,
    show_default=True,
    help="Seed of weights and tokenizer corpus: the same seed writes byte-identical files.",
)
@click.option(
    "--max-shard-size",
    default=None,
    help="Shard the weights into files of at most this size (e.g. 1MiB; binary units) with an index.",
)
@click.option("--force", is_flag=True, help="Replace the model in a non-empty --out directory.")
def make_model(out: Path, force: bool, **options: Any) -> None:
    """Write a small random-weight checkpoint (weights, config, tokenizer, chat template) into --out.

    The directory is laid out like a downloaded Hugging Face model, so transformers and the pagedkv
    executor load it as they would a real one; nothing is downloaded.
    """
    try:
        text = options.pop("mlp_only_layers").strip()
        try:
            options["mlp_only_layers"] = tuple(int(i) for i in text.split(",")) if text else ()
        except ValueError:
            raise ModelSpecError("--mlp-only-layers", f"--mlp-only-layers {text!r} is not a list of layers") from None
        write_model(out, force=force, **options)
    except ModelSpecError as exc:
        raise click.BadParameter(str(exc), param_hint=f"'{exc.option}'") from None
