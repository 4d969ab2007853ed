"""The responses kept for `previous_response_id` and retrieval (/v1/responses/{id}), in the gateway's memory:
bounded in count and in bytes (each entry's JSON size), least recently used first out. A gateway's store is its
own: behind several gateways, a follow-up must reach the gateway that answered (or send the whole input)."""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_RESPONSES = 1024
DEFAULT_MAX_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class Stored:
    response: dict[str, Any]  # the response body, as retrieval answers it
    conversation: list[dict[str, Any]]  # chat messages: the history before it, its input and its output
    input_items: list[dict[str, Any]]  # its own input, as items with ids (GET /v1/responses/{id}/input_items)
    size: int


class ResponseStore:
    def __init__(self, max_responses: int = DEFAULT_MAX_RESPONSES, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[str, Stored] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(
        self, response: dict[str, Any], conversation: list[dict[str, Any]], input_items: list[dict[str, Any]]
    ) -> bool:
        """Keep `response` (by its id), evicting the least recently used to make room; False if it alone is
        over the byte bound (it is not kept)."""
        size = len(json.dumps([response, conversation, input_items], ensure_ascii=False))
        if size > self.max_bytes:
            return False
        self.delete(response["id"])
        self._entries[response["id"]] = Stored(response, conversation, input_items, size)
        self.bytes += size
        while len(self._entries) > self.max_responses or self.bytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.bytes -= evicted.size
        return True

    def get(self, response_id: str) -> Stored | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.bytes -= entry.size
        return True
