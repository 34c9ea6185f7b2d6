"""The Responses API's in-memory store: bounded by count and by characters, least recently used first."""
from __future__ import annotations

import asyncio

from kvserve.server.protocol import ChatMessage
from kvserve.server.response_store import ResponseStore, StoredResponse


def entry(response_id: str, text: str = "") -> StoredResponse:
    return StoredResponse({"id": response_id, "output": text}, [ChatMessage(role="user", content=text)])


def test_count_bound_drops_the_least_recently_used():
    store = ResponseStore(max_entries=3)
    for name in "abc":
        store.put(entry(name))
    assert store.get("a") is not None  # "a" is now the most recently used
    store.put(entry("d"))
    assert len(store) == 3 and store.get("b") is None
    assert all(store.get(name) is not None for name in "acd")


def test_character_bound_and_replacement():
    one = entry("x", "y" * 1000)
    store = ResponseStore(max_chars=3 * 1000)
    store.put(one)
    size = one.size_chars
    assert size > 2000  # the response and its conversation both count
    store.put(entry("z", "y" * 1000))
    assert store.get("x") is None and store.get("z") is not None
    store.put(entry("z", "short"))  # replacing an entry frees its characters
    store.put(entry("w", "short"))
    assert len(store) == 2
    assert store.delete("z") is not None and store.delete("z") is None


def test_a_running_background_response_is_never_evicted():
    async def scenario() -> None:
        store = ResponseStore(max_entries=1)
        blocker = asyncio.Event()
        task = asyncio.create_task(blocker.wait())
        running = entry("run")
        running.background_task = task
        store.put(running)
        store.put(entry("next"))
        assert store.get("run") is not None and store.get("next") is None
        blocker.set()
        await task
        store.put(entry("later"))
        assert store.get("run") is None and store.get("later") is not None

    asyncio.run(scenario())
