"""Structured output with xgrammar: a request's constraint (a JSON schema, regex, choice or EBNF grammar,
`executor.params.GrammarSpec`) compiled against the checkpoint's tokenizer, a grammar matcher per sequence, and
the token bitmask of every constrained row of a batch applied to the batch's logits in one masked op.

Compilation never runs on the step's thread: `Grammars.compile` hands it to a small thread pool and returns a
future, kept in an LRU cache keyed by the spec, so the same schema is compiled once (cache hits are counted).
The first structured request also builds the compiler itself there (xgrammar's import, the tokenizer and its
`TokenizerInfo`), so an executor that never sees one pays nothing, not even the import.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import structlog
import torch

from executor.params import GrammarSpec

log = structlog.get_logger("executor")

DEFAULT_CACHE_SIZE = 256
_JSON_OBJECT_SCHEMA = '{"type": "object"}'
# Whitespace characters allowed between two JSON elements: room for a newline and indentation (as llama.cpp's
# JSON grammars allow), not for the endless runs of blanks a weak or unlucky model can fall into under "any".
MAX_WHITESPACE = 20


class GrammarRejected(ValueError):
    """The constraint is not valid (a bad schema, regex or grammar): the request is refused as invalid."""


class GrammarUnavailable(RuntimeError):
    """Structured output cannot run on this executor (no tokenizer, xgrammar broken): an internal error."""


def _xgrammar() -> Any:
    import xgrammar

    return xgrammar


def build_grammar(spec: GrammarSpec) -> Any:
    """The spec as an `xgrammar.Grammar`; raises GrammarRejected (naming the parameter) if it is not valid."""
    xgr = _xgrammar()
    what = spec.param or "the structured output constraint"
    try:
        if spec.kind == "json":
            try:
                json.loads(spec.source)
            except ValueError as exc:
                raise GrammarRejected(f"{what} is not valid JSON: {exc}") from None
            return _strict_strings(xgr.Grammar.from_json_schema(spec.source, **_whitespace(spec)))
        if spec.kind == "json_object":  # any JSON object (OpenAI's json_object), not an array or a scalar
            return xgr.Grammar.from_json_schema(_JSON_OBJECT_SCHEMA, strict_mode=False, **_whitespace(spec))
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.source)
        if spec.kind == "choice":
            return xgr.Grammar.from_ebnf(_choice_ebnf(spec.source, what))
        if spec.kind == "grammar":
            return xgr.Grammar.from_ebnf(spec.source)
    except RuntimeError as exc:  # xgrammar's parse errors: "[time] file.cc:line: message"
        raise GrammarRejected(f"{what} is not valid: {_clean(str(exc))}") from None
    raise GrammarRejected(f"unknown structured output kind {spec.kind!r}")


# xgrammar 0.2.9 writes the characters of a string with minLength/maxLength as [^"\\\r\n] (EBNF): control characters,
# which JSON forbids unescaped, slip through (its unbounded strings exclude them). Such grammars are rewritten.
_LOOSE_STRING_CHARS = r"[^\"\\\r\n]"
_STRICT_STRING_CHARS = r"[^\0-\x1f\"\\]"


def _strict_strings(grammar: Any) -> Any:
    text = str(grammar)
    if _LOOSE_STRING_CHARS not in text:
        return grammar
    return _xgrammar().Grammar.from_ebnf(text.replace(_LOOSE_STRING_CHARS, _STRICT_STRING_CHARS))


def _whitespace(spec: GrammarSpec) -> dict[str, Any]:
    """Whitespace runs between JSON's elements (asked for with any_whitespace), up to MAX_WHITESPACE characters a
    gap; or none beyond ", " and ": " (the gateway's default: see gateway.structured)."""
    if spec.any_whitespace:
        return {"any_whitespace": True, "max_whitespace_cnt": MAX_WHITESPACE}
    return {"any_whitespace": False}


def _choice_ebnf(source: str, what: str) -> str:
    try:
        choices = json.loads(source)
    except ValueError:
        choices = None
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise GrammarRejected(f"{what} must be a non-empty list of strings")
    # JSON's string escapes (\" \\ \n \uXXXX) are ones xgrammar's EBNF string literals read alike.
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in dict.fromkeys(choices))


def _clean(message: str) -> str:
    """xgrammar's error text without its timestamp and C++ source location."""
    message = message.strip()
    if message.startswith("[") and ": " in message:
        head, _, rest = message.partition(": ")
        if ".cc:" in head or ".h:" in head:
            message = rest
    return message.splitlines()[0] if message else "invalid"


class Grammars:
    """Compiled grammars for one checkpoint: compiled off the step's thread, cached per spec (LRU)."""

    def __init__(
        self,
        model_dir: str | Path | None,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        *,
        cache_size: int = DEFAULT_CACHE_SIZE,
        workers: int = 1,
    ) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.cache_size = cache_size
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grammar-compile")
        self.cache: OrderedDict[tuple[str, str, bool], Future[Any]] = OrderedDict()
        self.hits = 0
        self.misses = 0
        self._compiler: Any = None
        self._compiler_lock = threading.Lock()

    def compile(self, spec: GrammarSpec) -> Future[Any]:
        """A future of the spec's `xgrammar.CompiledGrammar` (raising GrammarRejected if the spec is invalid,
        GrammarUnavailable if this executor cannot compile at all); the same spec gets the same future."""
        key = spec.key
        future = self.cache.get(key)
        if future is not None and not (future.done() and isinstance(future.exception(), GrammarUnavailable)):
            self.cache.move_to_end(key)
            self.hits += 1
            return future
        self.misses += 1
        future = self.pool.submit(self._compile, spec)
        self.cache[key] = future
        while len(self.cache) > self.cache_size:
            self.cache.popitem(last=False)
        return future

    def _compile(self, spec: GrammarSpec) -> Any:
        compiler = self._get_compiler()
        started = time.perf_counter()
        grammar = build_grammar(spec)
        compiled = compiler.compile_grammar(grammar)
        log.info(
            "grammar_compiled",
            kind=spec.kind,
            chars=len(spec.source),
            compile_ms=round((time.perf_counter() - started) * 1000, 1),
            cache_hits=self.hits,
            cache_misses=self.misses,
        )
        return compiled

    def _get_compiler(self) -> Any:
        with self._compiler_lock:
            if self._compiler is None:
                self._compiler = self._build_compiler()
            return self._compiler

    def _build_compiler(self) -> Any:
        if self.model_dir is None:
            raise GrammarUnavailable("structured output needs the checkpoint's tokenizer, which this executor lacks")
        try:
            xgr = _xgrammar()
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir), local_files_only=True)
            info = xgr.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.eos_token_ids or None
            )
            threads = max(1, min(8, os.cpu_count() or 1))
            compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        except Exception as exc:
            log.error("grammar_compiler_failed", model=str(self.model_dir), error=str(exc))
            raise GrammarUnavailable(f"structured output is unavailable on this executor: {exc}") from exc
        log.info("grammar_compiler_ready", model=str(self.model_dir), vocab_type=str(info.vocab_type))
        return compiler

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def new_matcher(compiled: Any) -> Any:
    """A fresh `xgrammar.GrammarMatcher` for one sequence, at the grammar's start."""
    return _xgrammar().GrammarMatcher(compiled)


class BitmaskApplier:
    """Fills the token bitmask of a batch's constrained rows (one matcher each) and applies it to the logits
    in one masked op. The CPU buffer is kept from step to step."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def __call__(self, logits: torch.Tensor, rows: Sequence[int], matchers: Sequence[Any]) -> None:
        """Set to -inf, in place, the logits of `rows` that their matcher does not allow next."""
        xgr = _xgrammar()
        batch, vocab = logits.shape
        words = (vocab + 31) // 32
        buffer = self._buffer
        if buffer is None or buffer.shape[0] < batch or buffer.shape[1] != words:
            buffer = self._buffer = xgr.allocate_token_bitmask(max(batch, 8), vocab)
        for row, matcher in zip(rows, matchers):
            matcher.fill_next_token_bitmask(buffer, row)
        bitmask = buffer[:batch]
        if logits.device.type != "cpu":
            bitmask = bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=list(rows))
