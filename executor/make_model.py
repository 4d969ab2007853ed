"""`pagedkv make-model`: a small random-weight checkpoint laid out exactly like a downloaded one.

The directory holds config.json, generation_config.json, model.safetensors (or shards and their index),
tokenizer.json, tokenizer_config.json (with a ChatML `chat_template`) and special_tokens_map.json, so everything
downstream (checkpoint reader, executor, gateway, transformers itself as the reference) runs unchanged on it,
without a download. The weights come from the real transformers classes under a fixed seed; the tokenizer is a
byte-level BPE trained here on a generated corpus. The same options and seed give byte-identical files.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import random
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from pagedkv.units import parse_size

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
DTYPES = ("float32", "float16", "bfloat16")
ROPE_SCALINGS = ("none", "llama3")
BOS, EOS, IM_START, IM_END = "<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (BOS, EOS, IM_START, IM_END)  # trained first, so their ids are 0..3
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)  # every byte must be a token, so any text encodes
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
# Logit std the random init aims at, so greedy decoding is numerically robust for downstream comparisons.
# Measured over 16x256 random prompts (float32, vocab 512-4096, hidden 64-512): transformers' default 0.02
# gives logit std 0.16-0.3, top-1/top-2 gaps near 0.03 and greedy text that often collapses to one token.
# initializer_range = 4/sqrt(hidden) (0.25 at 256, 0.35 at 128, 0.5 at 64) gives std 4.0, a median gap of
# 0.75-0.9, about 1 position in 1,000 with a gap under 1e-3 (1 in 2,000-4,000 under 1e-4 at hidden 64, none
# seen at hidden >= 128), and greedy continuations of mixed tokens (90-128 distinct in 128). A larger target
# barely helps the near-tie rate: the top-two gap of V Gaussians scales only like std/sqrt(2 ln V).
TARGET_LOGIT_STD = 4.0
DEFAULT_MODEL_NAME = "default-llama"


class ModelSpecError(ValueError):
    """An invalid combination of make-model options; `option` names the one to change."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(message)
        self.option = option


@dataclass(frozen=True)
class ModelSpec:
    """Every choice that determines the files written (so also the cache key of the default model)."""

    arch: str = "llama"
    hidden_size: int = 256
    intermediate_size: int | None = None
    layers: int = 4
    heads: int = 8
    kv_heads: int = 4
    head_dim: int | None = None
    vocab_size: int = 4096
    max_position: int = 4096
    rope_theta: float = 10000.0
    rope_scaling: str = "none"
    tie_embeddings: bool | None = None
    dtype: str = "float32"
    seed: int = 0
    initializer_range: float | None = None

    @property
    def resolved_intermediate_size(self) -> int:
        # ~2.7x hidden (Llama's 8/3 ratio), rounded up to a multiple of 16
        return self.intermediate_size or 16 * math.ceil(2.7 * self.hidden_size / 16)

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.heads

    @property
    def tied(self) -> bool:
        return self.tie_embeddings if self.tie_embeddings is not None else self.arch == "qwen2"

    @property
    def resolved_initializer_range(self) -> float:
        # Final-norm output has unit RMS, so logit std ~ initializer_range * sqrt(hidden): aim it at the target.
        return self.initializer_range or TARGET_LOGIT_STD / math.sqrt(self.hidden_size)

    def validate(self) -> None:
        """ModelSpecError for the first bad option, before anything is built or written."""
        if self.arch not in ARCHITECTURES:
            raise ModelSpecError("--arch", f"unknown architecture {self.arch!r}; choose {', '.join(ARCHITECTURES)}")
        for option, value in (
            ("--hidden-size", self.hidden_size),
            ("--layers", self.layers),
            ("--heads", self.heads),
            ("--kv-heads", self.kv_heads),
            ("--max-position", self.max_position),
        ):
            if value < 1:
                raise ModelSpecError(option, f"{option} must be at least 1, not {value}")
        if self.intermediate_size is not None and self.intermediate_size < 1:
            raise ModelSpecError("--intermediate-size", "--intermediate-size must be at least 1")
        if self.head_dim is None and self.hidden_size % self.heads:
            raise ModelSpecError(
                "--heads", f"{self.heads} heads do not divide --hidden-size {self.hidden_size} (or give --head-dim)"
            )
        if self.heads % self.kv_heads:
            raise ModelSpecError("--kv-heads", f"{self.kv_heads} kv heads do not divide {self.heads} heads")
        if self.resolved_head_dim < 2 or self.resolved_head_dim % 2:
            raise ModelSpecError("--head-dim", f"head dim {self.resolved_head_dim} must be even (rotary pairs)")
        from kernels.validate import SUPPORTED_HEAD_DIMS  # imports torch: not at module level (fast --help)

        if self.resolved_head_dim not in SUPPORTED_HEAD_DIMS:  # what the paged-attention kernels are built for
            raise ModelSpecError(
                "--head-dim",
                f"head dim {self.resolved_head_dim} is not one the kernels support "
                f"({', '.join(map(str, SUPPORTED_HEAD_DIMS))})",
            )
        if self.vocab_size < MIN_VOCAB:
            raise ModelSpecError(
                "--vocab-size",
                f"--vocab-size {self.vocab_size} is too small: the tokenizer "
                f"needs 256 byte tokens + {len(SPECIAL_TOKENS)} special tokens = "
                f"{MIN_VOCAB}",
            )
        if self.rope_scaling not in ROPE_SCALINGS:
            raise ModelSpecError("--rope-scaling", f"unknown rope scaling {self.rope_scaling!r}")
        if self.rope_scaling == "llama3" and self.max_position < 16:
            raise ModelSpecError("--max-position", "llama3 rope scaling needs --max-position of at least 16")
        if self.rope_theta <= 0:
            raise ModelSpecError("--rope-theta", "--rope-theta must be positive")
        if self.dtype not in DTYPES:
            raise ModelSpecError("--dtype", f"unknown dtype {self.dtype!r}; choose {', '.join(DTYPES)}")


# ---------------------------------------------------------------------------------------------------- corpus

# The tokenizer corpus is generated, not read from disk: stdlib docstrings or this repo's docs change between
# Python versions and commits, and with them the tokenizer and every token id. A seeded generator is the same
# everywhere. English words drawn Zipf-like give realistic merges; pseudo-words supply enough distinct
# pairs to fill large vocabularies; code and multilingual lines cover whitespace runs and multi-byte UTF-8.
_ENGLISH = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "a",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "he",
    "this",
    "are",
    "or",
    "his",
    "from",
    "at",
    "which",
    "but",
    "have",
    "an",
    "they",
    "you",
    "were",
    "her",
    "she",
    "there",
    "been",
    "one",
    "all",
    "we",
    "their",
    "has",
    "would",
    "when",
    "if",
    "so",
    "no",
    "will",
    "can",
    "more",
    "other",
    "some",
    "what",
    "about",
    "into",
    "than",
    "them",
    "only",
    "out",
    "time",
    "could",
    "these",
    "two",
    "may",
    "then",
    "do",
    "first",
    "any",
    "my",
    "now",
    "such",
    "like",
    "our",
    "over",
    "man",
    "me",
    "even",
    "most",
    "made",
    "after",
    "also",
    "did",
    "many",
    "before",
    "must",
    "through",
    "back",
    "years",
    "where",
    "much",
    "your",
    "way",
    "well",
    "down",
    "should",
    "because",
    "each",
    "just",
    "those",
    "people",
    "how",
    "too",
    "little",
    "state",
    "good",
    "very",
    "make",
    "world",
    "still",
    "own",
    "see",
    "men",
    "work",
    "long",
    "get",
    "here",
    "between",
    "both",
    "life",
    "being",
    "under",
    "never",
    "day",
    "same",
    "another",
    "know",
    "while",
    "last",
    "might",
    "us",
    "great",
    "old",
    "year",
    "off",
    "come",
    "since",
    "against",
    "go",
    "came",
    "right",
    "used",
    "take",
    "three",
    "request",
    "token",
    "block",
    "cache",
    "memory",
    "model",
    "layer",
    "batch",
    "server",
    "client",
    "queue",
    "prefix",
    "attention",
    "kernel",
    "tensor",
    "shape",
    "value",
    "key",
    "query",
    "head",
    "table",
    "page",
    "pool",
    "free",
    "allocate",
    "copy",
    "write",
    "read",
    "fast",
    "slow",
    "small",
    "large",
    "first",
    "next",
    "previous",
    "number",
    "string",
    "list",
    "dict",
    "error",
    "return",
    "function",
    "class",
    "module",
    "import",
    "test",
    "check",
    "run",
    "start",
    "stop",
    "send",
    "receive",
    "message",
    "reply",
    "because",
    "however",
    "therefore",
    "although",
    "whether",
    "during",
    "without",
    "within",
    "around",
    "above",
    "below",
    "across",
    "along",
    "among",
    "behind",
    "water",
    "light",
    "house",
    "city",
    "river",
    "road",
    "tree",
    "stone",
    "paper",
    "music",
    "market",
    "garden",
    "window",
    "morning",
    "evening",
    "summer",
    "winter",
    "simple",
    "quiet",
    "bright",
    "careful",
    "sudden",
    "gentle",
    "heavy",
    "early",
    "late",
    "open",
    "close",
    "clear",
    "dark",
    "warm",
    "cold",
    "strong",
    "weak",
]
_MULTILINGUAL = (
    "héllo wörld",
    "café crème",
    "naïve façade",
    "über straße",
    "größer als",
    "señor año",
    "mañana por la mañana",
    "l'été dernier à Paris",
    "Ærøskøbing",
    "Dvořák",
    "Łódź",
    "İstanbul",
    "Ελληνικά γράμματα",
    "Привет, мир",
    "Добрый вечер",
    "日本語のテキスト",
    "東京と大阪",
    "こんにちは世界",
    "カタカナ",
    "中文文本",
    "你好，世界",
    "한국어 문장",
    "안녕하세요",
    "مرحبا بالعالم",
    "שלום עולם",
    "नमस्ते दुनिया",
    "ภาษาไทย",
    "🙂",
    "🚀 launch",
    "👍🏽",
    "🎉🎉",
    "❤️",
    "∑ x² ≤ ∞",
    "→ ← ↑ ↓",
    "€100 £50 ¥2000",
    "“quoted” ‘text’ — dash…",
)
_CONSONANTS, _VOWELS, _CODAS = "bcdfghjklmnprstvwz", "aeiou", ("", "", "n", "r", "s", "t", "l", "nd", "st", "ng")


def _pseudo_words(rng: random.Random, count: int) -> list[str]:
    words = []
    for _ in range(count):
        syllables = rng.choice((1, 2, 2, 3, 3, 4))
        words.append(
            "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables))
        )
    return words


class _Zipf:
    """Draws from a word list with probability ~ 1/rank (cumulative weights computed once)."""

    def __init__(self, words: list[str]) -> None:
        self.words, self.cum, total = words, [], 0.0
        for rank in range(1, len(words) + 1):
            total += 1.0 / rank
            self.cum.append(total)

    def __call__(self, rng: random.Random, k: int) -> list[str]:
        return rng.choices(self.words, cum_weights=self.cum, k=k)


def tokenizer_corpus(seed: int, size: int = 400_000) -> list[str]:
    """About `size` characters of generated English-like prose, code and multilingual lines, as paragraphs."""
    rng = random.Random(f"pagedkv-corpus-{seed}")
    lexicon = _pseudo_words(rng, 6000)
    english, terms, identifiers = _Zipf(_ENGLISH), _Zipf(lexicon), _Zipf(_ENGLISH + lexicon[:500])
    paragraphs: list[str] = []
    produced = 0
    while produced < size:
        kind = rng.random()
        if kind < 0.6:  # prose, with a rare pseudo-word as a name or a term
            sentences = []
            for _ in range(rng.randint(2, 6)):
                words = english(rng, rng.randint(4, 16))
                for i in range(len(words)):
                    if rng.random() < 0.12:
                        words[i] = terms(rng, 1)[0]
                    if rng.random() < 0.03:
                        words[i] = str(rng.randint(0, 10 ** rng.randint(1, 5)))
                sentence = " ".join(words)
                sentences.append(sentence[0].upper() + sentence[1:] + rng.choice(".....?!;:"))
            text = " ".join(sentences)
        elif kind < 0.85:  # code: identifiers, indentation runs, operators, literals
            name = "_".join(identifiers(rng, rng.randint(1, 3)))
            args = ", ".join(english(rng, rng.randint(0, 3)))
            body = [f"def {name}({args}):"]
            for _ in range(rng.randint(1, 5)):
                a, b = english(rng, 2)
                indent = " " * (4 * rng.randint(1, 3))
                body.append(
                    rng.choice(
                        (
                            f"{indent}{a} = {b} + {rng.randint(0, 999)}",
                            f"{indent}if {a} is not None and {b}[{rng.randint(0, 9)}] >= 0:",
                            f'{indent}return {{"{a}": {b}, "count": {rng.randint(0, 99)}}}',
                            f"{indent}for {a} in range(len({b})):",
                            f"{indent}self.{a}_{b} = [{a} * 2 for {a} in {b}]  # {' '.join(english(rng, 3))}",
                        )
                    )
                )
            text = "\n".join(body)
        else:  # multilingual phrases between English words
            parts = []
            for _ in range(rng.randint(3, 10)):
                parts.append(rng.choice(_MULTILINGUAL) if rng.random() < 0.5 else english(rng, 1)[0])
            text = " ".join(parts) + rng.choice((".", "!", "?", "。", ""))
        paragraphs.append(text)
        produced += len(text) + 1
    return paragraphs


# ------------------------------------------------------------------------------------------------- tokenizer


# transformers 5 loads any qwen2 checkpoint's tokenizer through Qwen2Tokenizer, which rebuilds the pipeline
# as NFC + this split + ByteLevel whatever tokenizer.json says; qwen2 models get that pipeline in
# tokenizer.json too, so every reader of the file tokenizes as transformers does.
QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
    r"""|\s+(?!\S)|\s+"""
)


def train_tokenizer(vocab_size: int, seed: int, *, arch: str = "llama") -> Any:
    """A byte-level BPE `tokenizers.Tokenizer` of exactly `vocab_size` tokens, special tokens first (ids 0-3).

    llama and mistral: no normalizer, GPT-2's ByteLevel pre-tokenizer and decoder, so any text encodes and
    decodes back byte for byte. qwen2: Qwen2's NFC normalizer and split (see QWEN2_SPLIT), so NFC text
    round-trips. When the corpus runs out of merges before `vocab_size`, reserved special tokens fill the rest
    (as Llama 3 does), so len(tokenizer) always equals the model's vocab_size.
    """
    from tokenizers import Tokenizer

    return Tokenizer.from_str(_trained_tokenizer_json(vocab_size, seed, arch == "qwen2"))


@functools.lru_cache(maxsize=8)
def _trained_tokenizer_json(vocab_size: int, seed: int, qwen2_pipeline: bool) -> str:
    """Training is deterministic, so a process (a test session) trains each variant once."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    if qwen2_pipeline:
        tokenizer.normalizer = normalizers.NFC()
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(tokenizer_corpus(seed), trainer)
    shortfall = vocab_size - tokenizer.get_vocab_size()
    if shortfall > 0:
        tokenizer.add_special_tokens([f"<|reserved_special_token_{i}|>" for i in range(shortfall)])
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer has {tokenizer.get_vocab_size()} tokens, wanted {vocab_size}")
    return tokenizer.to_str()


def _write_tokenizer(out: Path, spec: ModelSpec) -> dict[str, int]:
    """tokenizer.json, tokenizer_config.json (with the chat template) and special_tokens_map.json; the ids."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(spec.vocab_size, spec.seed, arch=spec.arch),
        bos_token=BOS,
        eos_token=EOS,
        pad_token=EOS,  # no dedicated pad token, as in Llama 3; the config keeps pad_token_id unset
        unk_token=None,  # byte-level: nothing is unknown (and Qwen2Tokenizer would add its own otherwise)
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        model_max_length=spec.max_position,
        clean_up_tokenization_spaces=False,  # transformers 4 would otherwise rewrite " ." on decode
    )
    # save_jinja_files=False keeps the template inside tokenizer_config.json (one place, every version reads it)
    fast.save_pretrained(str(out), save_jinja_files=False)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    # transformers 5 names its own backend class, which transformers 4 and other readers do not know.
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config.setdefault("additional_special_tokens", [IM_START, IM_END])
    config["clean_up_tokenization_spaces"] = False
    config["unk_token"] = None
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n", "utf-8")
    special_map = {
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "additional_special_tokens": [IM_START, IM_END],
    }
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n", "utf-8")
    if len(fast) != spec.vocab_size:
        raise RuntimeError(f"tokenizer has {len(fast)} tokens, the model {spec.vocab_size}")
    return {token: fast.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}


# ---------------------------------------------------------------------------------------------------- model


def _hf_config(spec: ModelSpec, ids: dict[str, int]) -> Any:
    """The transformers config object for the spec, with the tokenizer's special token ids."""
    import transformers

    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": spec.rope_theta}
    if spec.rope_scaling == "llama3":
        # Llama 3.1's factors; the original context is 1/8 of max_position so all three frequency bands
        # (kept, smoothed, scaled) occur at small head dims too.
        original = max(2, spec.max_position // 8)
        rope = {
            "rope_type": "llama3",
            "rope_theta": spec.rope_theta,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": original,
        }
    common: dict[str, Any] = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.resolved_intermediate_size,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.resolved_head_dim,
        hidden_act="silu",
        max_position_embeddings=spec.max_position,
        initializer_range=spec.resolved_initializer_range,
        rms_norm_eps=1e-6,
        tie_word_embeddings=spec.tied,
        rope_parameters=rope,
        bos_token_id=ids[BOS],
        eos_token_id=ids[EOS],
        # pad_token_id stays None: transformers would zero that embedding row (padding_idx).
    )
    if spec.arch == "llama":
        return transformers.LlamaConfig(**common, attention_bias=False, mlp_bias=False)
    if spec.arch == "mistral":
        # sliding_window=None: every layer attends to the whole context (Mistral's default 4096 would window).
        return transformers.MistralConfig(**common, sliding_window=None)
    return transformers.Qwen2Config(
        **common, use_sliding_window=False, sliding_window=None, max_window_layers=spec.layers
    )


def _build_model(spec: ModelSpec, ids: dict[str, int]) -> Any:
    """The *ForCausalLM with seeded random weights, in the spec's dtype, with its generation config."""
    import torch
    import transformers

    config = _hf_config(spec, ids)
    cls = getattr(transformers, ARCHITECTURES[spec.arch])
    # fork_rng: seeding must not disturb the caller's random stream (tests, benches).
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = cls(config)
        if spec.arch == "qwen2":
            # Initialised to zero by transformers; random biases make the q/k/v bias path matter.
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if name.endswith(".bias"):
                        param.normal_(0.0, spec.resolved_initializer_range)
    model = model.to(getattr(torch, spec.dtype)).eval()
    model.config.dtype = spec.dtype
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=ids[BOS], eos_token_id=[ids[EOS], ids[IM_END]], pad_token_id=ids[EOS]
    )
    return model


# ---------------------------------------------------------------------------------------------------- writer


@contextlib.contextmanager
def _no_progress_bars() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _is_empty_dir(path: Path) -> bool:
    return path.is_dir() and not any(path.iterdir())


def _check_target(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ModelSpecError("--out", f"{out} exists and is not a directory")
    if out.is_dir() and not _is_empty_dir(out):
        if not force:
            raise ModelSpecError("--out", f"{out} is not empty; pass --force to replace the model in it")
        if not (out / "config.json").is_file():
            # --force deletes the directory: only ever one that holds a model.
            raise ModelSpecError("--out", f"{out} is not empty and holds no config.json; refusing to replace it")


def _human(nbytes: int) -> str:
    if nbytes < 1024:
        return f"{nbytes} B"
    value = float(nbytes)
    for unit in ("KiB", "MiB", "GiB"):
        value /= 1024
        if value < 1024 or unit == "GiB":
            break
    return f"{value:.1f} {unit}"


def write_model(
    out: str | Path,
    *,
    arch: str = "llama",
    hidden_size: int = 256,
    intermediate_size: int | None = None,
    layers: int = 4,
    heads: int = 8,
    kv_heads: int = 4,
    head_dim: int | None = None,
    vocab_size: int = 4096,
    max_position: int = 4096,
    rope_theta: float = 10000.0,
    rope_scaling: str = "none",
    tie_embeddings: bool | None = None,
    dtype: str = "float32",
    seed: int = 0,
    max_shard_size: int | str | None = None,
    initializer_range: float | None = None,
    force: bool = False,
    quiet: bool = False,
) -> Path:
    """Write a random-weight checkpoint into `out` and return it; ModelSpecError for bad options.

    The files are written into a temporary sibling directory and renamed into place, so `out` never holds
    a half-written model. `tie_embeddings=None` ties for qwen2 only; `initializer_range=None` aims the
    logits at a std of ~4 (see TARGET_LOGIT_STD); `max_shard_size` ("1MiB", bytes) shards the weights.
    """
    spec = ModelSpec(
        arch=arch,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=vocab_size,
        max_position=max_position,
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        tie_embeddings=tie_embeddings,
        dtype=dtype,
        seed=seed,
        initializer_range=initializer_range,
    )
    spec.validate()
    shard_bytes = None
    if max_shard_size is not None:
        try:
            shard_bytes = parse_size(max_shard_size) if isinstance(max_shard_size, str) else int(max_shard_size)
        except ValueError as exc:
            raise ModelSpecError("--max-shard-size", str(exc)) from None
        if shard_bytes < 1:
            raise ModelSpecError("--max-shard-size", "--max-shard-size must be positive")
    out = Path(out).expanduser().absolute()
    _check_target(out, force)
    say = (lambda _msg: None) if quiet else click.echo
    out.parent.mkdir(parents=True, exist_ok=True)

    started = time.perf_counter()
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    staging.chmod(0o755)  # mkdtemp's 0700 would follow the directory through the rename
    try:
        say(f"training a byte-level BPE tokenizer ({spec.vocab_size} tokens)")
        ids = _write_tokenizer(staging, spec)
        say(f"building {ARCHITECTURES[spec.arch]} with random weights (seed {spec.seed})")
        model = _build_model(spec, ids)
        say("writing config.json, generation_config.json and safetensors weights")
        with _no_progress_bars():  # our own progress lines say what is written; tqdm output would garble them
            model.save_pretrained(str(staging), **({"max_shard_size": shard_bytes} if shard_bytes else {}))
        _replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if not quiet:
        files = sorted(p for p in out.iterdir() if p.is_file())
        total = sum(p.stat().st_size for p in files)
        params = sum(p.numel() for p in model.parameters())
        say(f"wrote {out} in {time.perf_counter() - started:.1f} s")
        say(
            f"  arch {spec.arch} ({ARCHITECTURES[spec.arch]}), {params:,} parameters, {spec.dtype}, "
            f"{'tied' if spec.tied else 'untied'} embeddings"
        )
        say(
            f"  {spec.layers} layers, hidden {spec.hidden_size}, intermediate {spec.resolved_intermediate_size}, "
            f"{spec.heads} heads / {spec.kv_heads} kv heads of {spec.resolved_head_dim}, "
            f"rope {spec.rope_scaling} theta {spec.rope_theta:g}, max position {spec.max_position}"
        )
        say(
            f"  vocab {spec.vocab_size}: bos {ids[BOS]}, eos {ids[EOS]}, im_start {ids[IM_START]}, im_end {ids[IM_END]}"
        )
        for path in files:
            say(f"  {path.name:<40} {_human(path.stat().st_size):>12}")
        say(f"  {len(files)} files, {total:,} bytes ({_human(total)})")
    return out


def _replace(staging: Path, out: Path) -> None:
    """Move the finished staging directory to `out`, replacing an empty or (checked) model directory."""
    if out.is_dir():
        if _is_empty_dir(out):
            out.rmdir()
        else:
            shutil.rmtree(out)
    os.replace(staging, out)


# ------------------------------------------------------------------------------------------- default model


def default_model_dir() -> Path:
    """Where the default model lives: $PAGEDKV_HOME/models/default-llama (~/.cache/pagedkv by default)."""
    home = os.environ.get("PAGEDKV_HOME") or Path.home() / ".cache" / "pagedkv"
    return Path(home).expanduser() / "models" / DEFAULT_MODEL_NAME


def _is_complete(path: Path) -> bool:
    from executor.checkpoint import CheckpointError, weight_files

    names = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
    if not all((path / name).is_file() for name in names):
        return False
    try:
        weight_files(path)
    except CheckpointError:
        return False
    return True


def ensure_default_model(path: str | Path | None = None) -> Path:
    """The default small llama model (write_model's defaults), generated on first use and reused after.

    write_model stages into a temporary directory and renames it, so a model found here is complete; two
    processes racing both generate and the loser of the rename uses the winner's identical files.
    """
    target = Path(path).expanduser() if path is not None else default_model_dir()
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.build.", dir=target.parent))
    try:
        built = write_model(staging / "model", quiet=True)
        try:
            os.rename(built, target)
        except OSError as exc:
            if not _is_complete(target):  # not a lost race: something else is in the way
                raise RuntimeError(f"{target} exists but holds no complete model; remove it") from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


# ------------------------------------------------------------------------------------------------------ CLI


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
    default=10000.0,
    show_default=True,
    help="Rotary embedding base.",
)
@click.option(
    "--rope-scaling",
    type=click.Choice(ROPE_SCALINGS),
    default="none",
    show_default=True,
    help="llama3: Llama 3.1 frequency scaling (factor 8, original context max-position / 8).",
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
        write_model(out, force=force, **options)
    except ModelSpecError as exc:
        raise click.BadParameter(str(exc), param_hint=f"'{exc.option}'") from None


__all__ = [
    "ARCHITECTURES",
    "ModelSpec",
    "ModelSpecError",
    "default_model_dir",
    "ensure_default_model",
    "make_model",
    "tokenizer_corpus",
    "train_tokenizer",
    "write_model",
]
