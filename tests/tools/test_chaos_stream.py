"""chaos's reader of streamed completions: server-sent events split on newlines only, whatever the text holds."""

from __future__ import annotations

import json

from pagedkv.tools.chaos import StreamReader


def _event(body: object) -> bytes:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n".encode()


def test_text_with_unicode_line_separators_is_read_whole() -> None:
    text = "a\u2028b\x85c\u2029d"
    stream = _event({"choices": [{"text": text[:3]}]}) + _event({"choices": [{"text": text[3:]}]}) + b"data: [DONE]\n\n"
    reader = StreamReader()
    ended = [reader.feed(stream[i : i + 5]) for i in range(0, len(stream), 5)]  # pieces cut lines and characters
    assert ended.index(True) == (stream.index(b"[DONE]\n") + 6) // 5  # the piece with the [DONE] line's end
    assert reader.result() == ("ok", text)


def test_an_error_event_ends_the_stream() -> None:
    reader = StreamReader()
    assert not reader.feed(_event({"choices": [{"text": "half"}]}))
    assert reader.feed(_event({"error": {"message": "lost", "code": "executor_lost"}}))
    assert reader.result() == ("cut", "half")
    assert StreamReader().result() == ("transport", "")
