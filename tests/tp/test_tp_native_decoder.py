"""The native decoder on tensor-parallel ranks (2 ranks, gloo on loopback): each rank's
one-call step over its shards, all-reducing the O and down outputs from inside the call,
against the per-op torch path of the same shards.

Model level (`native_tp_ranks`, no engine): the per-op path fed the native path's greedy
tokens for 64 steps (teacher forcing), logits within rounding, on the tiny configs of every family (their 4 query and 2 KV
heads split 2 ways: sliding windows, soft-capping, GQA, Q/K norms, sandwich norms),
prompt chunks short enough to run natively (chunked prefill), the call's threads
forced to share the rows out, a prefix hit with a copy-on-write block, quantized GGUF
shards on each kernel path. Engine level: TP=2 engines with the native decoder on and
off, under preemption, prefix hits and async scheduling, on float32 and quantized GGUF
weights: each engine's tokens greedy (seeded samples: the seed's draws) under the float32
model within rounding, logprobs of the same context close.
"""
from __future__ import annotations


import pytest

from native_tp_ranks import Case, native_vs_torch, run_ranks
from tp_helpers import save_tiny_model as save_tp_model
from kvserve.native import cpu_kernels
from kvserve.model import quantized
from helpers.float_order import TINY_MODEL_REORDER_BOUND

pytestmark = pytest.mark.skipif(cpu_kernels.load_library() is None, reason="no native kernels")

# Float32 weights: the same kernels on the same shards; the all-reduces sum the same two
# partial results in the same order on both paths. Only the float32 plain-weight matmul may
# sum in another order (the native small-batch kernel against MKL): float32 summation order
# (tests/helpers/float_order.py derives the bound).
# Quantized weights: no fixed bound. Both paths round each matmul's input to int8 per block,
# but what they round comes out of float code of different order (RMSNorm, RoPE, attention in
# C against torch), so an input within float32 rounding of the middle between two int8 steps
# rounds one step apart (measured: 1.5e-2 relative on an Intel Xeon, 0 on AMD Zen 5). Both are
# then fed the same tokens (teacher forcing: a near-tie is no failure) and each must lie
# within the bound that int8 rounding allows of the float32 model
# (tests/helpers/activation_rounding.py), so the two within twice that bound of each other.
MAX_LOGIT_DIFF = TINY_MODEL_REORDER_BOUND
NUM_NEW = 64
# family[/variant]: "gloo" all-reduces through gloo instead of shared memory
DEFAULT_CASES = ("gemma2/threads", "qwen3/prefix_hit", "gguf_q8_0", "llama/gloo")
SLOW_CASES = ("llama", "llama3", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "llama/chunk16", "gguf_q4_0",
              "gguf_q4_1/avx2", "gguf_q4_0/portable", "gemma2/gloo_threads")


def _case(name: str, tmp_path_factory) -> Case | None:
    """The case `name` (family[/variant]); None where this machine cannot run it."""
    from model.paged_kv_helper import save_tiny_model

    family, _, variant = name.partition("/")
    if family.startswith("gguf_"):
        isa = variant or None
        if quantized.kernel_isa() is None or (isa and not quantized.isa_available(isa)):
            return None
        return Case(name, _write_gguf(family[len("gguf_"):].upper(), tmp_path_factory), chunk=3, quant_isa=isa)
    path = save_tiny_model(family, tmp_path_factory.mktemp(family))
    variants = {"": {}, "threads": dict(threads=2), "chunk16": dict(chunk=16),
                "prefix_hit": dict(prefix_hit=True, max_new_tokens=16, chunk=3), "gloo": dict(shm=False),
                "gloo_threads": dict(shm=False, threads=2)}
    return Case(name, path, **variants[variant])


def _write_gguf(type_name: str, tmp_path_factory) -> str:
    from gguf import GGMLQuantizationType
    from helpers.gguf_writer import write_gguf
    from model.paged_kv_helper import load_hf, save_tiny_model

    path = str(tmp_path_factory.mktemp("gguf") / f"tiny-{type_name}.gguf")
    write_gguf(load_hf(save_tiny_model("llama", tmp_path_factory.mktemp("llama"))), path,
               getattr(GGMLQuantizationType, type_name))
    return path


def _run_cases(names, tmp_path_factory) -> dict:
    """Every runnable case of `names` on 2 ranks in one spawn: {name: [rank 0's, rank 1's]}."""
    pytest.importorskip("gguf")
    cases = [case for case in (_case(name, tmp_path_factory) for name in names) if case is not None]
    by_rank = run_ranks(native_vs_torch, cases)
    return {case.name: [outcomes[case.name] for outcomes in by_rank] for case in cases}


@pytest.fixture(scope="module")
def default_outcomes(tmp_path_factory):
    return _run_cases(DEFAULT_CASES, tmp_path_factory)


@pytest.fixture(scope="module")
def slow_outcomes(tmp_path_factory):
    return _run_cases(SLOW_CASES, tmp_path_factory)


def _check(outcomes: dict, name: str) -> None:
    if name not in outcomes:
        pytest.skip(f"{name}: the kernel path does not run here")
    ranks = outcomes[name]
    for rank, outcome in enumerate(ranks):
        assert outcome.torch_tokens == outcome.tokens and outcome.tokens, f"rank {rank}"  # fed the same tokens
        if name.startswith("gguf_"):
            bound = outcome.rounding_bound
            assert bound is not None and max(outcome.reference_deviation) <= bound, (rank, outcome)
            assert outcome.max_logit_diff <= 2 * bound, (rank, outcome)
        else:
            assert outcome.max_rel_logit_diff <= MAX_LOGIT_DIFF, f"rank {rank}"
        # Every decode step ran natively (the step that ends a prompt samples the first token),
        # each all-reducing twice per layer from inside the call.
        assert outcome.native_steps >= min(len(t) for t in outcome.tokens.values()) - 1, f"rank {rank}"
        assert outcome.native_all_reduces == 2 * outcome.num_layers * outcome.native_steps, f"rank {rank}"
        assert outcome.shm == ("gloo" not in name), f"rank {rank}"
    assert ranks[0].tokens == ranks[1].tokens  # the ranks agree (each gathered the full logits)


@pytest.mark.parametrize("name", DEFAULT_CASES)
def test_native_matches_torch_path_on_two_ranks(default_outcomes, name):
    _check(default_outcomes, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW_CASES)
def test_native_matches_torch_path_on_two_ranks_every_family(slow_outcomes, name):
    _check(slow_outcomes, name)


@pytest.mark.parametrize("weights", ["gguf_q4_0", pytest.param("float32", marks=pytest.mark.slow)])
def test_tp2_engine_native_decoder_equals_torch_path(weights, tmp_path, monkeypatch, capfd):
    """TP=2 engines, native decoder on (each rank builds it: its log line) and off, with
    preemptions, prefix hits (CoW copies) and async scheduling: both engines' tokens checked
    against the float32 model, logprobs of a shared context close."""
    from test_tp_engine import (ENGINE_SETTINGS, KV_BYTES_TP2, _assert_greedy_under_reference,
                                _assert_top_logprobs_close, _logprobs, _run_workload, _tokens)
    from tp_helpers import make_engine

    if weights == "float32":
        path = save_tp_model("llama_gqa", tmp_path / "llama_gqa")
    else:
        pytest.importorskip("gguf")
        if quantized.kernel_isa() is None:
            pytest.skip("no quantized kernels here")
        path = _write_tp_gguf(tmp_path)
    monkeypatch.setenv("KVSERVE_WORKER_LOG_LEVEL", "INFO")
    capfd.readouterr()
    with make_engine(path, 2, kv_cache_memory=KV_BYTES_TP2, **ENGINE_SETTINGS) as core:
        ours = _run_workload(core)
        assert core.get_stats().num_preemptions > 0 and core.num_block_copies > 0
    built = capfd.readouterr().err.count("native decoder: steps of up to")
    assert built == 2, "each rank builds its native decoder"
    monkeypatch.setenv("KVSERVE_NATIVE_DECODER", "0")
    with make_engine(path, 2, kv_cache_memory=KV_BYTES_TP2, **ENGINE_SETTINGS) as core:
        ref = _run_workload(core)
    assert "native decoder: steps of up to" not in capfd.readouterr().err
    # The two paths sum in another float order (RMSNorm, RoPE, attention in C against torch), so
    # a near-tie may break either way: each engine's tokens are checked against the float32 model,
    # not against each other, and logprobs compared only where both took the same tokens.
    # Logprobs of one context: float32 within rounding (test_tp_engine); quantized, each engine's
    # logits within the bound b of the float32 model's, so within 2b of each other, and a
    # log-softmax moves by at most the largest logit's move again: 4b.
    tolerance = 1e-4
    if weights == "float32":
        _assert_greedy_under_reference(path, _tokens(ref), _tokens(ours))
    else:
        tolerance = 4 * max(_assert_draws_within_activation_rounding(path, tokens)
                            for tokens in (_tokens(ours), _tokens(ref)))
    logprobs, ref_logprobs = _logprobs(ours), _logprobs(ref)
    assert len(logprobs) == len(ref_logprobs) == 5
    for lp, ref_lp in zip(logprobs, ref_logprobs):
        if lp.sampled_token_id != ref_lp.sampled_token_id:
            break  # a near-tie broken the other way (checked above): the contexts differ from here
        _assert_top_logprobs_close(lp, ref_lp, tolerance)


def _assert_draws_within_activation_rounding(path: str, tokens: dict[str, list[int]]) -> float:
    """Each request's tokens, teacher forced into the float32 model (the GGUF dequantized; TP=1,
    per-op path), whose logits an engine's lie within the int8 activation-rounding bound of
    (tests/helpers/activation_rounding.py, derived here): a greedy token's logit within twice
    the bound of the step's largest, a seeded sample the draw its seed gives up to that slack.
    Returns the bound."""
    import torch
    from helpers.activation_rounding import quantized_half_steps, rounding_bound
    from helpers.greedy_check import assert_seeded_draws
    from model.paged_kv_helper import every_token_logits
    from test_tp_engine import _workload
    from kvserve.model.config import ModelConfig
    from kvserve.model.loader import load_model

    prompts = {str(i): prompt for i, prompt in enumerate(p for wave, _ in _workload() for p in wave)}
    params = {str(i): sp for i, sp in enumerate(sp for _, wave in _workload() for sp in wave)}
    held = load_model(ModelConfig.from_path(path))
    plain = load_model(ModelConfig.from_path(path, quantization="none", dtype="float32"))
    plain._native = None
    sequences = {rid: prompts[rid] + tokens[rid][:-1] for rid in prompts}
    prompt_lens = {rid: len(prompts[rid]) for rid in prompts}
    reference, bound = rounding_bound(plain, quantized_half_steps(plain, held),
                                      lambda m: every_token_logits(m, sequences, prompt_lens))
    for rid, rows in reference.items():
        taken = torch.tensor(tokens[rid])
        assert len(taken) == params[rid].max_tokens
        if params[rid].temperature == 0.0:
            shortfall = rows.max(-1).values - rows.gather(1, taken[:, None])[:, 0]
            assert (shortfall <= 2 * bound).all(), (rid, tokens[rid], shortfall.tolist(), bound)
        else:
            assert_seeded_draws(rows, tokens[rid], params[rid].seed, params[rid].temperature, bound,
                                params[rid].top_k)
    return bound


def _write_tp_gguf(tmp_path) -> str:
    import torch
    import transformers
    from gguf import GGMLQuantizationType
    from helpers.gguf_writer import write_gguf

    hf_dir = save_tp_model("llama_gqa", tmp_path / "hf")
    path = str(tmp_path / "tiny-q4_0.gguf")
    write_gguf(transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32), path,
               GGMLQuantizationType.Q4_0)
    return path


def test_a_failed_all_reduce_inside_the_call_raises_its_error(tmp_path_factory):
    """An all-reduce that raises inside the call (its third: the first layer's MLP) stops every
    thread and comes back as the step's exception; no hang, no crash, and the next steps run."""
    from model.paged_kv_helper import save_tiny_model

    from native_tp_ranks import failing_all_reduce
    path = save_tiny_model("llama", tmp_path_factory.mktemp("llama"))
    for outcome in run_ranks(failing_all_reduce, path, 3):
        assert outcome["raised"] == "injected all-reduce failure" and outcome["calls"] == 3
        assert len(outcome["tokens_after"]) == 4
