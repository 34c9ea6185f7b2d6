"""The native decoder (one C call for the whole stack on small steps) against the
per-op torch path of the same model, both fed the torch path's 64 greedy tokens (teacher
forcing: a near-tie between two float orders is no failure): float32 logits within
summation-order rounding, quantized ones each within the int8 rounding bound of the float32
model (tests/helpers/activation_rounding.py), on the tiny models of every family (sliding windows,
soft-capping, GQA, Q/K norms, sandwich norms), with prompt chunks short enough
to run natively over cached context, prefix hits with a copy-on-write block,
quantized GGUF weights on every kernel path, and the steps it must decline
(circular-buffer KV, oneDNN-packed weights, the switch off)."""
from __future__ import annotations

import pytest
import torch

from kvserve.native.config import KernelConfig
from kvserve.kv_cache.utils import KVCacheBlockCopy
from kvserve.native import cpu_kernels
from kvserve.model import native_decoder, quantized
from kvserve.model.config import ModelConfig
from kvserve.model.loader import load_model
from helpers.kernel_switches import env_kernels
from helpers.float_order import TINY_MODEL_REORDER_BOUND
from helpers.activation_rounding import max_deviation, quantized_half_steps, rounding_bound
from paged_kv_helper import (VOCAB, PagedRunner, every_token_logits, run_greedy, run_teacher_forced,
                             save_tiny_model, tiny_configs)

from helpers.native_steps import count_native_steps

pytestmark = pytest.mark.skipif(cpu_kernels.load_library() is None, reason="no native kernels")

FAMILIES = ["llama", "llama3", "mistral", "qwen2", "qwen3", "gemma2", "gemma3"]
NUM_NEW = 64
# Same float32 math on the same tokens; the matmuls sum in another order (the native
# kernels against oneDNN/MKL, whose kernel choice differs between Intel and AMD):
# tests/helpers/float_order.py derives the bound.
MAX_LOGIT_DIFF = TINY_MODEL_REORDER_BOUND


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    return tiny_configs(tmp_path_factory)


@pytest.fixture
def native_steps(monkeypatch):
    """Counts the steps the native decoder ran (not declined)."""
    return count_native_steps(monkeypatch)


def _prompts(lengths: list[int], seed: int = 0) -> dict[str, list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return {f"r{i}": torch.randint(3, VOCAB, (n,), generator=generator).tolist() for i, n in enumerate(lengths)}


def _torch_path(model):
    model._native = None  # decided: no native decoder for this model
    return model


def _assert_close(ours, ref) -> None:
    """Two `run_greedy` results, `ours` made to follow `ref`'s tokens: logits within rounding."""
    logits, ref_logits = ours[1], ref[1]
    assert ours[0] == ref[0] and logits.keys() == ref_logits.keys()
    for req_id in ref_logits:
        assert len(logits[req_id]) == len(ref_logits[req_id])
        for a, b in zip(logits[req_id], ref_logits[req_id]):
            assert (a - b).abs().max().item() <= MAX_LOGIT_DIFF * max(1.0, b.abs().max().item())


def _assert_within_rounding(path: str, kernel_config, native_model, prompts: dict[str, list[int]], num_new: int,
                            chunk: int) -> None:
    """`native_model` (held quantized, native decoder on) and the per-op path of the same
    weights, both fed the same tokens, each within the int8 rounding bound of the float32
    model (so within twice that bound of each other)."""
    generator = torch.Generator().manual_seed(sum(map(len, prompts.values())))
    sequences = {r: p + torch.randint(3, VOCAB, (num_new - 1,), generator=generator).tolist()
                 for r, p in prompts.items()}
    prompt_lens = {r: len(p) for r, p in prompts.items()}
    ours = run_teacher_forced(PagedRunner(native_model), sequences, prompt_lens, chunk)
    per_op = run_teacher_forced(PagedRunner(_torch_path(load_model(ModelConfig.from_path(path),
                                                                   kernel_config=kernel_config))),
                                sequences, prompt_lens, chunk)
    plain = load_model(ModelConfig.from_path(path, quantization="none", dtype="float32"))
    reference, bound = rounding_bound(plain, quantized_half_steps(plain, native_model),
                                      lambda model: every_token_logits(model, sequences, prompt_lens))
    assert max_deviation(ours, reference) <= bound
    assert max_deviation(per_op, reference) <= bound


@pytest.mark.parametrize("family,chunk,threads", [
    *[(family, 2, None) for family in FAMILIES],
    ("llama", 16, None), ("gemma2", 16, None), ("gemma2", 2, 2), ("qwen3", 2, 3), ("gemma3", 2, 3)])
def test_native_matches_torch_path_over_64_steps(configs, native_steps, family, chunk, threads):
    """Chunk 2: prompt chunks over cached context run natively too (3 requests x 2 <= 8
    tokens); chunk 16: prefills take the torch path, decode steps the native one.
    `threads`: the tiny layers would run on one thread; force the rows and KV heads to
    be shared out (3 threads: more than the 2 KV heads, so one thread has none)."""
    config = configs(family)
    prompts = _prompts([5, 19, 30], seed=1)  # 30 + 64 tokens exceed the window (12) many times
    ref = run_greedy(PagedRunner(_torch_path(load_model(config, kernel_config=env_kernels())), block_size=4), prompts,
                     NUM_NEW, chunk=chunk)
    model = load_model(config, kernel_config=env_kernels())
    if threads:
        model._native = native_decoder.NativeDecoder.for_model(model)
        model._native.num_threads = threads
    ours = run_greedy(PagedRunner(model, block_size=4), prompts, NUM_NEW, chunk=chunk, follow=ref[0])
    assert native_steps[0] >= NUM_NEW - 2  # the step that ends a prompt gives the first logits
    _assert_close(ours, ref)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_prefix_hit_with_copy_on_write_block(configs, native_steps, family):
    def run(model, tokens=None):
        """run_greedy's result; with `tokens`, fed those (teacher forcing)."""
        runner = PagedRunner(model, block_size=4)
        base, tail = _prompts([22], seed=1)["r0"], _prompts([9], seed=2)["r0"]
        run_greedy(runner, {"a": base}, 1, chunk=64)
        shared = runner.requests["a"].block_ids
        own = [runner.new_block() for _ in shared]
        runner.copy_blocks([KVCacheBlockCopy(g, shared[g][4], own[g], 2) for g in range(len(shared))])
        runner.add("c", base[:18] + tail, shared_blocks=[t[:4] + [own[g]] for g, t in enumerate(shared)],
                   num_computed=18)
        runner.add("b", base[:16] + tail, shared_blocks=[t[:4] for t in shared], num_computed=16)
        prompts = {"b": base[:16] + tail, "c": base[:18] + tail}
        return run_greedy(runner, prompts, 16, chunk=3, follow=tokens)

    config = configs(family)
    ref = run(_torch_path(load_model(config, kernel_config=env_kernels())))
    ours = run(load_model(config, kernel_config=env_kernels()), ref[0])
    assert native_steps[0] > 16
    _assert_close(ours, ref)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_the_call_embeds_the_tokens_itself(configs, native_steps, family):
    """Float32 tables (Gemma's scaled ones too) are read inside the call, RoPE rows too (the
    64-step test above checks the result); an id outside the table is an IndexError, as
    on the per-op path, and nothing runs."""
    model = load_model(configs(family), kernel_config=env_kernels())
    decoder = native_decoder.NativeDecoder.for_model(model)
    assert decoder._desc.embed.out == model.embed_tokens.weight.shape[0]
    assert (decoder._desc.embed_scale != 0.0) == model.config.scales_embeddings
    with pytest.raises(IndexError):
        run_greedy(PagedRunner(model), {"r": [5, 6, model.embed_tokens.weight.shape[0] + 3]}, 1, chunk=8)
    assert native_steps[0] == 0


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_circular_buffer_steps_are_declined_and_still_match(configs, native_steps, family):
    config = configs(family)
    prompts = _prompts([25, 7], seed=3)
    ref = run_greedy(PagedRunner(_torch_path(load_model(config, kernel_config=env_kernels())),
                                 sliding_window_kv="circular"), prompts, 24, chunk=2)
    ours = run_greedy(PagedRunner(load_model(config, kernel_config=env_kernels()), sliding_window_kv="circular"),
                      prompts, 24, chunk=2, follow=ref[0])
    if family == "mistral":  # every layer windowed: every group a ring
        assert native_steps[0] == 0
    _assert_close(ours, ref)


def test_switch_and_packed_weights_are_declined(configs, native_steps):
    config = configs("llama")
    assert load_model(config, kernel_config=env_kernels()).kernels.native_decoder
    assert native_decoder.NativeDecoder.for_model(load_model(config, kernel_config=env_kernels())) is not None
    switched_off = load_model(config, kernel_config=KernelConfig.from_env({"KVSERVE_NATIVE_DECODER": "0"}))
    assert not switched_off.kernels.native_decoder
    run_greedy(PagedRunner(switched_off), _prompts([4]), 3, chunk=8)
    assert native_steps[0] == 0
    bf16 = load_model(ModelConfig.from_path(config.path, dtype="bfloat16"),
                      kernel_config=KernelConfig(cpu_kernels=False))  # bfloat16: test_native_decoder_bf16.py
    assert not bf16.kernels.native_decoder and native_decoder.NativeDecoder.for_model(bf16) is None
    if torch.backends.mkldnn.is_available():
        packed = load_model(config, kernel_config=env_kernels())
        packed.pack_linear_weights(keep_plain=False, panels=False)
        assert native_decoder.NativeDecoder.for_model(packed) is None


gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QType  # noqa: E402
from helpers.gguf_writer import write_gguf  # noqa: E402


@pytest.mark.parametrize("isa", ["avx512", "avx2", "portable"])
@pytest.mark.parametrize("qtype", [QType.Q4_0, QType.Q4_1, QType.Q8_0])
def test_quantized_weights_on_every_kernel_path(tmp_path_factory, native_steps, qtype, isa):
    if quantized.kernel_isa() is None or not quantized.isa_available(isa):
        pytest.skip(f"the {isa} kernel path does not run here")
    from paged_kv_helper import load_hf
    path = str(tmp_path_factory.mktemp("gguf") / f"tiny-{qtype.name}.gguf")
    write_gguf(load_hf(save_tiny_model("llama", tmp_path_factory.mktemp("llama"))), path, qtype)
    # Both paths take this one; every step the integer kernel (no bfloat16 panel GEMM).
    kernel_config = KernelConfig(quant_isa=isa, quant_panel_rows=0, quant_gemm_rows=0)
    model = load_model(ModelConfig.from_path(path), kernel_config=kernel_config)
    assert model.layers[0].self_attn.qkv_proj.quant_weight.isa == isa
    _assert_within_rounding(path, kernel_config, model, _prompts([5, 23], seed=4), NUM_NEW, chunk=3)
    assert native_steps[0] >= NUM_NEW - 2  # the step that ends a prompt gives the first logits


@pytest.mark.parametrize("isa", ["avx512", "avx2", "portable"])
def test_quantized_row_ranges_equal_the_per_op_kernel(isa):
    """`kvserve_quant_rows` (what each thread of the native call runs) gives, row range by
    row range, exactly the sums of the per-op kernel, for every GGUF type, a few batch sizes."""
    if quantized.kernel_isa() is None or not quantized.isa_available(isa):
        pytest.skip(f"the {isa} kernel path does not run here")
    from test_quant_kernels import TYPES, gguf_blocks
    lib = cpu_kernels.load_library()
    for type_name in TYPES:
        width = 256 if type_name.endswith("K") else 96
        weight = quantized.from_gguf_blocks(type_name, gguf_blocks(type_name, 22, width, seed=3), width)
        for batch in (1, 3, 6):
            x = torch.randn(batch, width)
            ref = quantized.linear(x, weight, isa=isa)
            qx = torch.empty(batch * width * 2 + 64, dtype=torch.uint8)
            scales = torch.empty(2 * batch * (width // 32))
            lib.kvserve_quant_activations(x.data_ptr(), width, batch, width, weight.act_bits, qx.data_ptr(),
                                          scales.data_ptr())
            # m NULL: how the native call passes a weight whose minimums are all zero (Q8_0)
            for mins in (weight.m.data_ptr(), *([None] if not weight.m.any() else [])):
                y = torch.full((batch, 22), float("nan"))
                for begin, end in ((0, 8), (8, 20), (20, 22)):
                    lib.kvserve_quant_rows(qx.data_ptr(), scales.data_ptr(), batch, weight.qs.data_ptr(),
                                           weight.d.data_ptr(), mins, weight.bits, width, None,
                                           y.data_ptr(), 22, weight.act_bits, quantized.ISA_CODES[isa], begin, end)
                assert torch.equal(y, ref), (type_name, batch, mins)


@pytest.mark.parametrize("family,threads", [("llama", None), ("qwen2", 2), ("gemma2", 3)])
def test_lm_head_runs_inside_the_native_call(configs, monkeypatch, family, threads):
    """The logits of the sampled rows come out of the native call (the torch LM head runs
    only for the steps it declines: here the prefills) and equal the torch LM head's, with
    greedy tokens identical for 64 steps; an untied head, a tied one, Gemma's soft-capping."""
    prompts = _prompts([17, 30], seed=5)
    ref = run_greedy(PagedRunner(_torch_path(load_model(configs(family), kernel_config=env_kernels())), block_size=4),
                     prompts, NUM_NEW, chunk=16)
    model = load_model(configs(family), kernel_config=env_kernels())
    torch_head_rows, head_type = [0], type(model.lm_head)
    logits = head_type.logits

    def counting(self, hidden, num_draft_rows=0):
        torch_head_rows[0] += hidden.shape[0]
        return logits(self, hidden, num_draft_rows)
    monkeypatch.setattr(head_type, "logits", counting)
    model._native = native_decoder.NativeDecoder.for_model(model)
    assert model._native._head is not None
    if threads:
        model._native.num_threads = threads
    ours = run_greedy(PagedRunner(model, block_size=4), prompts, NUM_NEW, chunk=16, follow=ref[0])
    assert torch_head_rows[0] == 4  # the two prefill steps (32 and 15 tokens), two rows each
    _assert_close(ours, ref)


def test_lm_head_stays_outside_when_the_native_call_cannot_take_it(configs):
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN packing here")
    model = load_model(configs("llama"), kernel_config=env_kernels())
    model.lm_head.pack_weight(keep_plain=False)  # held only in oneDNN's layout
    decoder = native_decoder.NativeDecoder.for_model(model)
    assert decoder is not None and decoder._head is None
    model._native = decoder
    ref_model = _torch_path(load_model(configs("llama"), kernel_config=env_kernels()))
    prompts = _prompts([6], seed=6)
    ref = run_greedy(PagedRunner(ref_model), prompts, 8, chunk=8)
    _assert_close(run_greedy(PagedRunner(model), prompts, 8, chunk=8, follow=ref[0]), ref)


@pytest.mark.parametrize("isa", ["avx512", "avx2", "portable"])
def test_quantized_lm_head_in_the_call_for_one_and_two_sequences(tmp_path_factory, isa):
    """A Q8_0 LM head runs in the call, for one sequence (on AVX512-VNNI with int8 activations
    the single-row kernel) and for two (the tiled one): logits, as the per-op path's, within
    the int8 rounding bound of the float32 model's."""
    if quantized.kernel_isa() is None or not quantized.isa_available(isa):
        pytest.skip(f"the {isa} kernel path does not run here")
    from paged_kv_helper import load_hf
    path = str(tmp_path_factory.mktemp("gguf") / "tiny-Q8_0.gguf")
    write_gguf(load_hf(save_tiny_model("llama", tmp_path_factory.mktemp("llama"))), path, QType.Q8_0)
    kernel_config = KernelConfig(quant_isa=isa, quant_panel_rows=0, quant_gemm_rows=0)
    model = load_model(ModelConfig.from_path(path), kernel_config=kernel_config)
    model._native = native_decoder.NativeDecoder.for_model(model)
    assert model._native._head is not None
    for lengths in ([7], [7, 12]):
        _assert_within_rounding(path, kernel_config, model, _prompts(lengths, seed=7), 16, chunk=3)


def test_phase_timing_splits_the_call_and_is_off_outside_its_block(configs):
    """`phase_timing` (csrc/decoder/phase_timer.h) counts the calls made inside it and charges
    each thread's time to phases: every matmul and the attention get some, one thread's
    phases add up to about its wall time; calls outside the block are not counted."""
    model = load_model(configs("llama"), kernel_config=env_kernels())
    model._native = native_decoder.NativeDecoder.for_model(model)
    model._native.num_threads = 2  # the tiny layers would run on one thread
    runner = PagedRunner(model)
    run_greedy(runner, _prompts([5]), 2, chunk=8)  # outside: not counted
    with native_decoder.phase_timing(2) as timing:
        run_greedy(runner, _prompts([6], seed=2), 4, chunk=8)
    assert timing["calls"] == 4  # the 6-token prompt and 3 decode steps, all native
    for thread in timing["threads"]:
        assert set(thread) == set(native_decoder.PHASES)
        for phase in ("QKV matmul", "O matmul", "gate/up matmul", "down matmul", "LM head matmul",
                      "attention (Q/K norms, RoPE, K/V write, paged attention)"):
            assert thread[phase] > 0, phase
    with native_decoder.phase_timing(2) as idle:
        pass
    assert idle["calls"] == 0 and all(v == 0 for t in idle["threads"] for v in t.values())
