"""A byte-level BPE tokenizer trained locally, written as tokenizer.json and its config files."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedkv.tools.model_gen.corpus import tokenizer_corpus
from pagedkv.tools.model_gen.spec import (
    BOS,
    CHAT_TEMPLATE,
    EOS,
    IM_END,
    IM_START,
    SPECIAL_TOKENS,
    ModelSpec,
)

# transformers 5 loads any qwen2 checkpoint's tokenizer through Qwen2Tokenizer, which rebuilds the pipeline
# as NFC + this split + ByteLevel whatever tokenizer.json says; qwen2 models get that pipeline in
# tokenizer.json too, so every reader of the file tokenizes as transformers does.
QWEN_TOKENIZER = ("qwen2", "qwen3", "qwen3_moe")  # the families transformers tokenizes with Qwen2Tokenizer
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

    return Tokenizer.from_str(_trained_tokenizer_json(vocab_size, seed, arch in QWEN_TOKENIZER))


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


# ---------------------------------------------------------------------------------------------- each family's class
# Tokenizers written the way each family's checkpoints ship them (tokenizer.json, and a tokenizer_config.json
# naming the class transformers loads them through), trained here: tests compare the gateway with AutoTokenizer
# on every class, including those that rebuild what tokenizer.json says (Qwen2Tokenizer, LlamaTokenizer,
# GemmaTokenizer).

# Llama 3's split (digits in threes) and o200k's (gpt-oss: case-aware words, contractions attached).
LLAMA3_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
    r"""|\s+(?!\S)|\s+"""
)
O200K_SPLIT = (
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"""
    r"""|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"""
    r"""|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_TEMPLATES = {
    "llama3": (
        "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
        "{{ m.content | trim }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    ),
    "llama2": (
        "{{ bos_token }}{% for m in messages %}{% if m.role == 'assistant' %} {{ m.content | trim }} {{ eos_token }}"
        "{% else %}[INST] {{ m.content | trim }} [/INST]{% endif %}{% endfor %}"
    ),
    "phi3": (
        "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}<|end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% else %}{{ eos_token }}{% endif %}"
    ),
    "gemma": (
        "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}\n"
        "{{ m.content | trim }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n"
        "{% endif %}"
    ),
    "gpt_oss": (
        "{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
    ),
    "chatml": _CHATML,
}


@dataclass(frozen=True)
class FamilyTokenizer:
    """How one family's checkpoints ship their tokenizer."""

    tokenizer_class: str  # as tokenizer_config.json names it
    model_type: str  # config.json's, which AutoTokenizer reads too
    pipeline: str  # "byte_level" (GPT-2 style), "split" (a Split regex, then ByteLevel), "metaspace" (Llama 2's
    # SentencePiece BPE with byte fallback) or "gemma" (spaces replaced by ▁, byte fallback)
    special_tokens: tuple[str, ...]  # first in the vocabulary
    named: dict[str, str | None]  # bos_token, eos_token, ... for tokenizer_config.json
    template: str
    split: str = ""  # the "split" pipeline's regex
    add_bos: bool = False  # tokenizer.json's post-processor prepends the BOS
    config: dict[str, Any] = field(default_factory=dict)  # more tokenizer_config.json entries


_LLAMA2_SPECIAL = ("<unk>", "<s>", "</s>")
_LLAMA2_NAMED: dict[str, str | None] = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}
_SPM_CONFIG: dict[str, Any] = {"add_bos_token": True, "add_eos_token": False, "legacy": False}
_QWEN_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_QWEN_NAMED: dict[str, str | None] = {
    "bos_token": None,
    "eos_token": "<|im_end|>",
    "pad_token": "<|endoftext|>",
    "unk_token": None,
}
_GEMMA_SPECIAL = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>")
_GEMMA_NAMED: dict[str, str | None] = {
    "pad_token": "<pad>",
    "eos_token": "<eos>",
    "bos_token": "<bos>",
    "unk_token": "<unk>",
    "mask_token": "<mask>",
}
_LLAMA3_SPECIAL = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
_GPT_OSS_SPECIAL = ("<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|return|>")
_PHI3_SPECIAL = (*_LLAMA2_SPECIAL, "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")

FAMILY_TOKENIZERS: dict[str, FamilyTokenizer] = {
    "llama3": FamilyTokenizer(
        "PreTrainedTokenizerFast",
        "llama",
        "split",
        _LLAMA3_SPECIAL,
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
        _TEMPLATES["llama3"],
        split=LLAMA3_SPLIT,
        add_bos=True,
    ),
    "llama2": FamilyTokenizer(
        "LlamaTokenizer",
        "llama",
        "metaspace",
        _LLAMA2_SPECIAL,
        _LLAMA2_NAMED,
        _TEMPLATES["llama2"],
        add_bos=True,
        config=_SPM_CONFIG,
    ),
    "llama2_legacy": FamilyTokenizer(  # older Llama 2 configs: legacy Metaspace (a ▁ after special tokens too)
        "LlamaTokenizer",
        "llama",
        "metaspace",
        _LLAMA2_SPECIAL,
        _LLAMA2_NAMED,
        _TEMPLATES["llama2"],
        add_bos=True,
        config={**_SPM_CONFIG, "legacy": True},
    ),
    "mistral": FamilyTokenizer(
        "LlamaTokenizer",
        "mistral",
        "metaspace",
        _LLAMA2_SPECIAL,
        _LLAMA2_NAMED,
        _TEMPLATES["llama2"],
        add_bos=True,
        config=_SPM_CONFIG,
    ),
    "phi3": FamilyTokenizer(
        "LlamaTokenizer",
        "phi3",
        "metaspace",
        _PHI3_SPECIAL,
        {**_LLAMA2_NAMED, "eos_token": "<|endoftext|>"},
        _TEMPLATES["phi3"],
        add_bos=False,
        config={**_SPM_CONFIG, "add_bos_token": False},
    ),
    "qwen2": FamilyTokenizer(
        "Qwen2Tokenizer",
        "qwen2",
        "byte_level",
        _QWEN_SPECIAL,
        _QWEN_NAMED,
        _CHATML,
        config={"errors": "replace", "split_special_tokens": False, "add_prefix_space": False},
    ),
    "qwen3": FamilyTokenizer(
        "Qwen2Tokenizer",
        "qwen3",
        "byte_level",
        _QWEN_SPECIAL,
        _QWEN_NAMED,
        _CHATML,
        config={"errors": "replace", "split_special_tokens": False, "add_prefix_space": False},
    ),
    "gemma2": FamilyTokenizer(
        "GemmaTokenizer",
        "gemma2",
        "gemma",
        _GEMMA_SPECIAL,
        _GEMMA_NAMED,
        _TEMPLATES["gemma"],
        add_bos=True,
        config={"add_bos_token": True, "add_eos_token": False},
    ),
    "gemma3": FamilyTokenizer(
        "GemmaTokenizer",
        "gemma3_text",
        "gemma",
        _GEMMA_SPECIAL,
        _GEMMA_NAMED,
        _TEMPLATES["gemma"],
        add_bos=True,
        config={"add_bos_token": True, "add_eos_token": False},
    ),
    "gpt_oss": FamilyTokenizer(
        "PreTrainedTokenizerFast",
        "gpt_oss",
        "split",
        _GPT_OSS_SPECIAL,
        {"bos_token": "<|startoftext|>", "eos_token": "<|return|>", "pad_token": "<|endoftext|>"},
        _TEMPLATES["gpt_oss"],
        split=O200K_SPLIT,
    ),
    "phi4": FamilyTokenizer(
        "GPT2Tokenizer",
        "phi3",
        "split",
        ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|im_sep|>"),
        {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None},
        _CHATML,
        split=O200K_SPLIT,
    ),
    "generic": FamilyTokenizer(
        "PreTrainedTokenizerFast",
        "llama",
        "byte_level",
        ("<|begin_of_text|>", "<|end_of_text|>"),
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"},
        _CHATML,
    ),
}


def write_family_tokenizer(out: Path, family: str, vocab_size: int = 640, seed: int = 0) -> Path:
    """`family`'s tokenizer files in `out` (and a config.json naming its model type, if `out` has none)."""
    style = FAMILY_TOKENIZERS[family]
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(_family_tokenizer_json(family, vocab_size, seed), encoding="utf-8")
    config: dict[str, Any] = {
        "tokenizer_class": style.tokenizer_class,
        "chat_template": style.template,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "added_tokens_decoder": {
            str(i): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for i, t in enumerate(style.special_tokens)
        },
        **style.named,
        **style.config,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", "utf-8")
    if not (out / "config.json").is_file():
        (out / "config.json").write_text(json.dumps({"model_type": style.model_type}) + "\n", "utf-8")
    return out


@functools.lru_cache(maxsize=16)
def _family_tokenizer_json(family: str, vocab_size: int, seed: int) -> str:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    style = FAMILY_TOKENIZERS[family]
    if style.pipeline in ("metaspace", "gemma"):
        tokenizer = Tokenizer(_byte_fallback_bpe(style.special_tokens, vocab_size, seed))
        if style.pipeline == "metaspace":  # Llama 2's tokenizer.json: a ▁ before the text, spaces as ▁
            tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
            tail = [decoders.Strip(content=" ", left=1, right=0)]
        else:
            tokenizer.normalizer = normalizers.Replace(" ", "▁")
            tail = []
        tokenizer.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), *tail]
        )
    else:
        tokenizer = Tokenizer(models.BPE())
        level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=style.pipeline == "byte_level")
        # The split pipeline trains on its own pieces; Qwen's plain byte-level file trains on Qwen2's split, as
        # its real merges were, though the file then says only ByteLevel (which Qwen2Tokenizer overrides).
        pattern = style.split or QWEN2_SPLIT
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        tokenizer.decoder = decoders.ByteLevel()
        trainer = _bpe_trainer(vocab_size, style.special_tokens)
        tokenizer.train_from_iterator(tokenizer_corpus(seed, size=150_000), trainer)
        if style.split:
            tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(style.split), behavior="isolated"), level]
            )
        else:
            tokenizer.pre_tokenizer = level
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in style.special_tokens])
    if style.add_bos:
        bos = str(style.named["bos_token"])
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.token_to_id(bos))]
        )
    return tokenizer.to_str()


def _bpe_trainer(vocab_size: int, special_tokens: tuple[str, ...]) -> Any:
    from tokenizers import pre_tokenizers, trainers

    return trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )


def _byte_fallback_bpe(special_tokens: tuple[str, ...], vocab_size: int, seed: int) -> Any:
    """A SentencePiece-style BPE: the special tokens, the 256 byte tokens <0x00>.. for what the vocabulary lacks,
    then merges trained on ▁-prefixed words (rare characters are left to the byte tokens)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    trained = Tokenizer(models.BPE())
    trained.normalizer = normalizers.Replace(" ", "▁")
    trained.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    base = len(special_tokens) + 256
    trainer = trainers.BpeTrainer(vocab_size=max(vocab_size - base, 64), limit_alphabet=120, show_progress=False)
    trained.train_from_iterator(tokenizer_corpus(seed, size=150_000), trainer)
    model = json.loads(trained.to_str())["model"]
    vocab = {token: i for i, token in enumerate(special_tokens)}
    vocab.update({f"<0x{b:02X}>": len(special_tokens) + b for b in range(256)})
    for token, _ in sorted(model["vocab"].items(), key=lambda item: item[1]):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    unk = "<unk>" if "<unk>" in special_tokens else None
    return models.BPE(vocab, merges, unk_token=unk, byte_fallback=True, fuse_unk=True)
