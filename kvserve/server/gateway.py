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


def kv_capacity_tokens(engine: Any) -> int:
    """Tokens the engine's KV pool holds (block 0, the null block, excluded); 0 if unknown."""
    core = getattr(engine, "engine_core", None)
    kv_cache_config = getattr(core, "kv_cache_config", None)
    cache_config = getattr(getattr(engine, "engine_config", None), "cache_config", None)
    if kv_cache_config is None or cache_config is None:
        return 0
    return max(0, int(kv_cache_config.num_blocks) - 1) * int(cache_config.block_size)


def worker_load(engine: Any) -> WorkerLoad:
    """The load figures the gateway's load-aware policies compare."""
    stats = engine.get_stats()
    capacity = kv_capacity_tokens(engine)
    return WorkerLoad(dp_rank=0, num_reqs=int(stats.num_running_reqs),
                      num_waiting_reqs=int(stats.num_waiting_reqs),
                      num_tokens=int(round(float(stats.kv_cache_usage) * capacity)),
                      num_in_flight_reqs=int(stats.num_in_flight_requests),
                      kv_cache_usage=float(stats.kv_cache_usage), kv_capacity_tokens=capacity)


def server_info(engine: Any, served_model_name: str) -> dict[str, Any]:
    """Static facts about this worker, in SGLang's `/server_info` field names."""
    engine_config = engine.engine_config
    parallel = getattr(engine_config, "parallel_config", None)
    scheduler = getattr(engine_config, "scheduler_config", None)
    cache = getattr(engine_config, "cache_config", None)
    return {
        "served_model_name": served_model_name,
        "version": kvserve.__version__,
        "tp_size": int(getattr(parallel, "tensor_parallel_size", 1)),
        "dp_size": 1,
        "context_length": int(engine.max_model_len),
        "max_total_num_tokens": kv_capacity_tokens(engine),
        "max_running_requests": int(getattr(scheduler, "max_num_seqs", 0) or 0),
        "page_size": int(getattr(cache, "block_size", 0) or 0),
        "enable_prefix_caching": bool(getattr(cache, "enable_prefix_caching", False)),
        "is_generation": True,
    }


def model_info(engine: Any, served_model_name: str) -> dict[str, Any]:
    """The model's identity, in SGLang's `/model_info` field names."""
    model_config = engine.model_config
    return {
        "served_model_name": served_model_name,
        "is_generation": True,
        "model_type": getattr(model_config, "model_type", None),
        "architectures": [a for a in [getattr(model_config, "architecture", None)] if a],
    }


def add_gateway_routes(app: FastAPI, engine: Any, served_model_name: str) -> None:
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
