"""Text in and out: prompts to token ids (chat template included), token ids back to text as they stream.

`Tokenizer` is the checkpoint's tokenizer as transformers' AutoTokenizer builds it, resolved once in a child process
(common.tokenizer_cache) and run here with the `tokenizers` library, without transformers, which would import
torch: encoding, decoding and chat prompts come out as AutoTokenizer gives them (tests compare the two).

`Detokenizer` turns a growing list of token ids into text increments without ever splitting a multi-byte
character: byte-level BPE tokens can end mid-character, and such a tail decodes to U+FFFD until the next token
completes it, so text is released only up to the last complete character. It decodes a short window (the
tokens since the last release plus a few before, for context such as leading spaces), not the whole output.

`StopMatcher` finds stop strings in that text. Text that could still be the start of a stop string is held back
until it is either ruled out or completed, so a client never sees any part of the stop string.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as Backend

from common import tokenizer_cache
from gateway import chat_template

_REPLACEMENT = "\ufffd"
# transformers' `clean_up_tokenization`, applied on decode when the config asks for it (never for BPE models).
_CLEAN_UPS = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)


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


def clean_up_tokenization(text: str) -> str:
    """transformers' clean-up of decoded text: no space before punctuation and English contractions."""
    for before, after in _CLEAN_UPS:
        text = text.replace(before, after)
    return text


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


class Tokenizer:
    """The model's tokenizer and chat template, as transformers' AutoTokenizer has them (no download).

    The tokenizer is transformers': common.tokenizer_cache resolves it once per checkpoint in a child process
    (AutoTokenizer picks the class, which may rebuild tokenizer.json's pipeline, add BOS/EOS and special tokens)
    and hands over the backend pipeline it built with the facts applied around it (named special tokens, special
    ids, clean-up on decode); `resolution` gives one directly (common.tokenizer_resolution.resolve). The chat
    templates are read from the checkpoint (chat_template.jinja, then tokenizer_config.json), as transformers
    reads them, and rendered by gateway.chat_template.
    """

    def __init__(self, model_dir: Path | str, resolution: Mapping[str, Any] | None = None) -> None:
        model_dir = Path(model_dir)
        resolution = tokenizer_cache.resolve(model_dir) if resolution is None else resolution
        self.tokenizer_class = str(resolution.get("tokenizer_class") or "PreTrainedTokenizerFast")
        self.backend = Backend.from_str(resolution["tokenizer"])
        self.backend.encode_special_tokens = bool(resolution.get("split_special_tokens", False))
        config = _read_json(model_dir / "tokenizer_config.json")
        if "added_tokens_decoder" not in config:  # older checkpoints keep the special tokens in their own file
            config = {**config, **_read_json(model_dir / "special_tokens_map.json")}
        self.config = config
        # The named special tokens (bos_token, ...): what chat templates see, as in apply_chat_template.
        self.special_tokens: dict[str, str] = {
            str(key): str(value) for key, value in dict(resolution.get("special_tokens") or {}).items()
        }
        self.special_ids = {int(i) for i in resolution.get("all_special_ids") or ()}
        self.vocab_size = self.backend.get_vocab_size(with_added_tokens=True)
        self._byte_level = type(self.backend.decoder).__name__ == "ByteLevel"
        # SentencePiece-style byte fallback: <0x00>..<0xFF> stand for bytes the vocabulary has no token for.
        fallback = bool(resolution.get("byte_fallback", False))
        byte_ids = ((self.backend.token_to_id(f"<0x{b:02X}>"), b) for b in range(256)) if fallback else ()
        self._fallback_bytes = {i: b for i, b in byte_ids if i is not None}
        self.fallback_byte_ids = frozenset(self._fallback_bytes)
        self._clean_up = bool(resolution.get("clean_up_tokenization_spaces", False))
        self.chat_templates = chat_template.find_templates(model_dir, config)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        add_special_tokens: bool = False,
        continue_final_message: bool = False,
    ) -> list[int]:
        """The prompt of a chat: the model's template rendered (with `tools` and `documents`, if given, for
        templates that show them) and encoded as is; the template writes any BOS and turn markers itself
        (`add_special_tokens` adds the tokenizer's own on top, as vLLM's option does). `continue_final_message`:
        the prompt ends right after the last message's text, so the model continues it."""
        text = self.render_chat(messages, add_generation_prompt, tools, documents, continue_final_message)
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
    ) -> str:
        """The chat template's text for these messages (what `encode_chat` encodes)."""
        try:
            template = chat_template.pick_template(self.chat_templates, tools)
            if template is None:
                raise PromptError("this model has no chat template: use /v1/completions with a plain prompt")
            text = chat_template.render(
                template,
                messages,
                add_generation_prompt=add_generation_prompt,
                special_tokens=self.special_tokens,
                tools=tools,
                documents=documents,
            )
        except chat_template.ChatTemplateError as exc:  # the template refused them
            raise PromptError(f"the chat template could not render these messages: {exc}") from None
        if continue_final_message:  # as transformers: cut after the final message's own text
            final = messages[-1].get("content")
            final = final.strip() if isinstance(final, str) else ""
            cut = text.rfind(final) if final else -1
            if cut < 0:
                raise PromptError("continue_final_message: the final message's text is not in the rendered prompt")
            text = text[: cut + len(final)]
        return text

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of these tokens, as transformers' `decode` gives it."""
        text = self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        return clean_up_tokenization(text) if self._clean_up else text

    def id_to_token(self, token_id: int) -> str | None:
        """The token's own spelling in the vocabulary (byte-level: its bytes as stand-in characters)."""
        return self.backend.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (byte-level BPE and byte-fallback tokens can be part of a character)."""
        if token_id in self._fallback_bytes:
            return bytes([self._fallback_bytes[token_id]])
        if self._byte_level:
            piece = self.backend.id_to_token(token_id)
            if piece is not None and token_id not in self.special_ids and all(ch in _UNICODE_TO_BYTE for ch in piece):
                return bytes(_UNICODE_TO_BYTE[ch] for ch in piece)
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def token_text(self, token_id: int) -> str:
        """One token on its own, as logprobs show it: its text, or `bytes:\\x..` for part of a character."""
        raw = self.token_bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def detokenizer(self, prompt: Sequence[int] = (), skip_special_tokens: bool = True) -> Detokenizer:
        return Detokenizer(self, prompt, skip_special_tokens)


class Detokenizer:
    # Tokens decoded before the unreleased ones, so that the window decodes them as it would in context.
    CONTEXT_TOKENS = 4

    def __init__(self, tokenizer: Tokenizer, prompt: Sequence[int] = (), skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(prompt[-self.CONTEXT_TOKENS :])
        self._released = len(self._ids)  # tokens whose text has been released
        self._window = 0
        self._move_window()

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _move_window(self) -> None:
        """The window starts CONTEXT_TOKENS back, or further back, at the start of a run of byte-fallback tokens
        (a decoder turns a run into text as a whole: cut, it would decode to U+FFFD)."""
        byte_ids = self._tokenizer.fallback_byte_ids
        start = max(self._window, len(self._ids) - self.CONTEXT_TOKENS)
        while start > self._window and self._ids[start - 1] in byte_ids and self._ids[start] in byte_ids:
            start -= 1
        self._window = start

    def _texts(self) -> tuple[str, str]:
        """The window's text up to the release point and to the end. When the new tokens change text already
        released (bytes that are not UTF-8 inside a byte-fallback run: the decoder then replaces every byte of
        the run), the new tokens are decoded on their own from the release point."""
        before = self._decode(self._ids[self._window : self._released])
        text = self._decode(self._ids[self._window :])
        if not _extends(text, before):
            self._window = self._released
            before, text = "", self._decode(self._ids[self._released :])
        return before, text

    def add(self, token_ids: Sequence[int]) -> str:
        """The text that the new tokens complete (possibly empty)."""
        self._ids.extend(token_ids)
        before, text = self._texts()
        if text.endswith(_REPLACEMENT):
            return ""  # mid-character: wait for the token that completes it
        self._released = len(self._ids)
        self._move_window()
        return text[len(before) :]

    def flush(self) -> str:
        """At the end of the output: whatever is left, an incomplete character included."""
        before, text = self._texts()
        self._released = len(self._ids)
        return text[len(before) :]


def _extends(text: str, before: str) -> bool:
    """Whether `text` continues `before`. A prompt of token ids can end mid-character: its context then decodes
    to U+FFFD at the end, which the output completes (that character stays the prompt's)."""
    return text.startswith(before) or (
        before.endswith(_REPLACEMENT) and len(text) >= len(before) and text.startswith(before[:-1])
    )


class StopMatcher:
    """Cuts generated text at the first stop string."""

    def __init__(self, stops: Sequence[str], include_stop: bool = False) -> None:
        self.stops = [s for s in stops if s]
        self.include_stop = include_stop  # vLLM's include_stop_str_in_output: the stop string is released too
        self._held = ""
        self.stopped = False
        self.stop_string: str | None = None  # the one that stopped it

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
            at, stop = min(hits)
            self.stop_string = stop
            return buffer[: at + len(stop)] if self.include_stop else buffer[:at]
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
