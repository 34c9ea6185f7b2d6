"""Drive the real scheduler + ModelRunner + model through EngineCore in tests."""
from __future__ import annotations

from kvserve.engine.core import EngineCore, EngineCoreRequest
from kvserve.sampling_params import SamplingParams
from kvserve.testing import assert_pool_whole as assert_scheduler_pool_whole
from kvserve.worker.executor import UniProcExecutor
from kvserve.engine.create_config import create_engine_config


class RecordingExecutor(UniProcExecutor):
    """UniProcExecutor that remembers every SchedulerOutput it ran."""

    def __init__(self, engine_config) -> None:
        super().__init__(engine_config)
        self.scheduler_outputs = []

    def execute_model_async(self, scheduler_output):
        self.scheduler_outputs.append(scheduler_output)
        return super().execute_model_async(scheduler_output)

    @property
    def num_block_copies(self) -> int:
        return sum(len(out.kv_cache_block_copies) for out in self.scheduler_outputs)

    @property
    def max_tokens_per_step(self) -> int:
        return max(out.total_num_scheduled_tokens for out in self.scheduler_outputs)


def make_engine(model_path: str, **overrides) -> EngineCore:
    kwargs = dict(kv_cache_memory="8MiB", block_size=4, max_num_seqs=8, max_num_batched_tokens=256,
                  device="cpu", async_scheduling=True)
    kwargs.update(overrides)
    return EngineCore(create_engine_config(model=model_path, **kwargs), executor_class=RecordingExecutor)


def greedy_params(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def run_to_completion(core: EngineCore, prompts: list[list[int]], params, first_id: int = 0,
                      max_steps: int = 10_000) -> dict[str, list[int]]:
    """Add the prompts as requests "first_id", ... and step until all finish; tokens by request id."""
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    tokens: dict[str, list[int]] = {}
    finish_reasons: dict[str, str] = {}
    for i, (prompt, sp) in enumerate(zip(prompts, params_list)):
        request_id = str(first_id + i)
        tokens[request_id] = []
        core.add_request(EngineCoreRequest(request_id, prompt, sp))
    for _ in range(max_steps):
        if not core.has_unfinished_requests():
            break
        for output in core.step():
            tokens[output.request_id].extend(output.new_token_ids)
            if output.finished:
                finish_reasons[output.request_id] = output.finish_reason
    else:
        raise AssertionError(f"requests still unfinished after {max_steps} steps")
    assert set(finish_reasons) == set(tokens), "every request reports a finish"
    return tokens


def assert_pool_whole(core: EngineCore) -> None:
    """Every block is back in the free queue and no request holds KV."""
    assert_scheduler_pool_whole(core.scheduler)


def run_checked(core: EngineCore, prompts: list[list[int]], params):
    """Run the prompts to completion, check that every block came back, and shut the
    engine down: (tokens by request id, the engine's stats after the run)."""
    try:
        outputs = run_to_completion(core, prompts, params)
        stats = core.get_stats()
        assert_pool_whole(core)
        return outputs, stats
    finally:
        core.shutdown()


def sample_many(model_path: str, speculative_config, prompt: list[int], num_samples: int, temperature: float,
                max_tokens: int = 3):
    """`num_samples` seeded samples of `max_tokens` tokens after `prompt`, in large batches:
    (tokens by request id, the run's speculative decoding stats)."""
    core = make_engine(model_path, speculative_config=speculative_config, max_num_seqs=256,
                       max_num_batched_tokens=4096, kv_cache_memory="64MiB")
    try:
        params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=i)
                  for i in range(num_samples)]
        outputs = run_to_completion(core, [prompt] * num_samples, params)
        return outputs, core.get_stats().spec_decoding_stats
    finally:
        core.shutdown()
