"""Speculative decoding with a draft model (`"method": "draft_model"`) through the real engine.

The drafts are tiny random models sharing the target's 256-token vocabulary:
  * `exact`: the target's own weights under another path. Its proposals are
    the target's greedy tokens only if the draft's KV (its own groups of the
    same manager) is right at every position, so greedy acceptance must be
    100% through preemption, prefix hits, CoW copies and chunked prefill: any
    draft block freed early, reused or left unwritten would lower it.
  * `noisy`: the target's weights plus noise, accepted about a third of the
    time, so steps mix accepted prefixes, rollbacks and bonus tokens.
Greedy outputs must equal the engine without speculation (itself checked
against transformers in test_runner_vs_transformers). Under async scheduling
a request's next step, with placeholder drafts, is scheduled while the step
verifying its previous drafts is in flight.
"""
from __future__ import annotations

import pytest
import torch
import transformers

from engine_helpers import RecordingExecutor, assert_pool_whole, greedy_params, run_checked, run_to_completion
from tiny_models import random_prompts, save_tiny_model
from kvserve.config import ConfigError
from kvserve.engine.core import EngineCore
from kvserve.sampling_params import SamplingParams
from kvserve.engine.create_config import create_engine_config

SETTINGS = dict(kv_cache_memory="8MiB", block_size=4, max_num_seqs=8, device="cpu",
                max_num_batched_tokens=40, hash_block_size=2)
# About two requests' worth of KV for target + draft: preemption.
SMALL_POOL = {"llama": "192KiB", "gemma2": "288KiB"}
NOISE = {"exact": 0.0, "noisy": 0.01}


def save_draft(target_path: str, path, noise: float) -> str:
    """The target's weights plus Gaussian noise of std `noise`, saved under `path`."""
    model = transformers.AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * noise)
    model.save_pretrained(str(path), safe_serialization=True)
    return str(path)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft")
    paths = {kind: save_tiny_model(kind, root / kind) for kind in ("llama", "gemma2")}
    for name, noise in NOISE.items():
        paths[name] = save_draft(paths["llama"], root / name, noise)
    return paths


class HeldBlocksExecutor(RecordingExecutor):
    """Asserts, as each step is submitted, that every block of every group a
    scheduled request's table holds is referenced (none freed while in use)."""

    scheduler = None

    def execute_model_async(self, scheduler_output):
        if self.scheduler is not None:
            manager = self.scheduler.kv_cache_manager
            for req_id in scheduler_output.num_scheduled_tokens:
                for group_block_ids in manager.get_block_ids(req_id):
                    for block_id in group_block_ids:
                        assert block_id == 0 or manager.block_pool.blocks[block_id].ref_cnt > 0
        return super().execute_model_async(scheduler_output)


def _engine(model: str, draft: str | None, k: int = 3, **overrides) -> EngineCore:
    spec = None if draft is None else {"model": draft, "num_speculative_tokens": k, "min_acceptance_rate": 0.0,
                                       "draft_token_cost": 0.0,
                                       "disable_by_batch_size": 64}
    config = create_engine_config(model=model, speculative_config=spec, **{**SETTINGS, **overrides})
    core = EngineCore(config, executor_class=HeldBlocksExecutor)
    core.executor.scheduler = core.scheduler
    return core


def _prompts() -> list[list[int]]:
    prompts = random_prompts(4, 10, 40, seed=5)
    return prompts + [prompts[0], prompts[1][:22] + [7, 8, 9]]  # a sibling and a partial-block hit


def _params() -> list[SamplingParams]:
    stop = SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[17, 99])
    return [greedy_params(40), greedy_params(33), stop, greedy_params(40, logprobs=2), greedy_params(40),
            greedy_params(25)]


def _run(core: EngineCore):
    outputs, stats = run_checked(core, _prompts(), _params())
    return outputs, stats.spec_decoding_stats


@pytest.mark.parametrize("kind,overrides", [
    ("llama", {}),
    ("llama", {"async_scheduling": False}),
    ("gemma2", {}),
])
def test_greedy_draft_model_is_lossless_and_keeps_its_kv(paths, kind, overrides):
    overrides = {"kv_cache_memory": SMALL_POOL[kind], **overrides}
    expected, _ = _run(_engine(paths[kind], None, **overrides))
    for draft in ("exact", "noisy"):
        core = _engine(paths[kind], paths[draft], **overrides)
        groups = core.scheduler.kv_cache_config.kv_cache_groups
        got, stats = _run(core)
        assert got == expected, draft
        assert any(name.startswith("draft.") for name in groups[-1].layer_names)
        assert not any(name.startswith("draft.") for name in groups[0].layer_names)
        assert core.scheduler.num_preemptions > 0
        if kind == "llama":  # the hybrid model's prefix hits end on whole blocks
            assert core.executor.num_block_copies > 0
        assert stats.num_drafts > 10
        if overrides.get("async_scheduling", True):
            # Steps scheduled while the previous one, verifying drafts, was in flight,
            # themselves with drafts the runner filled in.
            assert any(set(out.after_unverified_drafts_req_ids) & set(out.scheduled_spec_decode_tokens)
                       for out in core.executor.scheduler_outputs)
        if kind == "llama" and draft == "exact":
            assert stats.num_accepted_tokens == stats.num_draft_tokens
        elif kind == "llama":
            assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_one_draft_token_and_a_roomy_pool(paths):
    """k = 1, nothing preempted, long outputs near max_model_len."""
    overrides = dict(kv_cache_memory="4MiB", max_model_len=96, max_num_batched_tokens=256)
    prompts, params = random_prompts(3, 20, 40, seed=9), greedy_params(80)
    plain = _engine(paths["llama"], None, **overrides)
    expected = run_to_completion(plain, prompts, params)
    plain.shutdown()
    core = _engine(paths["llama"], paths["exact"], k=1, **overrides)
    try:
        assert run_to_completion(core, prompts, params) == expected
        stats = core.get_stats().spec_decoding_stats
        assert stats.num_drafts > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
        assert_pool_whole(core)
    finally:
        core.shutdown()


def test_draft_with_another_vocabulary_is_refused(paths, tmp_path):
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512)
    transformers.LlamaForCausalLM(config).save_pretrained(str(tmp_path / "other"), safe_serialization=True)
    with pytest.raises(ConfigError, match="vocabulary of 300 tokens"):
        create_engine_config(model=paths["llama"], device="cpu",
                            speculative_config={"method": "draft_model", "model": str(tmp_path / "other")})


def test_draft_model_config_errors(paths):
    with pytest.raises(ConfigError, match='needs "model"'):
        create_engine_config(model=paths["llama"], device="cpu", speculative_config={"method": "draft_model"})
    with pytest.raises(ConfigError, match="tensor_parallel_size 1"):
        create_engine_config(model=paths["llama"], device="cpu", tensor_parallel_size=2,
                            speculative_config={"model": paths["exact"]})
    with pytest.raises(ConfigError, match="does not exist|not found|no config"):
        create_engine_config(model=paths["llama"], device="cpu",
                            speculative_config={"model": paths["llama"] + "-missing"})
