"""The seeded, generated text the tokenizer is trained on (nothing read from disk)."""

from __future__ import annotations

import random

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
