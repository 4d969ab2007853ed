"""Text in and out: prompts to token ids (chat template included), token ids back to text as they stream.

`Detokenizer` turns a growing list of token ids into text increments without ever splitting a multi-byte
character: byte-level BPE tokens can end mid-character, and such a tail decodes to U+FFFD until the next token
completes it, so text is released only up to the last complete character. It decodes a short window (the
tokens since the last release plus a few before, for context such as leading spaces), not the whole output.

`StopMatcher` finds stop strings in that text. Text that could still be the start of a stop string is held back
until it is either ruled out or completed, so a client never sees any part of the stop string.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jinja2
from transformers import AutoTokenizer, PreTrainedTokenizerBase

_REPLACEMENT = "\ufffd"


def _byte_to_unicode() -> dict[int, str]:
    """Byte-level BPE's alphabet: printable bytes stand for themselves, the others for code points from 256 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


_UNICODE_TO_BYTE = {ch: b for b, ch in _byte_to_unicode().items()}


class PromptError(ValueError):
    """The messages or prompt cannot be turned into tokens (for example, no chat template)."""


class Tokenizer:
    """The model's tokenizer and chat template, loaded from the checkpoint directory (no download)."""

    def __init__(self, model_dir: Path | str) -> None:
        self.hf: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        self.vocab_size = len(self.hf)
        self._special_ids = set(self.hf.all_special_ids)
        decoder = getattr(getattr(self.hf, "backend_tokenizer", None), "decoder", None)
        self._byte_level = type(decoder).__name__ == "ByteLevel"

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=True))

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        if not self.hf.chat_template:
            raise PromptError("this model has no chat template: use /v1/completions with a plain prompt")
        try:
            text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        except (jinja2.TemplateError, ValueError, TypeError, KeyError) as exc:  # the template refused them
            raise PromptError(f"the chat template could not render these messages: {exc}") from None
        # The template writes any special tokens (BOS, turn markers) itself.
        return list(self.hf.encode(text, add_special_tokens=False))

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (byte-level BPE tokens can be part of a character)."""
        if self._byte_level:
            piece = self.hf.convert_ids_to_tokens(token_id)
            if token_id not in self._special_ids and all(ch in _UNICODE_TO_BYTE for ch in piece):
                return bytes(_UNICODE_TO_BYTE[ch] for ch in piece)
        return self.hf.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def token_text(self, token_id: int) -> str:
        """One token on its own, as logprobs show it: its text, or `bytes:\\x..` for part of a character."""
        raw = self.token_bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def detokenizer(self, prompt: Sequence[int] = ()) -> Detokenizer:
        return Detokenizer(self.hf, prompt)


class Detokenizer:
    # Tokens decoded before the unreleased ones, so that the window decodes them as it would in context.
    CONTEXT_TOKENS = 4

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt: Sequence[int] = ()) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = list(prompt[-self.CONTEXT_TOKENS :])
        self._released = len(self._ids)  # tokens whose text has been released
        self._window = max(0, self._released - self.CONTEXT_TOKENS)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_ids: Sequence[int]) -> str:
        """The text that the new tokens complete (possibly empty)."""
        self._ids.extend(token_ids)
        before = self._decode(self._ids[self._window : self._released])
        text = self._decode(self._ids[self._window :])
        if text.endswith(_REPLACEMENT) or not _extends(text, before):
            return ""  # mid-character: wait for the token that completes it
        self._window = max(self._window, len(self._ids) - self.CONTEXT_TOKENS)
        self._released = len(self._ids)
        return text[len(before) :]

    def flush(self) -> str:
        """At the end of the output: whatever is left, an incomplete character included."""
        before = self._decode(self._ids[self._window : self._released])
        text = self._decode(self._ids[self._window :])
        self._released = len(self._ids)
        return text[len(before) :] if _extends(text, before) else ""


def _extends(text: str, before: str) -> bool:
    """Whether `text` continues `before`. A prompt of token ids can end mid-character: its context then decodes
    to U+FFFD at the end, which the output completes (that character stays the prompt's)."""
    return text.startswith(before) or (
        before.endswith(_REPLACEMENT) and len(text) >= len(before) and text.startswith(before[:-1])
    )


class StopMatcher:
    """Cuts generated text at the first stop string."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """The text that may be released now; sets `stopped` when a stop string completes."""
        if self.stopped:
            return ""
        if not self.stops:
            return text
        buffer = self._held + text
        hits = [(buffer.find(s), s) for s in self.stops if s in buffer]
        if hits:
            self.stopped = True
            self._held = ""
            return buffer[: min(hits)[0]]
        keep = self._longest_partial_stop(buffer)
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """The output ended without a stop string: release what was held."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _longest_partial_stop(self, buffer: str) -> int:
        """Length of the longest end of `buffer` that is a proper start of some stop string."""
        best = 0
        for stop in self.stops:
            for length in range(min(len(stop) - 1, len(buffer)), best, -1):
                if buffer.endswith(stop[:length]):
                    best = length
                    break
        return best
