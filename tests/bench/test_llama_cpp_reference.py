"""The batched llama.cpp reference (kvserve/bench/references.py) decodes what
transformers decodes greedily, with more requests than sequence slots and
prompts longer than one llama.cpp batch. Runs only where llama-cpp-python is
installed (an optional reference, see BENCHMARKS.md)."""
from __future__ import annotations

import pytest
import torch

from kvserve.bench.workloads import BenchRequest, Workload
from model.paged_kv_helper import VOCAB, hf_greedy, load_hf, save_tiny_model

pytest.importorskip("llama_cpp")
gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QType  # noqa: E402
from helpers.gguf_writer import write_gguf  # noqa: E402

from kvserve.bench.references import LlamaCppRunner  # noqa: E402


def test_batched_llama_cpp_matches_transformers_greedy(tmp_path):
    hf = load_hf(save_tiny_model("llama", tmp_path))
    path = str(tmp_path / "tiny.gguf")
    write_gguf(hf, path, QType.F32, tokenizer_model="no_vocab")
    generator = torch.Generator().manual_seed(3)
    requests = [BenchRequest(torch.randint(3, VOCAB, (n,), generator=generator).tolist(), out)
                for n, out in [(5, 6), (23, 3), (11, 8), (2, 5), (17, 4)]]
    runner = LlamaCppRunner(path, max_batch=2, n_batch=8)  # 5 requests, 2 slots, chunked prompts
    result = runner.run(Workload("t", requests, "test"))
    assert result.output_tokens == sum(r.output_len for r in requests)
    for request, tokens in zip(requests, runner.last_output_token_ids):
        expected, _ = hf_greedy(hf, request.prompt_token_ids, request.output_len)
        assert tokens == expected
