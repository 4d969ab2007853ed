"""gateway.text.Tokenizer (tokenizers + jinja2, no transformers) against transformers' AutoTokenizer.

The reference is transformers in this test process: encoding, decoding and chat prompts must come out the same
for every architecture the tiny models cover, and for checkpoints whose configs use the less common features
(template files, named templates, special tokens written as objects, clean-up, template helpers).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jinja2
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from common.tokenizer_resolution import resolve
from gateway.text import PromptError, Tokenizer, clean_up_tokenization
from tests.support.models import TINY, TINY_ARCHS

SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"]
TEXTS = [
    "",
    "Hello world",
    "  leading and trailing spaces  ",
    "héllo wörld: 日本語のテキスト, 한국어, emoji 😀👍🏽👩\u200d💻 and e\u0301",
    "special tokens in text: <|im_start|>user\nhi<|im_end|> <|begin_of_text|><|end_of_text|>",
    "half a special token: <|im_sta and <|im_end",
    "don't , . ? ! it's we've they're I'm",
    "tabs\tand\nnew lines\r\n\n and \u00a0 no-break spaces",
    "numbers 1234567890 3.14159 and code: def f(x): return x**2",
]
CHATS = [
    [{"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello! 日本語?"},
        {"role": "assistant", "content": "こんにちは 😀"},
        {"role": "user", "content": "And <|im_end|> in the text, then more."},
    ],
    [{"role": "user", "content": ""}, {"role": "assistant", "content": " spaced "}, {"role": "user", "content": "x"}],
]
PIECES = st.one_of(
    st.text(st.characters(exclude_categories=("Cs",)), max_size=12),
    st.sampled_from([*SPECIAL, " ", "\n", "don't", " .", " ,", "日本", "😀", "é"]),
)
TEXT = st.lists(PIECES, max_size=8).map("".join)
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def resolved(model_dir: Path) -> Tokenizer:
    """The gateway's tokenizer, resolved in this process (the gateway resolves it in a child, then caches it)."""
    return Tokenizer(model_dir, resolution=resolve(model_dir))


def reference(model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def hf_chat_ids(hf: PreTrainedTokenizerBase, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    rendered = hf.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)
    return list(rendered["input_ids"])


@pytest.fixture(scope="module", params=TINY_ARCHS)
def pair(request: pytest.FixtureRequest, tiny_models: dict[str, Path]) -> tuple[Tokenizer, PreTrainedTokenizerBase]:
    """(ours, transformers') for one architecture's tiny model."""
    return resolved(tiny_models[request.param]), reference(tiny_models[request.param])


# ---------------------------------------------------------------------------------------------- each architecture


def test_sizes_and_special_tokens_are_transformers(pair: tuple[Tokenizer, PreTrainedTokenizerBase]) -> None:
    ours, hf = pair
    assert ours.vocab_size == len(hf) == TINY["vocab_size"]
    assert ours.special_ids == set(hf.all_special_ids) == {0, 1, 2, 3}
    assert [ours.id_to_token(i) for i in range(ours.vocab_size)] == hf.convert_ids_to_tokens(list(range(len(hf))))


@pytest.mark.parametrize("text", TEXTS)
def test_encode_and_decode_are_transformers(pair: tuple[Tokenizer, PreTrainedTokenizerBase], text: str) -> None:
    ours, hf = pair
    ids = ours.encode(text)
    assert ids == hf.encode(text)
    for skip in (False, True):
        assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


@FAST
@given(text=TEXT)
@example(text="<|im_start|><|im_start|>")
@example(text="x<|end_of_text|>😀")
def test_encode_and_decode_of_any_text_are_transformers(
    pair: tuple[Tokenizer, PreTrainedTokenizerBase], text: str
) -> None:
    ours, hf = pair
    ids = ours.encode(text)
    assert ids == hf.encode(text)
    assert ours.decode(ids) == hf.decode(ids)
    assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)


@FAST
@given(ids=st.lists(st.integers(0, TINY["vocab_size"] - 1), max_size=30))
def test_decode_of_any_ids_is_transformers(pair: tuple[Tokenizer, PreTrainedTokenizerBase], ids: list[int]) -> None:
    """Ids a model emits need not be valid UTF-8 together, nor place special tokens anywhere sensible."""
    ours, hf = pair
    for skip in (False, True):
        assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("messages", CHATS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_encode_chat_is_transformers(
    pair: tuple[Tokenizer, PreTrainedTokenizerBase], messages: list[dict[str, Any]], add_generation_prompt: bool
) -> None:
    ours, hf = pair
    expected = hf_chat_ids(hf, messages, add_generation_prompt=add_generation_prompt)
    assert ours.encode_chat(messages, add_generation_prompt) == expected
    assert expected.count(2) == len(messages) + add_generation_prompt, "turn markers are the special tokens"


# ---------------------------------------------------------------------------------------------- checkpoint variants


@pytest.fixture
def variant(tiny_models: dict[str, Path], tmp_path: Path) -> Callable[..., Path]:
    """A copy of the tiny llama whose tokenizer_config.json is updated (None removes a key) and files added."""

    def make(config: dict[str, Any] | None = None, files: dict[str, str] | None = None) -> Path:
        out = tmp_path / f"variant-{len(list(tmp_path.iterdir()))}"
        shutil.copytree(tiny_models["llama"], out)
        path = out / "tokenizer_config.json"
        data = json.loads(path.read_text(encoding="utf-8"))
        for key, value in (config or {}).items():
            if value is None:
                data.pop(key, None)
            else:
                data[key] = value
        path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
        for name, text in (files or {}).items():
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            (out / name).write_text(text, encoding="utf-8")
        return out

    return make


# Uses what transformers' environment offers templates: loop controls, tojson (non-ASCII, indent), namespace,
# the named special tokens (unk_token is unset: undefined), tools and documents, the generation tag.
FEATURES = """{{ bos_token }}{% set ns = namespace(turns=0) %}
{% if tools %}tools: {{ tools | tojson }}
{{ tools[0] | tojson(indent=2) }}
{% endif %}
{% if documents %}{% for d in documents %}[{{ d.title }}] {{ d.text }}
{% endfor %}{% endif %}
{% for message in messages %}
    {% if message.role == 'skip' %}{% continue %}{% endif %}
    {% if message.role == 'stop' %}{% break %}{% endif %}
    {% set ns.turns = ns.turns + 1 %}
    <|im_start|>{{ message.role }}
    {% if message.role == 'assistant' %}{% generation %}{{ message.content }}{% endgeneration %}
    {% else %}{{ message.content | tojson }}
    {% endif %}<|im_end|>
{% endfor %}
turns={{ ns.turns }} unk={{ unk_token is defined }} pad={{ pad_token }} eos={{ eos_token }}
{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
FEATURE_CHAT = [
    {"role": "system", "content": 'Réponds en 日本語 "quoted" <b>'},
    {"role": "skip", "content": "never shown"},
    {"role": "user", "content": "Hi 😀"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "stop", "content": "ends the loop"},
    {"role": "user", "content": "never reached"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "Météo du jour",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
DOCUMENTS = [{"title": "Doc 1", "text": "Some text, ünïcode."}]


@pytest.mark.parametrize(
    "extra", [{}, {"tools": TOOLS}, {"documents": DOCUMENTS}, {"tools": TOOLS, "documents": DOCUMENTS}]
)
def test_template_features_render_as_in_transformers(variant: Callable[..., Path], extra: dict[str, Any]) -> None:
    model_dir = variant({"chat_template": FEATURES})
    ours, hf = resolved(model_dir), reference(model_dir)
    for add_generation_prompt in (True, False):
        expected = hf_chat_ids(hf, FEATURE_CHAT, add_generation_prompt=add_generation_prompt, **extra)
        assert ours.encode_chat(FEATURE_CHAT, add_generation_prompt, **extra) == expected
    text = ours.decode(ours.encode_chat(FEATURE_CHAT, True, **extra))
    assert "日本語" in text and "never" not in text and "turns=3" in text
    assert ("Météo" in text) is ("tools" in extra), "tojson keeps non-ASCII text"


def test_template_file_wins_over_the_config(variant: Callable[..., Path]) -> None:
    model_dir = variant(files={"chat_template.jinja": "FILE{% for m in messages %}|{{ m.content }}{% endfor %}"})
    ours, hf = resolved(model_dir), reference(model_dir)
    assert ours.decode(ours.encode_chat(CHATS[1])).startswith("FILE|Be brief.")
    assert ours.encode_chat(CHATS[1]) == hf_chat_ids(hf, CHATS[1], add_generation_prompt=True)


def test_named_templates_pick_tool_use_when_tools_are_given(variant: Callable[..., Path]) -> None:
    templates = [
        {"name": "default", "template": "DEFAULT{{ messages[0].content }}"},
        {"name": "tool_use", "template": "TOOLS{{ tools | length }}{{ messages[0].content }}"},
    ]
    model_dir = variant({"chat_template": templates})
    ours, hf = resolved(model_dir), reference(model_dir)
    messages = [{"role": "user", "content": "hi"}]
    assert ours.decode(ours.encode_chat(messages)) == "DEFAULThi"
    assert ours.decode(ours.encode_chat(messages, tools=TOOLS)) == "TOOLS1hi"
    assert ours.encode_chat(messages) == hf_chat_ids(hf, messages, add_generation_prompt=True)
    assert ours.encode_chat(messages, tools=TOOLS) == hf_chat_ids(hf, messages, add_generation_prompt=True, tools=TOOLS)


def test_special_tokens_written_as_objects(variant: Callable[..., Path]) -> None:
    def added(content: str) -> dict[str, Any]:
        return {"__type": "AddedToken", "content": content, "lstrip": False, "normalized": False, "rstrip": False}

    model_dir = variant(
        {
            "bos_token": added(SPECIAL[0]),
            "eos_token": added(SPECIAL[1]),
            "chat_template": "{{ bos_token }}|{{ eos_token }}",
        }
    )
    ours, hf = resolved(model_dir), reference(model_dir)
    messages = [{"role": "user", "content": "x"}]
    assert (
        ours.encode_chat(messages) == hf_chat_ids(hf, messages, add_generation_prompt=True) == [0, *ours.encode("|"), 1]
    )
    assert ours.special_ids == set(hf.all_special_ids)


def test_raise_exception_and_bad_templates_are_prompt_errors(variant: Callable[..., Path]) -> None:
    ours = resolved(variant({"chat_template": "{{ raise_exception('only user turns, please') }}"}))
    with pytest.raises(PromptError, match="only user turns, please"):
        ours.encode_chat([{"role": "user", "content": "x"}])
    hf = reference(variant({"chat_template": "{{ raise_exception('only user turns, please') }}"}))
    with pytest.raises(jinja2.TemplateError, match="only user turns, please"):
        hf.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
    with pytest.raises(PromptError, match="could not render"):
        resolved(variant({"chat_template": "{% for %}"})).encode_chat([{"role": "user", "content": "x"}])
    sandboxed = resolved(variant({"chat_template": "{{ messages.__class__.__mro__ }}"}))
    with pytest.raises(PromptError):
        sandboxed.encode_chat([{"role": "user", "content": "x"}])
    mutating = resolved(variant({"chat_template": "{{ messages.append(1) }}"}))
    with pytest.raises(PromptError):
        mutating.encode_chat([{"role": "user", "content": "x"}])


def test_strftime_now_is_available(variant: Callable[..., Path]) -> None:
    model_dir = variant({"chat_template": "{{ strftime_now('%Y') }}"})
    ours, hf = resolved(model_dir), reference(model_dir)
    messages = [{"role": "user", "content": "x"}]
    assert ours.encode_chat(messages) == hf_chat_ids(hf, messages, add_generation_prompt=True)
    assert ours.decode(ours.encode_chat(messages)).isdigit()


def test_none_fields_of_messages_are_dropped_as_transformers_drops_them(variant: Callable[..., Path]) -> None:
    template = "{% for m in messages %}{{ m.role }}:{{ m.name if m.name is defined else '-' }};{% endfor %}"
    model_dir = variant({"chat_template": template})
    ours, hf = resolved(model_dir), reference(model_dir)
    messages = [{"role": "user", "content": "x", "name": None}, {"role": "user", "content": "y", "name": "bob"}]
    assert ours.decode(ours.encode_chat(messages)) == "user:-;user:bob;"
    assert ours.encode_chat(messages) == hf_chat_ids(hf, messages, add_generation_prompt=True)


def test_clean_up_is_skipped_for_bpe_as_transformers_skips_it(variant: Callable[..., Path]) -> None:
    model_dir = variant({"clean_up_tokenization_spaces": True})
    ours, hf = resolved(model_dir), reference(model_dir)
    ids = ours.encode("a , b . c ? don 't")
    assert ours.decode(ids) == hf.decode(ids) == "a , b . c ? don 't"


def test_clean_up_applies_to_word_level_tokenizers(tmp_path: Path) -> None:
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    words = ["[UNK]", "hello", ",", "world", ".", "it", "'s", "n't", "do", "?", "!"]
    backend = Backend(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.save(str(tmp_path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]", "clean_up_tokenization_spaces": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    ours, hf = resolved(tmp_path), reference(tmp_path)
    ids = ours.encode("hello , world . it 's do n't ? ! zzz")
    assert ids == hf.encode("hello , world . it 's do n't ? ! zzz")
    assert ours.decode(ids) == hf.decode(ids) == clean_up_tokenization("hello , world . it 's do n't ? ! [UNK]")
    assert ours.decode(ids) == "hello, world. it's don't?! [UNK]"
    detokenizer = ours.detokenizer()
    streamed = "".join([*(detokenizer.add([i]) for i in ids), detokenizer.flush()])
    assert streamed == hf.decode(ids, skip_special_tokens=True), "cleaned up as it streams too"
    config["clean_up_tokenization_spaces"] = False
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    assert resolved(tmp_path).decode(ids) == reference(tmp_path).decode(ids) == "hello , world . it 's do n't ? ! [UNK]"


def test_add_bos_and_eos_token_are_as_transformers_applies_them(variant: Callable[..., Path]) -> None:
    """transformers 5 lets tokenizer.json's post-processor decide; without one, it adds nothing either."""
    flags = {"add_bos_token": True, "add_eos_token": True}
    plain = resolved(variant()).encode("hi")
    assert resolved(variant(flags)).encode("hi") == reference(variant(flags)).encode("hi") == plain

    def without_post_processor(model_dir: Path) -> Path:
        spec = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
        spec["post_processor"] = None
        (model_dir / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
        return model_dir

    for config in (flags, {"add_bos_token": True}, {}):
        model_dir = without_post_processor(variant(config))
        assert resolved(model_dir).encode("hi") == reference(model_dir).encode("hi")


def test_special_tokens_the_config_adds_are_added_as_in_transformers(variant: Callable[..., Path]) -> None:
    extra = [*SPECIAL[2:], "<|tool|>"]
    model_dir = variant({"additional_special_tokens": extra, "extra_special_tokens": extra})
    ours, hf = resolved(model_dir), reference(model_dir)
    assert ours.vocab_size == len(hf) == TINY["vocab_size"] + 1
    assert ours.special_ids == set(hf.all_special_ids)
    ids = ours.encode("a<|tool|>b <|im_end|>")
    assert ids == hf.encode("a<|tool|>b <|im_end|>") and TINY["vocab_size"] in ids
    for skip in (False, True):
        assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


def test_truncation_and_padding_in_tokenizer_json_are_off_as_in_transformers(variant: Callable[..., Path]) -> None:
    model_dir = variant()
    spec = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    spec["truncation"] = {"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0}
    spec["padding"] = {
        "strategy": {"Fixed": 64},
        "direction": "Right",
        "pad_to_multiple_of": None,
        "pad_id": 1,
        "pad_type_id": 0,
        "pad_token": SPECIAL[1],
    }
    (model_dir / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    text = "a prompt longer than four tokens, shorter than sixty-four"
    ids = resolved(model_dir).encode(text)
    assert ids == reference(model_dir).encode(text) and 4 < len(ids) < 64


def test_split_special_tokens_spells_them_as_text_as_in_transformers(variant: Callable[..., Path]) -> None:
    model_dir = variant({"split_special_tokens": True})
    text = f"{SPECIAL[2]}user\nhi{SPECIAL[3]}"
    ids = resolved(model_dir).encode(text)
    assert ids == reference(model_dir).encode(text)
    assert not set(ids) & {2, 3}, "the markers are spelled as text, not their special ids"
