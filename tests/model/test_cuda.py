"""The same correctness checks on a CUDA device (skipped without one)."""
from __future__ import annotations

import pytest
import torch

from kvserve.model.config import ModelConfig
from kvserve.model.loader import load_model
from paged_kv_helper import VOCAB, PagedRunner, hf_greedy, load_hf, run_greedy, save_tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _prompts(lengths):
    generator = torch.Generator().manual_seed(0)
    return {f"r{i}": torch.randint(3, VOCAB, (n,), generator=generator).tolist() for i, n in enumerate(lengths)}


@pytest.mark.parametrize("family,sliding_window_kv", [("llama", "sliding"), ("qwen3", "sliding"),
                                                       ("gemma2", "sliding"), ("gemma3", "circular")])
def test_float32_on_cuda_matches_transformers(tmp_path, family, sliding_window_kv):
    path = save_tiny_model(family, tmp_path)
    hf = load_hf(path)
    model = load_model(ModelConfig.from_path(path), device="cuda")
    prompts = _prompts([3, 29, 40])
    # TF32 matmuls would perturb float32 logits beyond the bound below.
    torch.backends.cuda.matmul.allow_tf32 = False
    tokens, logits = run_greedy(PagedRunner(model, block_size=4, sliding_window_kv=sliding_window_kv),
                                prompts, 6, chunk=11)
    for req_id, prompt in prompts.items():
        ref_tokens, ref_logits = hf_greedy(hf, prompt, 6)
        assert tokens[req_id] == ref_tokens
        assert max((a - b).abs().max().item() for a, b in zip(logits[req_id], ref_logits)) < 1e-3


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_on_cuda_tracks_float32(tmp_path, dtype):
    path = save_tiny_model("llama", tmp_path)
    prompts = _prompts([13, 21])
    _, ref = run_greedy(PagedRunner(load_model(ModelConfig.from_path(path))), prompts, 1, chunk=64)
    model = load_model(ModelConfig.from_path(path, dtype=dtype), device="cuda")
    _, ours = run_greedy(PagedRunner(model), prompts, 1, chunk=64)
    for req_id in prompts:
        assert (ours[req_id][0] - ref[req_id][0]).abs().max() < 0.05 * ref[req_id][0].abs().max()
