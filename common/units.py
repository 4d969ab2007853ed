"""Parsing of human-written quantities on command lines (sizes like 64MiB)."""

from __future__ import annotations

import re

_SIZE = re.compile(r"^\s*(\d+)\s*(?:([kmgt])(i?b)?|b)?\s*$", re.IGNORECASE)
_UNIT = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes in '65536', '512k', '64MiB', '2GiB' or '2GB' (binary units throughout); ValueError otherwise."""
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"{text!r} is not a size like 65536, 64MiB or 2GiB")
    number, unit = int(match.group(1)), match.group(2)
    return number * (_UNIT[unit.lower()] if unit else 1)
