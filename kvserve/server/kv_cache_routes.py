"""`GET /kv-cache` (JSON) and `GET /kv-cache/stream` (SSE): the engine's KV view.

The JSON shape is a contract documented in docs/server.md: per group
`num_blocks == blocks_in_use + blocks_cached + blocks_free`, counts from the
block pool itself, request ids but never prompt or output text.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvserve.engine.async_llm import AsyncLLM
from kvserve.engine.kv_view import EngineKVView
from kvserve.kv_cache.snapshot import KVGroupSnapshot, PoolBlockCounts
from kvserve.server.errors import APIError, bad_request
from kvserve.server.serving import sse

logger = logging.getLogger(__name__)

MIN_STREAM_INTERVAL_MS = 100
MAX_STREAM_INTERVAL_MS = 60_000
DEFAULT_STREAM_INTERVAL_MS = 500


def _pool_counts(counts: PoolBlockCounts) -> dict[str, int]:
    return {"num_blocks": counts.num_blocks, "blocks_in_use": counts.blocks_in_use,
            "blocks_cached": counts.blocks_cached, "blocks_free": counts.blocks_free}


def _group_json(group: KVGroupSnapshot) -> dict[str, Any]:
    return {"group_id": group.group_id, "kind": group.kind, "block_size": group.block_size,
            "sliding_window": group.sliding_window, "num_layers": group.num_layers,
            **_pool_counts(group.pool), "blocks_in_tables": group.blocks_in_tables,
            "blocks_cached_for_group": group.blocks_cached_for_group, "hit_blocks": group.hit_blocks}


def kv_view_to_json(view: EngineKVView) -> dict[str, Any]:
    """The `/kv-cache` document (docs/server.md) for an `EngineKVView`."""
    cache = view.kv_cache
    pool = cache.pool
    return {
        "timestamp": view.taken_at_s,
        "block_size": cache.block_size,
        "hash_block_size": cache.hash_block_size,
        "prefix_caching": cache.enable_caching,
        **_pool_counts(pool),
        "kv_cache_usage": pool.blocks_in_use / pool.num_blocks if pool.num_blocks else 0.0,
        "state_pool": None if cache.state_pool is None else _pool_counts(cache.state_pool),
        "groups": [_group_json(group) for group in cache.groups],
        "eviction_queue_head": [dataclasses.asdict(entry) for entry in cache.eviction_queue_head],
        "num_evictions": cache.num_evictions,
        "prefix_cache": {"queries": view.prefix_cache.queries, "hits": view.prefix_cache.hits,
                         "hit_rate": view.prefix_cache.hit_rate},
        "num_running": view.num_running,
        "num_waiting": view.num_waiting,
        "num_preempted": view.num_preempted,
        "num_preemptions": view.num_preemptions,
        "requests": [dataclasses.asdict(request) for request in view.requests],
        "steps": [dataclasses.asdict(step) for step in view.steps],
    }


async def _kv_json(engine: AsyncLLM) -> dict[str, Any]:
    try:
        view = await engine.get_kv_view()
    except Exception as exc:  # noqa: BLE001 - a dead engine or a failed snapshot
        raise APIError(503, f"the KV-cache view is unavailable: {exc}", code="engine_unavailable") from exc
    return kv_view_to_json(view)


async def optional_kv_view(engine: AsyncLLM, timeout_s: float = 5.0) -> EngineKVView | None:
    """The engine's `EngineKVView`, or None when it cannot answer now."""
    try:
        return await engine.get_kv_view(timeout_s=timeout_s)
    except Exception:  # noqa: BLE001 - metrics must render without it
        logger.debug("no KV view for /metrics", exc_info=True)
        return None


def _interval_s(raw_request: Request) -> float:
    text = raw_request.query_params.get("interval_ms", str(DEFAULT_STREAM_INTERVAL_MS))
    try:
        interval_ms = int(text)
    except ValueError:
        raise bad_request(f"interval_ms must be an integer, got {text!r}", param="interval_ms") from None
    if not MIN_STREAM_INTERVAL_MS <= interval_ms <= MAX_STREAM_INTERVAL_MS:
        raise bad_request(f"interval_ms must be in [{MIN_STREAM_INTERVAL_MS}, {MAX_STREAM_INTERVAL_MS}], "
                          f"got {interval_ms}", param="interval_ms")
    return interval_ms / 1e3


async def _stream_views(raw_request: Request, engine: AsyncLLM, interval_s: float) -> AsyncIterator[str]:
    while not await raw_request.is_disconnected():
        try:
            yield sse(await _kv_json(engine))
        except APIError as exc:
            yield sse(exc.to_dict())
            return
        await asyncio.sleep(interval_s)


def add_kv_cache_routes(app: FastAPI, engine: AsyncLLM) -> None:
    """Register `/kv-cache` and `/kv-cache/stream` on `app`."""

    @app.get("/kv-cache")
    async def kv_cache() -> JSONResponse:
        return JSONResponse(await _kv_json(engine))

    @app.get("/kv-cache/stream")
    async def kv_cache_stream(raw_request: Request) -> StreamingResponse:
        interval_s = _interval_s(raw_request)
        return StreamingResponse(_stream_views(raw_request, engine, interval_s), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
