"""gateway.text: streaming detokenization against the real tokenizer, stop strings, the chat template."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from gateway.text import PromptError, StopMatcher, Tokenizer
from pagedkv.tools.model_gen import write_model
from tests.support.models import TINY

REPLACEMENT = "\ufffd"
SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"]

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("text-model") / "m", arch="llama", quiet=True, **TINY)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer(model_dir)


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> PreTrainedTokenizerBase:
    """transformers' tokenizer of the same checkpoint: the reference (the gateway itself never imports it)."""
    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


# Multi-byte characters of every UTF-8 length (2: accented, 3: CJK, 4: emoji), a modifier and a ZWJ sequence.
MULTIBYTE = [*list("éüñçøÅß日本語中文字符한국어ǘ😀👍🏽👩\u200d💻🎉€£"), "́", "\u200d"]
ASCII = list("abcdefghij XYZ .,!?\n\t0123")
CHARS = st.one_of(
    st.sampled_from(MULTIBYTE + ASCII),
    st.characters(exclude_categories=("Cs",), exclude_characters=REPLACEMENT),  # any code point but surrogates
)
TEXT = st.text(alphabet=CHARS, max_size=40)


def stream(tokenizer: Tokenizer, ids: list[int], chunks: list[int], prompt: list[int] = ()) -> list[str]:
    """Feed `ids` to a detokenizer in chunks of the given sizes (cycled), then flush: every piece released."""
    detokenizer = tokenizer.detokenizer(prompt)
    pieces, i, k = [], 0, 0
    while i < len(ids):
        size = chunks[k % len(chunks)] if chunks else 1
        pieces.append(detokenizer.add(ids[i : i + size]))
        i, k = i + size, k + 1
    pieces.append(detokenizer.flush())
    return pieces


# ---------------------------------------------------------------------------------------------- Detokenizer


def test_tokenizer_fixture_has_the_expected_special_tokens(tokenizer: Tokenizer, hf: PreTrainedTokenizerBase) -> None:
    assert [tokenizer.id_to_token(i) for i in range(4)] == hf.convert_ids_to_tokens([0, 1, 2, 3]) == SPECIAL
    assert tokenizer.vocab_size == TINY["vocab_size"]


def test_multibyte_characters_are_released_whole(tokenizer: Tokenizer) -> None:
    text = "héllo 日本語 😀!"
    ids = tokenizer.encode(text)
    assert len(ids) > len(text), "the test needs characters split over several byte-level tokens"
    pieces = stream(tokenizer, ids, [1])
    assert "".join(pieces) == text
    assert not any(REPLACEMENT in piece for piece in pieces), pieces
    assert "" in pieces, "some token ends mid-character, so some add() must release nothing"
    for ch in "é日本語😀":
        assert ch in pieces or any(ch in p for p in pieces)


@FAST
@given(text=TEXT, chunks=st.lists(st.integers(1, 5), max_size=6))
@example(text="😀😀😀", chunks=[1])
@example(text="日本語 test", chunks=[2, 1])
@example(text="e\u0301 👩‍💻", chunks=[1])
def test_streamed_text_equals_full_decode_and_never_splits_a_character(
    tokenizer: Tokenizer, hf: PreTrainedTokenizerBase, text: str, chunks: list[int]
) -> None:
    ids = tokenizer.encode(text)
    expected = hf.decode(ids, skip_special_tokens=True)
    assert expected == text, "byte-level BPE without special-token text must round-trip"
    pieces = stream(tokenizer, ids, chunks)
    assert "".join(pieces) == expected, f"pieces {pieces!r}"
    bad = [p for p in pieces if REPLACEMENT in p]
    assert not bad, f"a released piece holds part of a character: {bad!r}"
    # No piece splits a character: each one is valid text on its own, so it round-trips through UTF-8.
    for piece in pieces:
        assert piece.encode("utf-8").decode("utf-8") == piece


@FAST
@given(prompt=TEXT, text=TEXT, chunks=st.lists(st.integers(1, 4), max_size=4))
@example(prompt="Hello", text=" world", chunks=[1])
@example(prompt="Hello ", text="world", chunks=[1])
@example(prompt="日本", text="語です 😀", chunks=[1])
def test_prompt_context_gives_the_continuation_of_the_prompt(
    tokenizer: Tokenizer, hf: PreTrainedTokenizerBase, prompt: str, text: str, chunks: list[int]
) -> None:
    prompt_ids, ids = tokenizer.encode(prompt), tokenizer.encode(text)
    pieces = stream(tokenizer, ids, chunks, prompt_ids)
    full = hf.decode(prompt_ids + ids, skip_special_tokens=True)
    head = hf.decode(prompt_ids, skip_special_tokens=True)
    assert full.startswith(head)
    assert "".join(pieces) == full[len(head) :] == text
    assert not any(REPLACEMENT in p for p in pieces), pieces


def test_leading_space_token_after_a_prompt_keeps_its_space(tokenizer: Tokenizer, hf: PreTrainedTokenizerBase) -> None:
    prompt_ids = tokenizer.encode("The quick brown fox")
    ids = tokenizer.encode(" jumps over")
    assert hf.decode(ids[:1]).startswith(" ")
    pieces = stream(tokenizer, ids, [1], prompt_ids)
    assert pieces[0].startswith(" "), pieces
    assert "".join(pieces) == " jumps over"


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_token_id_prompt_ending_mid_character_does_not_swallow_the_output(
    tokenizer: Tokenizer, hf: PreTrainedTokenizerBase, data: st.DataObject
) -> None:
    """A prompt of token ids may end inside a character that the output completes: the output must still
    come out, as decode(prompt + output) beyond decode(prompt) (the completed character belongs to the prompt)."""
    ids = tokenizer.encode("ab 日本語 😀 test more words é")
    cut = data.draw(st.integers(1, len(ids) - 1), label="cut")
    chunks = data.draw(st.lists(st.integers(1, 3), max_size=3), label="chunks")
    prompt, output = ids[:cut], ids[cut:]
    head = hf.decode(prompt, skip_special_tokens=True)
    full = hf.decode(prompt + output, skip_special_tokens=True)
    assert len(full) >= len(head)
    expected = full[len(head) :]
    assert "".join(stream(tokenizer, output, chunks, prompt)) == expected, f"prompt ends {head[-3:]!r}"


def test_special_tokens_are_skipped(tokenizer: Tokenizer) -> None:
    hello, world = tokenizer.encode("hello"), tokenizer.encode(" world")
    ids = [0, *hello, 2, 3, *world, 1]
    pieces = stream(tokenizer, ids, [1])
    assert "".join(pieces) == "hello world"
    assert not any(name in "".join(pieces) for name in SPECIAL)
    detokenizer = tokenizer.detokenizer()
    assert detokenizer.add([1]) == "", "a lone special token releases no text"
    assert detokenizer.add([3, 2]) == ""
    assert detokenizer.flush() == ""


def test_special_tokens_are_kept_when_asked(tokenizer: Tokenizer, hf: PreTrainedTokenizerBase) -> None:
    hello, world = tokenizer.encode("hello"), tokenizer.encode(" world")
    ids = [0, *hello, 2, 3, *world, 1]
    detokenizer = tokenizer.detokenizer(skip_special_tokens=False)
    pieces = [detokenizer.add([token]) for token in ids] + [detokenizer.flush()]
    assert "".join(pieces) == hf.decode(ids, skip_special_tokens=False)
    assert SPECIAL[0] in "".join(pieces)


def test_prompt_with_special_tokens_as_context(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode_chat([{"role": "user", "content": "hi"}])
    assert prompt[-1] != 3
    ids = tokenizer.encode("Hello there")
    assert "".join(stream(tokenizer, ids, [1], prompt)) == "Hello there"


def test_flush_releases_an_incomplete_character(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("a😀")
    detokenizer = tokenizer.detokenizer()
    released = "".join(detokenizer.add([i]) for i in ids[:-1])
    assert released == "a", "the emoji is incomplete without its last token"
    assert detokenizer.flush() == REPLACEMENT, "flush gives out what is left, as the tokenizer decodes it"
    assert detokenizer.flush() == "", "a second flush has nothing left"


def test_long_output_decodes_only_a_window(tokenizer: Tokenizer) -> None:
    text = " ".join(["日本語 and 😀 words"] * 30)
    ids = tokenizer.encode(text)
    assert "".join(stream(tokenizer, ids, [1])) == text
    assert "".join(stream(tokenizer, ids, [7, 3])) == text


# ---------------------------------------------------------------------------------------------- StopMatcher


def run_stops(stops: list[str], chunks: list[str]) -> tuple[list[str], StopMatcher]:
    matcher = StopMatcher(stops)
    pieces = [matcher.feed(chunk) for chunk in chunks]
    if not matcher.stopped:
        pieces.append(matcher.flush())
    return pieces, matcher


@pytest.mark.parametrize(
    ("stops", "chunks", "expected", "stopped"),
    [
        (["STOP"], ["hello STOP world"], "hello ", True),
        (["STOP"], ["hel", "lo ST", "OP wor", "ld"], "hello ", True),
        (["STOP"], ["hello S", "T", "O", "P"], "hello ", True),
        (["STOP"], ["hello ST", "ART"], "hello START", False),
        (["STOP"], ["no stop here, ST"], "no stop here, ST", False),
        (["ab", "b"], ["xab"], "x", True),
        (["ab", "b"], ["xa", "b"], "x", True),
        (["b", "ab"], ["xa", "b"], "x", True),
        (["ab", "b"], ["xb"], "x", True),
        (["\n\n", "END"], ["line one\n", "\nline two"], "line one", True),
        (["aaa"], ["aa", "aa"], "", True),
        (["aab"], ["aa", "aab"], "aa", True),
        (["", "x"], ["abc"], "abc", False),
        ([""], ["abc", "def"], "abcdef", False),
        ([], ["abc"], "abc", False),
        (["日本"], ["こんにちは日", "本語"], "こんにちは", True),
        (["stop"], ["", "st", "", "op"], "", True),
    ],
)
def test_stop_examples(stops: list[str], chunks: list[str], expected: str, stopped: bool) -> None:
    pieces, matcher = run_stops(stops, chunks)
    assert "".join(pieces) == expected, pieces
    assert matcher.stopped is stopped


def test_stop_string_included_when_asked() -> None:
    matcher = StopMatcher(["STOP", "ab"], include_stop=True)
    assert matcher.feed("hello S") == "hello "
    assert matcher.feed("TOP world") == "STOP" and matcher.stopped


def test_held_back_text_is_not_released_until_ruled_out() -> None:
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("abc S") == "abc ", "'S' may start the stop string: held back"
    assert matcher.feed("T") == ""
    assert matcher.feed("x") == "STx", "ruled out: released"
    assert matcher.feed("ST") == ""
    assert matcher.flush() == "ST", "the output ended: the held text is released"
    assert matcher.flush() == ""


def test_nothing_comes_out_after_a_stop() -> None:
    matcher = StopMatcher(["."])
    assert matcher.feed("one. two") == "one"
    assert matcher.stopped
    assert matcher.feed("more.") == ""
    assert matcher.flush() == ""


def test_empty_stop_strings_are_ignored() -> None:
    assert StopMatcher(["", "x", ""]).stops == ["x"]


def stop_oracle(stops: list[str], chunks: list[str]) -> tuple[str, bool]:
    """What the streamed output must be: at the first chunk boundary by which some stop string has completed,
    the text is cut before the earliest-starting stop string completed so far (within one chunk, stop strings
    are cut at the earliest start); no stop string at all: the whole text."""
    stops = [s for s in stops if s]
    seen = ""
    for chunk in chunks:
        seen += chunk
        starts = [seen.find(s) for s in stops if s in seen]
        if starts:
            return seen[: min(starts)], True
    return seen, False


@st.composite
def stop_case(draw: st.DrawFn) -> tuple[list[str], list[str]]:
    text = draw(st.text(alphabet=st.sampled_from("aabbc日😀 \n"), max_size=30))
    stops = draw(st.lists(st.text(alphabet=st.sampled_from("abc日😀 \n"), max_size=4), max_size=3))
    for _ in range(draw(st.integers(0, 2))):  # stop strings that do occur
        if text:
            i = draw(st.integers(0, len(text) - 1))
            stops.append(text[i : draw(st.integers(i + 1, min(len(text), i + 4)))])
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=8)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    return stops, chunks


@settings(max_examples=300, deadline=None)
@given(case=stop_case())
@example(case=(["ab", "b"], ["xa", "b"]))
@example(case=(["abc", "bcd"], ["ab", "cd"]))
@example(case=(["aXb"], ["a", "X", "b"]))
def test_stop_matcher_property(case: tuple[list[str], list[str]]) -> None:
    stops, chunks = case
    text = "".join(chunks)
    pieces, matcher = run_stops(stops, chunks)
    out = "".join(pieces)
    expected, expect_stop = stop_oracle(stops, chunks)
    assert out == expected, f"text {text!r}, stops {stops!r}, chunks {chunks!r}: got {out!r}"
    assert matcher.stopped is expect_stop
    if not any(s and s in text for s in stops):
        assert not matcher.stopped and out == text, "no stop string: everything comes out, held text included"
    assert text.startswith(out)
    for stop in stops:
        assert not stop or stop not in out, f"released text holds stop string {stop!r}"


@settings(max_examples=200, deadline=None)
@given(case=stop_case())
def test_stop_matcher_in_one_chunk_cuts_at_the_earliest_stop(case: tuple[list[str], list[str]]) -> None:
    stops, chunks = case
    text = "".join(chunks)
    pieces, matcher = run_stops(stops, [text])
    starts = [text.find(s) for s in stops if s and s in text]
    assert "".join(pieces) == (text[: min(starts)] if starts else text)
    assert matcher.stopped is bool(starts)


@settings(max_examples=200, deadline=None)
@given(case=stop_case())
def test_stop_matcher_char_by_char_cuts_at_the_first_completed_stop(case: tuple[list[str], list[str]]) -> None:
    """Streamed one character at a time (as generation sees it), the first stop string to complete ends the text."""
    stops, chunks = case
    text = "".join(chunks)
    pieces, matcher = run_stops(stops, list(text))
    live = [s for s in stops if s]
    ends = [(text.find(s) + len(s), -len(s)) for s in live if s in text]
    if ends:
        end, neg_len = min(ends)
        assert matcher.stopped and "".join(pieces) == text[: end + neg_len]
    else:
        assert not matcher.stopped and "".join(pieces) == text


def test_stop_matcher_chunk_boundaries_matter_only_when_two_stops_complete_in_one_chunk() -> None:
    # "bc" completes with the third character, "abcd" with the fourth: streamed, "bc" ends the text first.
    assert "".join(run_stops(["abcd", "bc"], ["abc", "d"])[0]) == "a"
    # Both complete within one chunk: the earlier start wins.
    assert "".join(run_stops(["abcd", "bc"], ["abcd"])[0]) == ""


# ---------------------------------------------------------------------------------------------- chat template


def test_encode_chat_renders_chatml(tokenizer: Tokenizer, hf: PreTrainedTokenizerBase) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 😀"}]
    ids = tokenizer.encode_chat(messages)
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 😀<|im_end|>\n<|im_start|>assistant\n"
    assert hf.decode(ids, skip_special_tokens=False) == expected
    assert ids.count(2) == 3 and ids.count(3) == 2, "turn markers are the special tokens, not their spelling"
    assert ids[0] == 2, "no BOS added on top of what the template writes"
    without = tokenizer.encode_chat(messages, add_generation_prompt=False)
    assert hf.decode(without, skip_special_tokens=False) == expected.removesuffix("<|im_start|>assistant\n")


def test_encode_chat_without_template_raises_prompt_error(model_dir: Path, tmp_path: Path) -> None:
    bare = tmp_path / "no-template"
    shutil.copytree(model_dir, bare)
    config_path = bare / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    assert "chat_template" in config, "the template lives in tokenizer_config.json"
    del config["chat_template"]
    config_path.write_text(json.dumps(config), encoding="utf-8")
    for extra in ("chat_template.jinja", "chat_template.json"):
        (bare / extra).unlink(missing_ok=True)
    tokenizer = Tokenizer(bare)
    with pytest.raises(PromptError, match="no chat template"):
        tokenizer.encode_chat([{"role": "user", "content": "hi"}])
    assert tokenizer.encode("hi") == Tokenizer(model_dir).encode("hi"), "plain prompts still work"


def test_encode_chat_template_error_is_prompt_error(tokenizer: Tokenizer) -> None:
    with pytest.raises(PromptError, match="could not render"):
        tokenizer.encode_chat([{"role": "user"}])  # the template reads message['content']


def test_token_text_of_partial_character_and_special_token(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("😀")
    assert len(ids) > 1
    assert b"".join(tokenizer.token_bytes(i) for i in ids) == "😀".encode()
    assert tokenizer.token_text(ids[0]).startswith("bytes:\\x"), "part of a character is shown as its bytes"
    assert tokenizer.token_text(tokenizer.encode("a")[0]) == "a"
    assert tokenizer.token_text(2) == "<|im_start|>"


@FAST
@given(
    ids=st.lists(st.integers(0, TINY["vocab_size"] - 1), max_size=40), chunks=st.lists(st.integers(1, 4), max_size=4)
)
def test_any_token_ids_stream_to_their_full_decode(
    tokenizer: Tokenizer, hf: PreTrainedTokenizerBase, ids: list[int], chunks: list[int]
) -> None:
    """A model can emit any ids, invalid UTF-8 included: streamed, they still add up to the full decode."""
    assert "".join(stream(tokenizer, ids, chunks)) == hf.decode(ids, skip_special_tokens=True)
