"""Tiny models of several families with their prompt chunks attended by the tiled prefill
kernel (csrc/attention/prefill_attention.c) against the same models with that switched off
(KVSERVE_PREFILL_ATTENTION=0: torch's SDPA and padded matmuls), teacher forced on the same
tokens: whole prompts, chunked prefill across block boundaries (each later chunk attends to
the cached blocks), a prefix hit on shared blocks, sliding windows and soft-capping (Mistral,
Gemma 2 and 3), attention sinks (gpt-oss). Both paths compute the same float32 math in another order: the logits lie
within tests/helpers/float_order.py's derived bound."""
from __future__ import annotations

import pytest

from kvserve.model.loader import load_model
from kvserve.native import cpu_kernels
from helpers.float_order import TINY_MODEL_REORDER_BOUND
from helpers.kernel_switches import env_kernels
from paged_kv_helper import PagedRunner, prompts_of_lengths, run_teacher_forced, tiny_configs

pytestmark = pytest.mark.skipif(cpu_kernels.load_library() is None, reason="no native kernels")

NUM_NEW = 4


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    return tiny_configs(tmp_path_factory)


def _forced_logits(config, prefill_attention: bool, chunk: int, monkeypatch) -> tuple[dict, int]:
    """Logits of every request teacher forced on the same sequences, and how many calls the
    prefill kernel took. "shared" hits the first 16 tokens of "a" (4 whole blocks)."""
    calls = [0]
    kernel = cpu_kernels.prefill_attention_cpu

    def counting(*args, **kwargs):
        calls[0] += 1
        return kernel(*args, **kwargs)
    monkeypatch.setattr(cpu_kernels, "prefill_attention_cpu", counting)
    model = load_model(config, kernel_config=env_kernels(prefill_attention=prefill_attention))
    runner = PagedRunner(model, block_size=4)
    prompts = prompts_of_lengths([45, 38, 70, 20], seed=11)
    sequences = {r: p + prompts_of_lengths([NUM_NEW], seed=12 + i)["r0"] for i, (r, p) in enumerate(prompts.items())}
    prompt_lens = {r: len(p) for r, p in prompts.items()}
    logits = run_teacher_forced(runner, sequences, prompt_lens, chunk)
    shared = [blocks[:4] for blocks in runner.requests["r0"].block_ids]
    tail = prompts_of_lengths([30], seed=13)["r0"]
    runner.add("shared", sequences["r0"][:16] + tail, shared_blocks=shared, num_computed=16)
    logits.update(run_teacher_forced(runner, {"shared": sequences["r0"][:16] + tail}, {"shared": 40}, chunk))
    return logits, calls[0]


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gemma2", "gemma3", "gpt_oss"])
@pytest.mark.parametrize("chunk", [20, 64])
def test_prefill_kernel_logits_match_the_torch_path(configs, family, chunk, monkeypatch):
    config = configs(family)
    ours, calls = _forced_logits(config, True, chunk, monkeypatch)
    theirs, torch_calls = _forced_logits(config, False, chunk, monkeypatch)
    assert calls > 0 and torch_calls == 0
    for req_id, rows in theirs.items():
        scale = max(1.0, float(rows.abs().max()))
        assert float((ours[req_id] - rows).abs().max()) <= TINY_MODEL_REORDER_BOUND * scale, req_id
