"""The scheduler benchmark's scenario built on vLLM's v1 scheduler (optional).

Imported only when `vllm` is installed; never a dependency. Built the way
vLLM's own unit tests build a scheduler (`tests/v1/core/utils.py`), which
needs a model config vLLM can resolve; any failure is reported by the
caller as an error entry instead of a measurement.
"""
from __future__ import annotations

from typing import Any, Callable


def build(prompts: list[list[int]], output_len: int, block_size: int, num_blocks: int,
          max_num_batched_tokens: int) -> tuple[Any, Callable[[Any], Any]]:
    """A vLLM scheduler with `prompts` added, and a fake execute function for it."""
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    try:
        from vllm.utils.hashing import sha256
    except ImportError:
        from vllm.utils import sha256  # older layouts

    max_model_len = len(prompts[0]) + output_len + 1
    model_config = ModelConfig(model="facebook/opt-125m", dtype="float16", seed=42,
                               max_model_len=max_model_len)
    scheduler_config = SchedulerConfig(max_num_seqs=len(prompts), max_num_batched_tokens=max_num_batched_tokens,
                                       max_model_len=max_model_len, enable_chunked_prefill=True)
    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=True)
    cache_config.num_gpu_blocks = num_blocks
    vllm_config = VllmConfig(scheduler_config=scheduler_config, model_config=model_config,
                             cache_config=cache_config)
    kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1,
                                                      dtype=torch.float32))])
    scheduler = Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config, log_stats=True,
                          structured_output_manager=StructuredOutputManager(vllm_config),
                          block_size=block_size)
    init_none_hash(sha256)
    block_hasher = get_request_block_hasher(block_size, sha256)
    for i, prompt in enumerate(prompts):
        scheduler.add_request(Request(
            request_id=str(i), prompt_token_ids=prompt,
            sampling_params=SamplingParams(ignore_eos=True, max_tokens=output_len),
            pooling_params=None, eos_token_id=None, block_hasher=block_hasher))

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
