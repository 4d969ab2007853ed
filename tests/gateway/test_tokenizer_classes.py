"""The gateway's tokenizer against transformers' AutoTokenizer on every family's tokenizer class.

Each family's tokenizer is trained here and written as its checkpoints ship it (pagedkv.tools.model_gen's
FAMILY_TOKENIZERS), including classes that rebuild what tokenizer.json says (Qwen2Tokenizer's split and NFC,
LlamaTokenizer's Metaspace, GemmaTokenizer's pipeline): ids, decoding, chat prompts and streamed detokenization
must all be transformers'. The resolution is made in this process (the gateway makes it in a child process).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as Backend
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from common.tokenizer_resolution import resolve
from gateway.text import Tokenizer
from pagedkv.tools.model_gen.tokenizer import FAMILY_TOKENIZERS, write_family_tokenizer

# Classes whose AutoTokenizer rebuilds the pipeline, so tokenizer.json read alone tokenizes otherwise.
REBUILT = {"qwen2", "qwen3", "llama2", "llama2_legacy"}
BYTE_FALLBACK = {
    "llama2",
    "llama2_legacy",
    "mistral",
    "phi3",
    "gemma2",
    "gemma3",
}  # SentencePiece-style <0x00>.. tokens
TEXTS = [
    "",
    "Hello world",
    "  leading and trailing spaces  ",
    "a  b   c    d",
    "digits 1234567890 3.14159 007 and 12,345.67",
    "héllo wörld: 日本語のテキスト, 한국어, emoji 😀👍🏽👩\u200d💻 and e\u0301 (NFD) vs \u00e9",
    "It's DON'T we've THEY'RE I'M you'll he'd",
    "tabs\tand\nnew lines\r\n\n\n and \u00a0 no-break spaces\n",
    "code: def f(x):\n    return x**2  # comment\n\n\tpass",
    "mixedCase WORDS and CamelCaseIdentifiers HTTPServer",
    " ",
    "\n",
]
CHATS = [
    [{"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello! 日本語? 12345"},
        {"role": "assistant", "content": "こんにちは 😀"},
        {"role": "user", "content": "  spaced   text \n\n"},
    ],
]
FAST = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


class Pair:
    def __init__(self, family: str, model_dir: Path) -> None:
        self.family = family
        self.model_dir = model_dir
        self.ours = Tokenizer(model_dir, resolution=resolve(model_dir))
        self.hf: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        self.special = list(FAMILY_TOKENIZERS[family].special_tokens)

    def texts(self) -> list[str]:
        """TEXTS, and this family's special tokens in text (whole, doubled, glued to words, cut short)."""
        first, last = self.special[0], self.special[-1]
        return [
            *TEXTS,
            f"special tokens in text: {' '.join(self.special)}",
            f"{first}{first}x{last}y {last} z",
            f"glued{last}word and half a token: {last[:-1]} {first[1:]}",
        ]


@pytest.fixture(scope="module", params=sorted(FAMILY_TOKENIZERS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Pair:
    family = request.param
    return Pair(family, write_family_tokenizer(tmp_path_factory.mktemp(f"tok-{family}"), family))


def stream(tokenizer: Tokenizer, ids: list[int], chunk: int, prompt: list[int], skip: bool) -> str:
    """Everything a detokenizer releases for `ids` fed `chunk` at a time after `prompt`, then flushed."""
    detokenizer = tokenizer.detokenizer(prompt, skip_special_tokens=skip)
    pieces = [detokenizer.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return "".join([*pieces, detokenizer.flush()])


def test_the_class_and_its_special_tokens_are_transformers(pair: Pair) -> None:
    ours, hf = pair.ours, pair.hf
    assert ours.tokenizer_class == type(hf).__name__
    assert ours.vocab_size == len(hf)
    assert ours.special_ids == set(hf.all_special_ids)
    assert ours.special_tokens == hf.special_tokens_map
    assert bool(ours.fallback_byte_ids) is (pair.family in BYTE_FALLBACK)


def test_ids_and_decoding_are_transformers(pair: Pair) -> None:
    ours, hf = pair.ours, pair.hf
    for text in pair.texts():
        for add in (True, False):
            ids = ours.encode(text, add_special_tokens=add)
            assert ids == hf.encode(text, add_special_tokens=add), (text, add)
            for skip in (False, True):
                assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("pair", sorted(REBUILT), indirect=True)
def test_classes_that_rebuild_the_pipeline_are_followed_not_tokenizer_json(pair: Pair) -> None:
    """The bug of the issue: tokenizer.json alone gives other ids for these classes; the gateway follows
    transformers (a Qwen2 tokenizer.json with a plain byte-level pre-tokenizer among them)."""
    raw = Backend.from_file(str(pair.model_dir / "tokenizer.json"))
    differ = [text for text in pair.texts() if raw.encode(text).ids != pair.hf.encode(text)]
    assert differ, "the test needs texts that tokenizer.json alone encodes otherwise"
    for text in differ:
        assert pair.ours.encode(text) == pair.hf.encode(text)


@FAST
@given(data=st.data())
def test_ids_of_any_text_are_transformers(pair: Pair, data: st.DataObject) -> None:
    pieces = st.one_of(
        st.text(st.characters(exclude_categories=("Cs",)), max_size=10),
        st.sampled_from([*pair.special, " ", "  ", "\n", "\r\n", "'S", "123", "日本", "😀", "e\u0301"]),
    )
    text = "".join(data.draw(st.lists(pieces, max_size=8)))
    ids = pair.ours.encode(text)
    assert ids == pair.hf.encode(text)
    assert pair.ours.decode(ids, skip_special_tokens=True) == pair.hf.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("chat", range(len(CHATS) + 1))
def test_chat_prompts_are_transformers(pair: Pair, chat: int) -> None:
    """The template rendered and encoded as transformers does (the last chat has special tokens in its text)."""
    special = [{"role": "user", "content": f"{pair.special[-1]} in text {pair.special[0]}x"}]
    messages = [*CHATS, special][chat]
    for add_generation_prompt in (True, False):
        expected = pair.hf.apply_chat_template(
            messages, tokenize=True, return_dict=True, add_generation_prompt=add_generation_prompt
        )["input_ids"]
        assert pair.ours.encode_chat(messages, add_generation_prompt) == list(expected)


@FAST
@given(data=st.data())
def test_streamed_detokenization_is_transformers_decode(pair: Pair, data: st.DataObject) -> None:
    """Ids as a model emits them (mid-character byte tokens, special tokens anywhere), in chunks: the text
    released adds up to transformers' decode; after a prompt, to what the output adds to the prompt's decode.
    Byte-fallback tokens come as whole characters: a run of them that is not UTF-8 makes transformers' decode
    rewrite text before it (test_invalid_bytes_inside_a_byte_run_lose_no_text)."""
    ours = pair.ours
    other_ids = st.integers(0, ours.vocab_size - 1).filter(lambda i: i not in ours.fallback_byte_ids)
    character = st.characters(exclude_categories=("Cs",)).map(lambda ch: ours.encode(ch, add_special_tokens=False))
    chunks = st.lists(st.one_of(other_ids.map(lambda i: [i]), character), max_size=16)
    from_text = ours.encode(data.draw(st.sampled_from(pair.texts())), add_special_tokens=False)
    ids = data.draw(st.one_of(st.just(from_text), chunks.map(lambda parts: [i for part in parts for i in part])))
    chunk = data.draw(st.integers(1, 3))
    for skip in (True, False):
        assert stream(ours, ids, chunk, [], skip) == pair.hf.decode(ids, skip_special_tokens=skip)
    prompt = ours.encode("Some prompt text, then:")
    before = pair.hf.decode(prompt, skip_special_tokens=True)
    whole = pair.hf.decode(prompt + ids, skip_special_tokens=True)
    assert whole.startswith(before)
    assert stream(ours, ids, chunk, prompt, True) == whole[len(before) :]


@pytest.mark.parametrize("pair", sorted(BYTE_FALLBACK), indirect=True)
def test_invalid_bytes_inside_a_byte_run_lose_no_text(pair: Pair) -> None:
    """A stray continuation byte after released characters: transformers' decode of the whole run turns every
    byte into U+FFFD, text already streamed cannot be taken back, and what follows is still released."""
    ours = pair.ours
    start = [ours.backend.token_to_id(f"<0x{b:02X}>") for b in "テ".encode()]
    stray, tail = ours.backend.token_to_id("<0x81>"), ours.encode(" after", add_special_tokens=False)
    assert pair.hf.decode(start) == "テ" and set(start) <= ours.fallback_byte_ids
    text = stream(ours, [*start, stray, *tail], 1, [], True)
    assert text.startswith("テ") and text.endswith(pair.hf.decode(tail)) and "\ufffd" in text
