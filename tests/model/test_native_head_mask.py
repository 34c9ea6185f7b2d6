"""A grammar mask applied by the native decoder's LM head (`HeadMask`) against the
unmasked head's logits masked by the torch reference (`apply_bitmask`): bit for bit,
for float32 and Q8_0 heads, one to six logits rows (the row kernel and the panel GEMM),
one to three threads, every row masked (words no row may pick are not computed) or
some, a bitmask narrower than the vocabulary; a mask published only after the call
began, one published as absent, and soft-capped logits (never masked in the head)."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from kvserve.native.config import KernelConfig
from kvserve.native import cpu_kernels
from kvserve.model import native_decoder, quantized
from kvserve.model.config import ModelConfig
from kvserve.sample.structured.grammar_mask import HeadMask, HeadMaskPool, apply_bitmask, isa_available, publish_ready
from kvserve.model.loader import load_model
from helpers.kernel_switches import env_kernels
from paged_kv_helper import VOCAB, PagedRunner, load_hf, save_tiny_model

from helpers.native_steps import count_native_steps

pytestmark = pytest.mark.skipif(cpu_kernels.load_library() is None, reason="no native kernels")
MASK_ISAS = [isa for isa in ("portable", "avx2", "avx512")
             if cpu_kernels.load_library() is not None and isa_available(isa)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Model configs by name: a float32 tiny Llama, the same as Q8_0 GGUF, a Gemma-2 (soft-capped)."""
    cache = {}

    def get(name: str) -> ModelConfig:
        if name not in cache:
            family = "gemma2" if name == "gemma2" else "llama"
            path = save_tiny_model(family, tmp_path_factory.mktemp(name))
            if name == "q8_0":
                gguf = pytest.importorskip("gguf")
                from helpers.gguf_writer import write_gguf
                gguf_path = str(tmp_path_factory.mktemp("gguf") / "tiny-Q8_0.gguf")
                write_gguf(load_hf(path), gguf_path, gguf.GGMLQuantizationType.Q8_0)
                path = gguf_path
            cache[name] = ModelConfig.from_path(path)
        return cache[name]
    return get


def _bitmask(rows: int, words: int, seed: int) -> torch.Tensor:
    """Random words with whole words of zeros (banned everywhere: skipped) and of ones."""
    generator = torch.Generator().manual_seed(seed)
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows, words), dtype=torch.int32, generator=generator)
    kind = torch.randint(0, 4, (words,), generator=generator)
    bitmask[:, kind == 0] = 0  # the same words banned in every row
    bitmask[:, kind == 1] = -1
    bitmask[0, 0] |= 1  # at least one allowed token in each row
    return bitmask


def _runner(config: ModelConfig, num_requests: int, threads: int | None, act_bits: int | None = None) -> PagedRunner:
    kernel_config = env_kernels() if act_bits is None else env_kernels(quant_act_bits=act_bits)
    model = load_model(config, kernel_config=kernel_config)
    model._native = native_decoder.NativeDecoder.for_model(model)
    if threads:
        model._native.num_threads = threads
    runner = PagedRunner(model)
    generator = torch.Generator().manual_seed(num_requests)
    for i in range(num_requests):
        runner.add(f"r{i}", torch.randint(3, VOCAB, (6 + i,), generator=generator).tolist())
        runner.step({f"r{i}": 6 + i})  # the prefill
        runner.append(f"r{i}", 5)
    return runner


def _decode_twice(runner: PagedRunner, head_mask: HeadMask, num_draft_tokens: int = 0) -> tuple[torch.Tensor,
                                                                                                 torch.Tensor]:
    """One decode step of every request (with `num_draft_tokens`: a verify step of one
    request, a logits row per token) without a mask, then the same step with `head_mask`."""
    schedule = {req_id: 1 + num_draft_tokens for req_id in runner.requests}
    computed = {req_id: req.num_computed for req_id, req in runner.requests.items()}

    def step(mask):
        logits = runner.step(schedule, every_token=num_draft_tokens > 0, num_draft_tokens=num_draft_tokens,
                             head_mask=mask)
        return torch.cat(list(logits.values())) if num_draft_tokens else torch.stack(list(logits.values()))
    plain = step(None)
    for req_id, num_computed in computed.items():  # the same step again: the same K/V rewritten
        runner.requests[req_id].num_computed = num_computed
    return plain, step(head_mask)


@pytest.mark.parametrize("isa", MASK_ISAS)
@pytest.mark.parametrize("model,num_requests,threads,masked_rows", [
    ("llama", 1, None, [0]), ("llama", 3, 3, [0, 1, 2]), ("llama", 3, 2, [2, 0]),
    ("q8_0", 1, 2, [0]), ("q8_0", 2, 3, [1, 0]), ("q8_0", 6, 2, [0, 1, 2, 3, 4, 5]), ("q8_0", 6, 3, [4, 1])])
def test_the_head_masks_its_rows_as_the_reference_does(models, monkeypatch, isa, model, num_requests, threads,
                                                       masked_rows):
    native_steps = count_native_steps(monkeypatch)
    runner = _runner(models(model), num_requests, threads)
    words = (VOCAB - 40 + 31) // 32  # a grammar vocabulary narrower than the logits: the rest is banned
    head_mask = HeadMask.empty(masked_rows, VOCAB - 40, isa)
    head_mask.bitmask.copy_(_bitmask(len(masked_rows), words, seed=num_requests * 10 + len(masked_rows)))
    publish_ready(head_mask, filled=True)
    steps_before = native_steps[0]
    plain, masked = _decode_twice(runner, head_mask)
    assert native_steps[0] - steps_before == 2
    assert head_mask.applied and head_mask.wait_s == 0.0
    assert torch.equal(masked, apply_bitmask(plain, head_mask.bitmask, masked_rows))
    assert torch.isfinite(plain).all()


@pytest.mark.parametrize("act_bits", [16, 8])  # 8: on AVX512 each row by the single-row kernel
def test_a_verify_step_is_masked_row_by_row(models, act_bits):
    """A speculative verify step (a token and 3 drafts of one request): each logits row has
    its own bitmask row, every row masked, rows computed with the kernel of a one-token step."""
    runner = _runner(models("q8_0"), 1, 2, act_bits)
    for token in (7, 8, 9):
        runner.append("r0", token)
    head_mask = HeadMask.empty([0, 1, 2, 3], VOCAB, MASK_ISAS[-1])
    head_mask.bitmask.copy_(_bitmask(4, VOCAB // 32, seed=act_bits))
    publish_ready(head_mask, filled=True)
    plain, masked = _decode_twice(runner, head_mask, num_draft_tokens=3)
    assert plain.shape[0] == 4 and head_mask.applied
    assert torch.equal(masked, apply_bitmask(plain, head_mask.bitmask, [0, 1, 2, 3]))


def test_the_head_waits_for_a_mask_published_after_the_call_began(models):
    runner = _runner(models("q8_0"), 2, 2)
    head_mask = HeadMask.empty([0, 1], VOCAB, MASK_ISAS[-1])
    forward, timing = runner.model._native.forward, {}

    def fill_later(*args):
        if args[-1] is head_mask:
            def fill():
                head_mask.bitmask.copy_(_bitmask(2, VOCAB // 32, seed=3))
                publish_ready(head_mask, filled=True)
            threading.Timer(0.2, fill).start()
            timing["began"] = time.perf_counter()
        out = forward(*args)
        timing["ended"] = time.perf_counter()
        return out
    runner.model._native.forward = fill_later
    plain, masked = _decode_twice(runner, head_mask)
    assert head_mask.applied
    # It waited, unless the machine is so loaded that the layers alone took the 0.2 s.
    assert head_mask.wait_s > 0.0 or timing["ended"] - timing["began"] >= 0.2
    assert torch.equal(masked, apply_bitmask(plain, head_mask.bitmask, [0, 1]))


def test_a_mask_never_published_times_out_and_leaves_the_logits_unmasked(models, monkeypatch):
    monkeypatch.setattr(native_decoder, "_MASK_TIMEOUT_NS", 100_000_000)
    runner = _runner(models("llama"), 1, 2)
    head_mask = HeadMask.empty([0], VOCAB, MASK_ISAS[-1])
    plain, masked = _decode_twice(runner, head_mask)
    assert not head_mask.applied and head_mask.wait_s >= 0.1
    assert torch.equal(masked, plain)


def test_a_mask_published_as_absent_leaves_the_logits_unmasked(models):
    runner = _runner(models("llama"), 2, 2)
    head_mask = HeadMask.empty([0, 1], VOCAB, MASK_ISAS[-1])
    publish_ready(head_mask, filled=False)
    plain, masked = _decode_twice(runner, head_mask)
    assert not head_mask.applied
    assert torch.equal(masked, plain)


def test_a_mask_that_does_not_fit_the_logits_is_left_to_the_caller(models):
    runner = _runner(models("llama"), 1, None)
    head_mask = HeadMask.empty([1], VOCAB, MASK_ISAS[-1])  # row 1 of a one-row step
    publish_ready(head_mask, filled=True)
    plain, masked = _decode_twice(runner, head_mask)
    assert not head_mask.applied and torch.equal(masked, plain)


def test_soft_capped_logits_are_never_masked_in_the_head(models):
    """Soft-capping would turn the head's -inf into -cap: the caller masks after it."""
    config = models("gemma2")
    assert config.final_logit_softcapping
    runner = _runner(config, 1, None)
    assert runner.model._native._head is not None
    head_mask = HeadMask.empty([0], VOCAB, MASK_ISAS[-1])
    publish_ready(head_mask, filled=True)
    plain, masked = _decode_twice(runner, head_mask)
    assert not head_mask.applied and torch.equal(masked, plain)


def test_quantized_head_isa_paths_mask_alike(models):
    """The Q8_0 head on each quantized kernel path this CPU runs, masked in the head."""
    for quant_isa in ("portable", "avx2", "avx512"):
        if quantized.kernel_isa() is None or not quantized.isa_available(quant_isa):
            continue
        model = load_model(models("q8_0"), kernel_config=KernelConfig(quant_isa=quant_isa))
        model._native = native_decoder.NativeDecoder.for_model(model)
        runner = PagedRunner(model)
        runner.add("r0", list(range(3, 10)))
        runner.step({"r0": 7})
        runner.append("r0", 5)
        head_mask = HeadMask.empty([0], VOCAB, MASK_ISAS[-1])
        head_mask.bitmask.copy_(_bitmask(1, VOCAB // 32, seed=5))
        publish_ready(head_mask, filled=True)
        plain, masked = _decode_twice(runner, head_mask)
        assert head_mask.applied, quant_isa
        assert torch.equal(masked, apply_bitmask(plain, head_mask.bitmask, [0])), quant_isa


def test_the_pool_reuses_one_buffer_and_numbers_the_steps():
    pool = HeadMaskPool(VOCAB - 40, MASK_ISAS[-1])
    first, second = pool.next([0, 1]), pool.next([1, 0])
    assert second.ready_value == first.ready_value + 1 and second.ready is first.ready
    assert second.bitmask.data_ptr() == first.bitmask.data_ptr() and second.bitmask.shape == (2, (VOCAB - 40 + 31) // 32)
    grown = pool.next([0, 1, 2])  # more rows: a new buffer; the masks handed out keep theirs
    assert grown.bitmask.shape[0] == 3 and grown.bitmask.is_contiguous()
    assert first.bitmask.shape == (2, (VOCAB - 40 + 31) // 32)


def test_a_late_fill_of_an_earlier_step_does_not_pass_for_this_one(models, monkeypatch):
    """The flag holds the step's number: an earlier step's fill published late times out
    (the head leaves the logits alone), this step's own publish is applied."""
    monkeypatch.setattr(native_decoder, "_MASK_TIMEOUT_NS", 100_000_000)
    runner = _runner(models("llama"), 1, 2)
    pool = HeadMaskPool(VOCAB, MASK_ISAS[-1])
    earlier, head_mask = pool.next([0]), pool.next([0])
    head_mask.bitmask.copy_(_bitmask(1, VOCAB // 32, seed=9))
    publish_ready(earlier, filled=True)
    plain, masked = _decode_twice(runner, head_mask)
    assert not head_mask.applied and torch.equal(masked, plain)
    publish_ready(head_mask, filled=True)
    runner.append("r0", 6)
    plain, masked = _decode_twice(runner, head_mask)
    assert head_mask.applied and torch.equal(masked, apply_bitmask(plain, head_mask.bitmask, [0]))
