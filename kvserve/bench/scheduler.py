"""Scheduler microbenchmark: microseconds per `schedule()` + `update_from_output()`.

Steady decode: `num_running` requests of `prompt_len` distinct prompt tokens
are prefilled (untimed), then every step decodes one token for each of them
(prefix caching on, as in serving). Only the scheduler's two calls are timed;
the fake runner that produces the tokens is not. When vLLM is importable
(optional, never a dependency) the same scenario runs through vLLM's
scheduler in the same process and the ratio is reported.

    python -m kvserve.bench.scheduler [--num-running 64,256,1024] [--steps N]
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import inspect
import json
import os
import tempfile
import time
from typing import Any, Callable

from kvserve.kv_cache.interface import cdiv
from kvserve.testing import FakeModelRunner, create_requests, create_scheduler


def run(num_running: tuple[int, ...] = (64, 256, 1024), prompt_len: int = 512, output_len: int = 256,
        block_size: int = 16, num_timed_steps: int | None = None, compare_vllm: bool = True) -> dict[str, Any]:
    """Per running-request count: microseconds per step (schedule + update), for
    kvserve and, where importable, vLLM. At most `num_timed_steps` (default
    `output_len - 2`) decode steps are timed, fewer if a request would finish
    sooner (early admissions decode while later ones prefill)."""
    num_steps = num_timed_steps or max(output_len - 2, 1)
    results: dict[str, Any] = {
        "scenario": {"prompt_len": prompt_len, "output_len": output_len, "block_size": block_size,
                     "max_timed_decode_steps": num_steps, "prefix_caching": True},
        "kvserve": {}, "vllm": None, "ratio_kvserve_over_vllm": None,
    }
    vllm_available = compare_vllm and importlib.util.find_spec("vllm") is not None
    if vllm_available:
        results["vllm"] = {}
        results["ratio_kvserve_over_vllm"] = {}
    for num_reqs in num_running:
        ours = _time_kvserve(num_reqs, prompt_len, output_len, block_size, num_steps)
        results["kvserve"][str(num_reqs)] = ours
        if vllm_available:
            try:
                theirs = _time_vllm(num_reqs, prompt_len, output_len, block_size, num_steps)
            except Exception as exc:  # vLLM's internals move between versions
                results["vllm"][str(num_reqs)] = {"error": f"{type(exc).__name__}: {exc}"}
                continue
            results["vllm"][str(num_reqs)] = theirs
            results["ratio_kvserve_over_vllm"][str(num_reqs)] = ours["us_per_step"] / theirs["us_per_step"]
    return results


def _num_blocks(num_reqs: int, prompt_len: int, output_len: int, block_size: int) -> int:
    return num_reqs * cdiv(prompt_len + output_len, block_size) + 2


def _time_kvserve(num_reqs: int, prompt_len: int, output_len: int, block_size: int,
                  num_steps: int) -> dict[str, float]:
    scheduler = create_scheduler(
        num_blocks=_num_blocks(num_reqs, prompt_len, output_len, block_size), block_size=block_size,
        max_num_seqs=num_reqs, max_num_batched_tokens=max(8192, num_reqs),
        max_model_len=prompt_len + output_len + 1)
    for request in create_requests(num_reqs, max_tokens=output_len,
                                   prompt_token_ids=_prompts(num_reqs, prompt_len)):
        scheduler.add_request(request)
    return _time_steps(scheduler, FakeModelRunner().execute, num_reqs, num_steps)


def _prompts(num_reqs: int, prompt_len: int) -> list[list[int]]:
    return [[(i * 7919 + j) % 50_000 for j in range(prompt_len)] for i in range(num_reqs)]


def _time_steps(scheduler: Any, execute: Callable[[Any], Any], num_reqs: int,
                num_steps: int) -> dict[str, float]:
    """Prefill (untimed) until every request decodes, then time `num_steps`
    steps: the scheduler's two calls only, not the runner's work."""
    def all_decoding() -> bool:
        return (len(scheduler.running) == num_reqs
                and all(request.num_output_tokens > 0 for request in scheduler.running))

    while not all_decoding():
        scheduler_output = scheduler.schedule()
        scheduler.update_from_output(scheduler_output, execute(scheduler_output))
    # Early admissions decode during the others' prefill: stop before any finishes.
    headroom = min(request.max_tokens - request.num_output_tokens for request in scheduler.running) - 1
    num_steps = max(min(num_steps, headroom), 1)
    gc.collect()
    gc.disable()
    try:
        wall_s = cpu_s = 0.0
        for _ in range(num_steps):
            start, start_cpu = time.perf_counter(), time.process_time()
            scheduler_output = scheduler.schedule()
            wall_s += time.perf_counter() - start
            cpu_s += time.process_time() - start_cpu
            runner_output = execute(scheduler_output)
            start, start_cpu = time.perf_counter(), time.process_time()
            scheduler.update_from_output(scheduler_output, runner_output)
            wall_s += time.perf_counter() - start
            cpu_s += time.process_time() - start_cpu
    finally:
        gc.enable()
    us_per_step = wall_s / num_steps * 1e6
    # CPU time too: on a shared machine wall time includes waiting for a core.
    return {"us_per_step": us_per_step, "us_per_request_step": us_per_step / num_reqs,
            "cpu_us_per_step": cpu_s / num_steps * 1e6, "num_running": num_reqs, "steps": num_steps}


def _time_vllm(num_reqs: int, prompt_len: int, output_len: int, block_size: int,
               num_steps: int) -> dict[str, float]:
    """The same scenario through vLLM's v1 scheduler. Only used when vLLM is installed."""
    scheduler, execute = _build_vllm_scheduler(
        _prompts(num_reqs, prompt_len), output_len, block_size,
        _num_blocks(num_reqs, prompt_len, output_len, block_size), max_num_batched_tokens=max(8192, num_reqs))
    return _time_steps(scheduler, execute, num_reqs, num_steps)


def _build_vllm_scheduler(prompts: list[list[int]], output_len: int, block_size: int, num_blocks: int,
          max_num_batched_tokens: int) -> tuple[Any, Callable[[Any], Any]]:
    """A vLLM v1 scheduler with `prompts` added, and a fake execute function for
    it, built the way vLLM's own unit tests build one (`tests/v1/core/utils.py`).
    That needs a model config vLLM can resolve; any failure is reported by
    the caller as an error entry instead of a measurement."""
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    import torch  # vLLM itself needs it

    try:
        from vllm.utils.hashing import sha256
    except ImportError:
        from vllm.utils import sha256  # older layouts

    max_model_len = len(prompts[0]) + output_len + 1
    model_config = ModelConfig(model=_local_model_dir(), dtype="float16", seed=42,
                               max_model_len=max_model_len, skip_tokenizer_init=True)
    scheduler_kwargs: dict[str, Any] = {}
    if "is_encoder_decoder" in inspect.signature(SchedulerConfig).parameters:
        scheduler_kwargs["is_encoder_decoder"] = False  # required from vLLM 0.1x on
    scheduler_config = SchedulerConfig(max_num_seqs=len(prompts), max_num_batched_tokens=max_num_batched_tokens,
                                       max_model_len=max_model_len, enable_chunked_prefill=True,
                                       **scheduler_kwargs)
    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=True)
    cache_config.num_gpu_blocks = num_blocks
    # The device is named so that vLLM need not detect one (it may find no GPU here).
    vllm_config = VllmConfig(scheduler_config=scheduler_config, model_config=model_config,
                             cache_config=cache_config, device_config=DeviceConfig(device="cpu"))
    kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1,
                                                      dtype=torch.float32))])
    scheduler = Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config, log_stats=True,
                          structured_output_manager=StructuredOutputManager(vllm_config),
                          block_size=block_size)
    init_none_hash(sha256)
    block_hasher = get_request_block_hasher(block_size, sha256)
    request_kwargs: dict[str, Any] = {"block_hasher": block_hasher}
    if "eos_token_id" in inspect.signature(Request).parameters:
        request_kwargs["eos_token_id"] = None  # removed from Request in later vLLM versions
    for i, prompt in enumerate(prompts):
        scheduler.add_request(Request(
            request_id=str(i), prompt_token_ids=prompt,
            sampling_params=SamplingParams(ignore_eos=True, max_tokens=output_len),
            pooling_params=None, **request_kwargs))

    def execute(scheduler_output: Any) -> Any:
        req_ids = list(scheduler_output.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            request = scheduler.requests[req_id]
            done = request.num_computed_tokens >= request.num_tokens
            sampled.append([1] if done else [])
        return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={},
                                 pooler_output=[])

    return scheduler, execute


# SmolLM2-135M's shape; vLLM's ModelConfig only reads config.json, so no weights
# and no hub access are needed (the machine running the bench may be offline).
_LOCAL_MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
    "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
    "num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-05, "rope_theta": 100000.0, "torch_dtype": "bfloat16", "hidden_act": "silu",
    "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
}


def _local_model_dir() -> str:
    """A temporary directory holding only a config.json vLLM can resolve offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model_dir = tempfile.mkdtemp(prefix="kvserve-vllm-config-")
    with open(os.path.join(model_dir, "config.json"), "w") as config_file:
        json.dump(_LOCAL_MODEL_CONFIG, config_file)
    return model_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-running", default="64,256,1024")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=None, help="timed decode steps per size")
    args = parser.parse_args(argv)
    result = run(tuple(int(n) for n in args.num_running.split(",")), args.prompt_len, args.output_len,
                 args.block_size, args.steps)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
