"""SamplingParams(prompt_logprobs=k) on the default model (SmolLM2-135M-Instruct).

Oracles: llama.cpp's perplexity of tests/model/data/perplexity.txt (26.72, llama-cpp-python
0.3.36, logits_all, one sequence), transformers float32 on the dequantized GGUF, and
kvserve's own single unchunked run for chunked, batched and prefix-hit runs.

The float32 bound (same float32 network, summed in another order): a float32 dot product of
length K, in any order, is off by about sqrt(K) * u relative to its terms (u = 2^-24; the
probabilistic bound of Higham and Mary, 2019). Each of the L layers adds such an error to the
residual stream and the LM head one more, so a logit is off by at most
(L + 1) * sqrt(K) * u * max|logit| with K the longest inner dimension (the MLP's); a logprob,
logit - logsumexp(logits), by twice that. On this model (L = 30, K = 1536, max|logit| ~39)
that is ~5.6e-3, computed below from the reference's own logits.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

from kvserve.engine.model_path import default_model_path
from kvserve.engine.llm import LLM
from kvserve.sampling_params import SamplingParams

TEXT = os.path.join(os.path.dirname(__file__), "..", "model", "data", "perplexity.txt")
LLAMA_CPP_PERPLEXITY = 26.72  # llama-cpp-python 0.3.36, logits_all, the whole text as one sequence
FLOAT32 = dict(quantization="none", dtype="float32", kv_cache_dtype="float32")
SCORE = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3)


def _text_token_ids(tokenizer) -> list[int]:
    """The perplexity text as tests/model/test_quantized_accuracy.py tokenizes it."""
    with open(TEXT) as f:
        return list(tokenizer.encode(f.read()))


def _own_logprobs(output, prompt: list[int]) -> list[float]:
    """Each prompt token's own logprob (tokens 1..n-1), checking the shape vLLM returns."""
    scored = output.prompt_logprobs
    assert output.prompt_token_ids == prompt
    assert len(scored) == len(prompt) and scored[0] is None
    assert all(position is not None and token in position for position, token in zip(scored[1:], prompt[1:]))
    return [scored[i][prompt[i]].logprob for i in range(1, len(prompt))]


def _float32_bound(config, reference_logits: torch.Tensor) -> float:
    """The derivation in the module docstring, for this model and these logits."""
    inner = max(config.hidden_size, config.intermediate_size)
    per_logit = (config.num_hidden_layers + 1) * math.sqrt(inner) * 2.0 ** -24 * reference_logits.abs().max().item()
    return 2 * per_logit


@pytest.fixture(scope="module")
def float32_llm():
    with LLM(max_model_len=1024, kv_cache_memory="64MiB", **FLOAT32) as llm:
        yield llm


@pytest.fixture(scope="module")
def text_ids(float32_llm):
    return _text_token_ids(float32_llm.get_tokenizer())


def test_prompt_logprobs_shape_top_k_and_ranks(float32_llm, text_ids):
    prompt = text_ids[:24]
    output = float32_llm.generate([{"prompt_token_ids": prompt}], SCORE, use_tqdm=False)[0]
    own = _own_logprobs(output, prompt)
    assert all(lp <= 0 for lp in own)
    for position, token in zip(output.prompt_logprobs[1:], prompt[1:]):
        top = sorted((lp for tid, lp in position.items() if lp.rank <= 3), key=lambda lp: lp.rank)
        assert [lp.rank for lp in top] == [1, 2, 3]
        assert top[0].logprob >= top[1].logprob >= top[2].logprob
        mine = position[token]
        assert sum(lp.logprob > mine.logprob for lp in top) <= mine.rank - 1
    # No prompt logprobs unless asked; the sampled token's logprobs are independent of them.
    plain = float32_llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1),
                                 use_tqdm=False)[0]
    assert plain.prompt_logprobs is None
    one_token = float32_llm.generate([{"prompt_token_ids": prompt[:1]}], SCORE, use_tqdm=False)[0]
    assert one_token.prompt_logprobs == [None]


def test_chunked_batched_and_prefix_hit_runs_equal_the_single_run(float32_llm, text_ids):
    prompt, other = text_ids[:300], text_ids[400:500]
    single = _own_logprobs(float32_llm.generate([{"prompt_token_ids": prompt}], SCORE, use_tqdm=False)[0], prompt)
    # A prefix hit is declined for a request that needs its prompt's logprobs: it computes the
    # same prompt in the same step shape as the single run, with the same kernels: bit for bit.
    float32_llm.generate([{"prompt_token_ids": prompt[:200]}], SamplingParams(temperature=0, max_tokens=1),
                         use_tqdm=False)
    after_hit = float32_llm.generate([{"prompt_token_ids": prompt}], SCORE, use_tqdm=False)[0]
    assert after_hit.num_cached_tokens == 0
    assert _own_logprobs(after_hit, prompt) == single
    # Batched with another prompt (other GEMM shapes) and chunked (64-token steps reading the
    # earlier chunks from the KV cache): float32 summed in another order, the module's bound
    # (max|logit| of this model on this text: 38.6 in transformers float32; 40 here).
    bound = 2 * (30 + 1) * math.sqrt(1536) * 2.0 ** -24 * 40.0
    batched = float32_llm.generate([{"prompt_token_ids": prompt}, {"prompt_token_ids": other}], SCORE,
                                   use_tqdm=False)
    assert max(abs(a - b) for a, b in zip(_own_logprobs(batched[0], prompt), single)) <= bound
    _own_logprobs(batched[1], other)
    with LLM(max_model_len=1024, kv_cache_memory="64MiB", max_num_batched_tokens=64, enable_chunked_prefill=True,
             **FLOAT32) as chunked_llm:
        chunked = chunked_llm.generate([{"prompt_token_ids": prompt}], SCORE, use_tqdm=False)[0]
        scheduler = chunked_llm.engine_core.scheduler
        pool = scheduler.kv_cache_manager.block_pool
        assert not scheduler.has_unfinished_requests()
        assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1  # every block back (but the null one)
    assert max(abs(a - b) for a, b in zip(_own_logprobs(chunked, prompt), single)) <= bound


@pytest.mark.slow
@pytest.mark.parametrize("native_decoder", ["1", "0"])
def test_prompt_logprobs_match_transformers_float32(monkeypatch, native_decoder):
    """A 100-token prompt: one step the native decoder runs (<= 128 tokens), or the per-op path."""
    import transformers

    monkeypatch.setenv("KVSERVE_NATIVE_DECODER", native_decoder)
    path = default_model_path()
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32,
        attn_implementation="eager").eval()
    with LLM(max_model_len=512, kv_cache_memory="32MiB", **FLOAT32) as llm:
        prompt = _text_token_ids(llm.get_tokenizer())[:100]
        output = llm.generate([{"prompt_token_ids": prompt}], SCORE, use_tqdm=False)[0]
    with torch.inference_mode():
        logits = reference(torch.tensor([prompt])).logits[0, :-1].float()
    expected = torch.log_softmax(logits, dim=-1)
    bound = _float32_bound(reference.config, logits)
    assert bound < 1e-2
    for index, position in enumerate(output.prompt_logprobs[1:]):
        for token_id, logprob in position.items():  # the prompt token and the top 3
            assert abs(logprob.logprob - expected[index, token_id].item()) <= bound, (index, token_id)


@pytest.mark.slow
def test_perplexity_from_prompt_logprobs_matches_llama_cpp():
    """The default (quantized) model over the whole text as one sequence, as llama.cpp scored it."""
    with LLM(max_model_len=4096, kv_cache_memory="128MiB") as llm:
        ids = _text_token_ids(llm.get_tokenizer())
        assert len(ids) > 2000
        output = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=1,
                                                                           prompt_logprobs=0), use_tqdm=False)[0]
    perplexity = math.exp(-sum(_own_logprobs(output, ids)) / (len(ids) - 1))
    assert abs(perplexity / LLAMA_CPP_PERPLEXITY - 1) <= 0.01, perplexity


def test_a_constrained_request_in_the_same_step_keeps_its_grammar(float32_llm, text_ids):
    """A step scoring prompt rows runs the LM head over them too, so the grammar mask is applied
    after the head instead of inside it: the constrained request still answers from its choices,
    and the scored prompt is the same as when it runs alone."""
    from kvserve.sampling_params import StructuredOutputsParams

    prompt = text_ids[:40]
    alone = _own_logprobs(float32_llm.generate([{"prompt_token_ids": prompt}], SCORE, use_tqdm=False)[0], prompt)
    choice = SamplingParams(temperature=0, max_tokens=4, structured_outputs=StructuredOutputsParams(
        choice=["alpha", "beta"]))
    scored, constrained = float32_llm.generate([{"prompt_token_ids": prompt}, {"prompt_token_ids": text_ids[50:60]}],
                                               [SCORE, choice], use_tqdm=False)
    assert constrained.outputs[0].text in ("alpha", "beta") and constrained.outputs[0].finish_reason == "stop"
    bound = 2 * (30 + 1) * math.sqrt(1536) * 2.0 ** -24 * 40.0  # test_chunked_batched_...'s bound
    assert max(abs(a - b) for a, b in zip(_own_logprobs(scored, prompt), alone)) <= bound
