"""What a cache-aware router asks of an HTTP worker, answered from the engine.

SGLang's Model Gateway (`sglang-router`) registers an HTTP worker by calling
`/health`, then `/server_info` and `/model_info` (falling back to the older
`/get_server_info` and `/get_model_info`), and its load monitor polls
`/get_load` for the `power_of_two` policy. The shapes follow SGLang's own
server: `/get_load` is one entry per data-parallel rank (kvserve has one)
with the running and waiting request counts and the tokens held in the KV
cache. Every figure is read from the engine's latest stats snapshot.

No model or tokenizer path is reported: the gateway would then try to load
a tokenizer from it (a download attempt for a name it does not find on
disk), which it does not need for the HTTP policies.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

import kvserve
from kvserve.engine.async_llm import AsyncLLM


@dataclass
class WorkerLoad:
    """One `/get_load` entry: the engine's queue and KV-cache occupancy now."""

    dp_rank: int
    num_reqs: int
    num_waiting_reqs: int
    num_tokens: int
    num_in_flight_reqs: int
    kv_cache_usage: float
    kv_capacity_tokens: int


def kv_capacity_tokens(engine: AsyncLLM) -> int:
    """Tokens the engine's KV pool holds (block 0, the null block, excluded)."""
    num_blocks = engine.engine_core.kv_cache_config.num_blocks
    return max(0, num_blocks - 1) * engine.engine_config.cache_config.block_size


def worker_load(engine: AsyncLLM) -> WorkerLoad:
    """The load figures the gateway's load-aware policies compare."""
    stats = engine.get_stats()
    capacity = kv_capacity_tokens(engine)
    return WorkerLoad(dp_rank=0, num_reqs=int(stats.num_running_reqs),
                      num_waiting_reqs=int(stats.num_waiting_reqs),
                      num_tokens=int(round(float(stats.kv_cache_usage) * capacity)),
                      num_in_flight_reqs=int(stats.num_in_flight_requests),
                      kv_cache_usage=float(stats.kv_cache_usage), kv_capacity_tokens=capacity)


def server_info(engine: AsyncLLM, served_model_name: str) -> dict[str, Any]:
    """Static facts about this worker, in SGLang's `/server_info` field names."""
    engine_config = engine.engine_config
    cache = engine_config.cache_config
    return {
        "served_model_name": served_model_name,
        "version": kvserve.__version__,
        "tp_size": engine_config.parallel_config.tensor_parallel_size,
        "dp_size": 1,
        "context_length": engine.max_model_len,
        "max_total_num_tokens": kv_capacity_tokens(engine),
        "max_running_requests": engine_config.scheduler_config.max_num_seqs,
        "page_size": cache.block_size,
        "enable_prefix_caching": cache.enable_prefix_caching,
        "is_generation": True,
    }


def model_info(engine: AsyncLLM, served_model_name: str) -> dict[str, Any]:
    """The model's identity, in SGLang's `/model_info` field names."""
    model_config = engine.model_config
    return {
        "served_model_name": served_model_name,
        "is_generation": True,
        "model_type": model_config.model_type,
        "architectures": [model_config.architecture],
    }


def add_gateway_routes(app: FastAPI, engine: AsyncLLM, served_model_name: str) -> None:
    """Mount the worker-information routes a router polls (no API key: like /health)."""

    async def get_load() -> JSONResponse:
        return JSONResponse([asdict(worker_load(engine))])

    async def get_server_info() -> JSONResponse:
        return JSONResponse(server_info(engine, served_model_name))

    async def get_model_info() -> JSONResponse:
        return JSONResponse(model_info(engine, served_model_name))

    app.add_api_route("/get_load", get_load, methods=["GET"])
    for path in ("/server_info", "/get_server_info"):
        app.add_api_route(path, get_server_info, methods=["GET"])
    for path in ("/model_info", "/get_model_info"):
        app.add_api_route(path, get_model_info, methods=["GET"])
