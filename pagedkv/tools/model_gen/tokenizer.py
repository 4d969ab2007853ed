"""A byte-level BPE tokenizer trained locally, written as tokenizer.json and its config files."""

from __future__ import annotations

import functools
import json
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
