"""A speculative verify step (a decode token plus k drafts) over quantized weights computes
every row exactly, bit for bit, as k + 1 plain one-token decode steps of the same sequence:
the matmul kernels are chosen by the step's tokens without its drafts (the panel GEMM that
a step of k + 1 rows would otherwise take rounds activations differently from the row
kernel), on the native decoder and the per-op path, for int16 and int8 activations (whose
one-row steps take the single-row kernel of quant_gemv.c)."""
from __future__ import annotations

import pytest
import torch

from kvserve.native import cpu_kernels
from kvserve.model import native_decoder, quantized
from kvserve.model.config import ModelConfig
from kvserve.model.loader import load_model
from helpers.kernel_switches import env_kernels
from paged_kv_helper import VOCAB, PagedRunner, load_hf, save_tiny_model

pytestmark = pytest.mark.skipif(cpu_kernels.load_library() is None or quantized.kernel_isa() is None,
                                reason="no native kernels")
gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QType  # noqa: E402
from helpers.gguf_writer import write_gguf  # noqa: E402

PROMPT = torch.randint(3, VOCAB, (13,), generator=torch.Generator().manual_seed(5)).tolist()
STEP_TOKENS = torch.randint(3, VOCAB, (8,), generator=torch.Generator().manual_seed(6)).tolist()


def _write(tmp_path_factory, qtype: QType) -> str:
    path = str(tmp_path_factory.mktemp("gguf") / f"tiny-llama-{qtype.name}.gguf")
    write_gguf(load_hf(save_tiny_model("llama", tmp_path_factory.mktemp("llama"))), path, qtype)
    return path


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    return _write(tmp_path_factory, QType.Q4_1)


def _runner(path: str, native: bool, act_bits: int) -> PagedRunner:
    model = load_model(ModelConfig.from_path(path), kernel_config=env_kernels(quant_act_bits=act_bits))
    if native:
        model._native = native_decoder.NativeDecoder.for_model(model)
        model._native.num_threads = 2  # rows and attention shared out as on a bigger model
    else:
        model._native = None  # decided: the per-op path
    runner = PagedRunner(model, block_size=4)
    runner.add("r", PROMPT + STEP_TOKENS)
    runner.step({"r": len(PROMPT)})  # the prefill, the same in both runs
    return runner


@pytest.mark.parametrize("native", [True, False], ids=["native", "per-op"])
@pytest.mark.parametrize("act_bits", [16, 8])
@pytest.mark.parametrize("num_drafts", [3, 7])  # 4 tokens: panel rows; 8: attention split by tokens
def test_verify_step_rows_equal_one_token_steps_bitwise(gguf_path, native, act_bits, num_drafts):
    plain = _runner(gguf_path, native, act_bits)
    expected = torch.stack([plain.step({"r": 1})["r"] for _ in range(num_drafts + 1)])
    verify = _runner(gguf_path, native, act_bits)
    got = verify.step({"r": num_drafts + 1}, every_token=True, num_draft_tokens=num_drafts)["r"]
    assert torch.equal(got, expected)


@pytest.mark.parametrize("native", [True, False], ids=["native", "per-op"])
def test_zero_minimum_weights_with_int8_activations(tmp_path_factory, native):
    """Q8_0 weights (every block minimum zero, which the row kernels then skip reading)."""
    path = _write(tmp_path_factory, QType.Q8_0)
    plain = _runner(path, native, 8)
    expected = torch.stack([plain.step({"r": 1})["r"] for _ in range(4)])
    got = _runner(path, native, 8).step({"r": 4}, every_token=True, num_draft_tokens=3)["r"]
    assert torch.equal(got, expected)


def test_without_the_draft_count_the_panel_rounds_differently(gguf_path):
    """The case the draft count exists for: counted as a plain step of 4 rows, the step takes
    the panel GEMM, and its logits differ from one-token steps'."""
    plain = _runner(gguf_path, True, 16)
    expected = torch.stack([plain.step({"r": 1})["r"] for _ in range(4)])
    got = _runner(gguf_path, True, 16).step({"r": 4}, every_token=True)["r"]
    assert not torch.equal(got, expected)
