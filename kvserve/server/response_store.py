"""Stored Responses API responses, in memory and bounded, for GET / cancel / DELETE and
`previous_response_id`.

The least recently used responses go first once there are more than `max_entries` or
their text passes `max_chars` (the response object and its conversation, counted once
when stored). A background response still running is never evicted.
"""
from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from dataclasses import dataclass, field

from kvserve.server.protocol import ChatMessage

DEFAULT_MAX_ENTRIES = 1024
DEFAULT_MAX_CHARS = 64 * 1024 * 1024


@dataclass
class StoredResponse:
    """A response object and the conversation that continues from it (without its instructions)."""

    response: dict
    conversation: list[ChatMessage] = field(default_factory=list)
    background_task: asyncio.Task | None = None
    size_chars: int = 0

    @property
    def running(self) -> bool:
        return self.background_task is not None and not self.background_task.done()


class ResponseStore:
    """Responses by id, least recently used first."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, max_chars: int = DEFAULT_MAX_CHARS) -> None:
        self.max_entries = max_entries
        self.max_chars = max_chars
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._chars = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def put(self, entry: StoredResponse) -> None:
        """Store (or replace) `entry` under its response's id, then evict down to the bounds."""
        response_id = entry.response["id"]
        self.delete(response_id)
        entry.size_chars = len(json.dumps(entry.response)) + sum(
            len(m.model_dump_json()) for m in entry.conversation)
        self._entries[response_id] = entry
        self._chars += entry.size_chars
        self._evict()

    def delete(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self._chars -= entry.size_chars
        return entry

    def _evict(self) -> None:
        for response_id in list(self._entries):
            if len(self._entries) <= self.max_entries and self._chars <= self.max_chars:
                return
            if not self._entries[response_id].running:
                self.delete(response_id)
