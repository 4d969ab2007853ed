"""Chat templates: found in a checkpoint and rendered the way transformers' `apply_chat_template` renders them.

A checkpoint's template is Jinja written for transformers, so it is rendered in the same kind of environment
(`_environment`); templates come from model repositories, so they are untrusted code: that is why it is a sandbox.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

TEMPLATE_FILE = "chat_template.jinja"  # next to tokenizer_config.json; wins over the config's template
TEMPLATE_DIR = "additional_chat_templates"  # <name>.jinja: named templates (such as "tool_use")
# A message's reasoning, under the names templates read it by (transformers fills each from the others).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """The template cannot render these messages (it raised, it reads what is not there, or it does not parse)."""


def find_templates(model_dir: Path, config: Mapping[str, Any]) -> dict[str, str]:
    """name -> template source. Files (chat_template.jinja as "default", additional_chat_templates/*.jinja)
    replace the templates of tokenizer_config.json, whose `chat_template` is one template or a list of
    {"name", "template"}."""
    files: dict[str, str] = {}
    default = model_dir / TEMPLATE_FILE
    if default.is_file():
        files["default"] = default.read_text(encoding="utf-8")
    named = model_dir / TEMPLATE_DIR
    if named.is_dir():
        for path in sorted(named.glob("*.jinja")):
            files[path.stem] = path.read_text(encoding="utf-8")
    if files:
        return files
    inline = config.get("chat_template")
    if isinstance(inline, str):
        return {"default": inline}
    if isinstance(inline, list):
        return {
            t["name"]: t["template"]
            for t in inline
            if isinstance(t, Mapping) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
        }
    return {}


def pick_template(templates: Mapping[str, str], tools: Sequence[Any] | None) -> str | None:
    """The template for this request: "tool_use" when tools are given and there is one, else "default";
    None if there is no template at all."""
    if not templates:
        return None
    if tools is not None and "tool_use" in templates:
        return templates["tool_use"]
    if "default" in templates:
        return templates["default"]
    raise ChatTemplateError(f"this model has several chat templates ({', '.join(sorted(templates))}) but no default")


def render(
    source: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool,
    special_tokens: Mapping[str, str],
    tools: Sequence[Mapping[str, Any]] | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """The prompt text of `messages`. Special tokens are passed by name (bos_token, eos_token, pad_token, ...);
    `tools` and `documents` are None unless given, as transformers passes them."""
    if not messages:
        raise ChatTemplateError("there are no messages to render")
    if documents is not None and not all(isinstance(d, Mapping) for d in documents):
        raise ChatTemplateError("documents must be objects with 'title' and 'text'")
    try:
        template = _compile(source)
        return template.render(
            **{name: value for name, value in special_tokens.items() if value is not None},
            messages=[_message(m) for m in messages],
            tools=_plain(tools),
            documents=_plain(documents),
            add_generation_prompt=add_generation_prompt,
        )
    except (jinja2.TemplateError, ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
        raise ChatTemplateError(str(exc)) from None


def _message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A plain copy without the fields that are None (templates tell a missing field from None badly), its
    reasoning under each name templates read it by."""
    if not isinstance(message, Mapping):
        raise ChatTemplateError(f"a chat message must be an object, not {message!r}")
    plain = {key: _plain(value) for key, value in message.items() if value is not None}
    reasoning = next((plain[key] for key in _REASONING_FIELDS if plain.get(key) is not None), None)
    if reasoning is not None:
        plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
    return plain


def _plain(value: Any) -> Any:
    """A copy made of plain JSON types, so the template never sees (or changes) the caller's objects."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, Mapping):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    return f"<{type(value).__name__}>"


@cache
def _compile(source: str) -> jinja2.Template:
    return _environment().from_string(source)


@cache
def _environment() -> ImmutableSandboxedEnvironment:
    """transformers' kind of environment: a sandbox that cannot change the data it is given, `trim_blocks` and
    `lstrip_blocks`, the `loopcontrols` extension and the `{% generation %}` tag, a `tojson` that keeps non-ASCII
    text, and the globals `raise_exception` and `strftime_now`."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters and ASCII-escapes the rest; templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers marks assistant turns with it; rendered as is."""

    tags = {"generation"}  # noqa: RUF012 (jinja's own class attribute)

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()
