"""KV-cache micro-benchmark: allocate+free and prefix-hit operations per second.

A deterministic synthetic trace: `num_requests` requests, each a shared
"system prompt" (one of `num_prefixes`) followed by a unique suffix. Requests
are admitted in order with at most `max_running` alive at once (the oldest is
freed first), as a serving engine would. Phase 1 runs with prefix caching off
(pure allocate/free); phase 2 with it on (lookup, adopt hits, allocate, free).
Hashing the prompts is done before the clock starts.

`python -m kvserve.bench.kv [--num-requests N]` prints the result as JSON.
Where vLLM is importable (never a dependency) the same trace also runs through
its KVCacheManager and the ratios are reported.
"""
from __future__ import annotations

import argparse
import inspect
import json
import logging
import random
import time
from collections import deque
from typing import Any, Callable

from kvserve.kv_cache.interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from kvserve.kv_cache.manager import KVCacheManager
from kvserve.request import Request

logger = logging.getLogger(__name__)


def make_trace(num_requests: int, num_prefixes: int, prefix_len: int, suffix_len: int,
               seed: int = 0) -> list[list[int]]:
    """Prompt token ids: shared prefix i % num_prefixes, then a unique suffix."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(32_000) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    return [prefixes[i % num_prefixes] + [rng.randrange(32_000) for _ in range(suffix_len)]
            for i in range(num_requests)]


def _make_manager(num_blocks: int, block_size: int, enable_caching: bool, max_model_len: int) -> KVCacheManager:
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=8, head_size=64, dtype="bfloat16")
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(["layer0"], spec)])
    return KVCacheManager(config, max_model_len=max_model_len, enable_caching=enable_caching)


def _drive(requests: list[Any], max_running: int, admit: Callable[[Any], None], free: Callable[[Any], None]) -> float:
    running: deque[Any] = deque()
    start = time.perf_counter()
    for request in requests:
        if len(running) == max_running:
            free(running.popleft())
        admit(request)
        running.append(request)
    while running:
        free(running.popleft())
    return time.perf_counter() - start


def _run_kvserve(prompts: list[list[int]], block_size: int, num_blocks: int, max_running: int,
                 enable_caching: bool) -> dict[str, float]:
    manager = _make_manager(num_blocks, block_size, enable_caching, max_model_len=max(map(len, prompts)) + 1)
    hasher = manager.request_block_hasher if enable_caching else None
    requests = [Request(str(i), prompt, block_hasher=hasher) for i, prompt in enumerate(prompts)]
    num_hit_tokens = 0

    def admit(request: Request) -> None:
        nonlocal num_hit_tokens
        hit_blocks, num_hit = manager.get_computed_blocks(request)
        if manager.allocate_slots(request, request.num_tokens - num_hit, num_hit, hit_blocks) is None:
            raise RuntimeError("benchmark pool too small")
        num_hit_tokens += num_hit

    elapsed_s = _drive(requests, max_running, admit, manager.free)
    manager.block_pool.check_invariants({})
    num_tokens = sum(map(len, prompts))
    return {"elapsed_s": elapsed_s, "requests_per_s": len(requests) / elapsed_s,
            "ops_per_s": 2 * len(requests) / elapsed_s, "hit_rate": num_hit_tokens / num_tokens}


def _run_vllm(prompts: list[list[int]], block_size: int, num_blocks: int, max_running: int,
              enable_caching: bool) -> dict[str, float]:
    # Best effort against vLLM v1's public-ish internals; only used when installed.
    import torch
    from vllm.utils.hashing import get_hash_fn_by_name as vllm_hash_fn
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec as VllmFull
    from vllm.v1.kv_cache_interface import KVCacheConfig as VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec as VllmGroup
    from vllm.v1.request import Request as VllmRequest
    from vllm.sampling_params import SamplingParams

    hash_fn = vllm_hash_fn("sha256")
    init_none_hash(hash_fn)
    spec = VllmFull(block_size=block_size, num_kv_heads=8, head_size=64, dtype=torch.bfloat16)
    config = VllmConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[VllmGroup(["layer0"], spec)])
    manager_kwargs: dict[str, Any] = {"hash_block_size": block_size, "enable_caching": enable_caching}
    if "scheduler_block_size" in inspect.signature(VllmKVCacheManager).parameters:
        manager_kwargs["scheduler_block_size"] = block_size  # required from vLLM 0.33
    manager = VllmKVCacheManager(config, max_model_len=max(map(len, prompts)) + 1, **manager_kwargs)
    hasher = get_request_block_hasher(block_size, hash_fn)
    requests = [VllmRequest(request_id=str(i), prompt_token_ids=prompt, sampling_params=SamplingParams(max_tokens=1),
                            pooling_params=None, block_hasher=hasher)
                for i, prompt in enumerate(prompts)]

    num_hit_tokens = 0

    def admit(request: Any) -> None:
        nonlocal num_hit_tokens
        hit_blocks, num_hit = manager.get_computed_blocks(request)[:2]
        num_hit_tokens += num_hit
        if manager.allocate_slots(request, request.num_tokens - num_hit, num_hit, hit_blocks) is None:
            raise RuntimeError("benchmark pool too small")

    elapsed_s = _drive(requests, max_running, admit, manager.free)
    return {"elapsed_s": elapsed_s, "requests_per_s": len(requests) / elapsed_s,
            "ops_per_s": 2 * len(requests) / elapsed_s,
            "hit_rate": num_hit_tokens / sum(len(prompt) for prompt in prompts)}


def run(num_requests: int = 10_000, block_size: int = 16, num_prefixes: int = 32, prefix_len: int = 256,
        suffix_len: int = 64, max_running: int = 64, seed: int = 0, compare_vllm: bool = True) -> dict[str, Any]:
    """Run both phases on one trace; returns a JSON-ready dict.

    `allocate_free.ops_per_s` counts one allocate and one free per request;
    `prefix_hit.requests_per_s` counts lookup + adopt + allocate + free per request.
    """
    prompts = make_trace(num_requests, num_prefixes, prefix_len, suffix_len, seed)
    blocks_per_request = -(-(prefix_len + suffix_len) // block_size)
    # Room for the running window plus every shared prefix staying cached.
    num_blocks = (max_running + 1) * blocks_per_request + num_prefixes * blocks_per_request + 1
    trace = {"num_requests": num_requests, "block_size": block_size, "num_prefixes": num_prefixes,
             "prefix_len": prefix_len, "suffix_len": suffix_len, "max_running": max_running,
             "num_blocks": num_blocks, "seed": seed}
    result: dict[str, Any] = {"trace": trace}
    for phase, caching in (("allocate_free", False), ("prefix_hit", True)):
        result[phase] = _run_kvserve(prompts, block_size, num_blocks, max_running, caching)
    result["vllm"] = None
    if compare_vllm:
        result["vllm"] = _compare_with_vllm(prompts, block_size, num_blocks, max_running, result)
    return result


def _compare_with_vllm(prompts: list[list[int]], block_size: int, num_blocks: int, max_running: int,
                       result: dict[str, Any]) -> dict[str, Any] | None:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return None
    comparison: dict[str, Any] = {}
    try:
        for phase, caching in (("allocate_free", False), ("prefix_hit", True)):
            vllm_phase = _run_vllm(prompts, block_size, num_blocks, max_running, caching)
            comparison[phase] = vllm_phase
            comparison[f"{phase}_ratio"] = result[phase]["ops_per_s"] / vllm_phase["ops_per_s"]
    except Exception as exc:  # vLLM's internals move between releases
        logger.warning("vLLM comparison failed: %s", exc)
        comparison["error"] = repr(exc)
    return comparison


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=10_000)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-running", type=int, default=64)
    parser.add_argument("--no-vllm", action="store_true", help="skip the vLLM comparison")
    args = parser.parse_args(argv)
    result = run(num_requests=args.num_requests, block_size=args.block_size, max_running=args.max_running,
                 compare_vllm=not args.no_vllm)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
