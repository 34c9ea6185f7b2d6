"""The native decoder's layers with fewer barriers (csrc/decoder/fused_decoder.c): the O and down
projections split by input columns (int8 activations on AVX512-VNNI), each thread multiplying
its own columns (its attention heads' output, its columns of the MLP activation) into partial
products over fixed runs of input blocks, added up in run order after one barrier; where the
attention goes by query heads, each thread writes the K/V its heads read. On a model wide
enough for several runs (SmolLM2's head layout: 9 query heads of 64 over 3 KV heads, an
intermediate width with a tail block): the logits do not depend on the thread count (1: no
split of the work; 2: each thread's query heads are whole runs of O's input, so it multiplies
them without waiting, and both write the KV head they share; 3: the KV heads go one a thread,
O waits for every head; 4: by query heads again, not whole runs), a speculative verify step's
rows equal one-token steps bit for bit, and the logits match the per-op path's within float32
summation order."""
from __future__ import annotations

import pytest
import torch
import transformers

from kvserve.native.config import KernelConfig
from kvserve.native import cpu_kernels
from kvserve.model import native_decoder, quantized
from kvserve.model.config import ModelConfig
from kvserve.model.loader import load_model
from paged_kv_helper import VOCAB, PagedRunner, load_hf, run_greedy

pytestmark = pytest.mark.skipif(cpu_kernels.load_library() is None or quantized.kernel_isa() != "avx512",
                                reason="the split runs on the single-row kernel of AVX512-VNNI only")
gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QType  # noqa: E402
from helpers.gguf_writer import write_gguf  # noqa: E402

# O's input: 576 columns = runs of 8 and 10 blocks; down's: 800 = runs of 8, 8 and 9 blocks.
WIDE = dict(vocab_size=VOCAB, hidden_size=576, intermediate_size=800, num_attention_heads=9, num_key_value_heads=3,
            num_hidden_layers=2, max_position_embeddings=512, initializer_range=0.05, bos_token_id=1,
            eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
NUM_NEW = 16


@pytest.fixture(scope="module", params=[QType.Q4_1, QType.Q8_0], ids=["Q4_1", "Q8_0"])
def gguf_path(request, tmp_path_factory):
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("wide")
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**WIDE)).eval().save_pretrained(str(directory))
    path = str(tmp_path_factory.mktemp("gguf") / f"wide-{request.param.name}.gguf")
    write_gguf(load_hf(str(directory)), path, request.param)
    return path


def _model(path: str, threads: int | None):
    model = load_model(ModelConfig.from_path(path), kernel_config=KernelConfig(quant_act_bits=8))
    assert model.layers[0].mlp.down_proj.quant_weight.act_bits == 8
    if threads is None:
        model._native = None  # decided: the per-op path
    else:
        model._native = native_decoder.NativeDecoder.for_model(model)
        model._native.num_threads = threads
        model._native.fewer_barriers = True
    return model


def _greedy(path: str, threads: int | None):
    generator = torch.Generator().manual_seed(11)
    prompts = {f"r{i}": torch.randint(3, VOCAB, (n,), generator=generator).tolist() for i, n in enumerate([5, 10])}
    return run_greedy(PagedRunner(_model(path, threads)), prompts, NUM_NEW, chunk=3)


def test_logits_do_not_depend_on_the_thread_count(gguf_path):
    tokens, logits = _greedy(gguf_path, 1)
    for threads in (2, 3, 4):
        other_tokens, other_logits = _greedy(gguf_path, threads)
        assert other_tokens == tokens
        for req_id in logits:
            assert all(torch.equal(a, b) for a, b in zip(other_logits[req_id], logits[req_id])), (threads, req_id)


def test_logits_match_the_per_op_path(gguf_path):
    """Greedy tokens identical. The split's partial products add up in another float32 order
    than the per-op path's one-row kernel (whose sums the unsplit native call reproduces
    exactly): most steps' logits differ by float32 rounding only, but where a hidden state
    ends up that close to the middle between two int8 steps, its next rounding to int8 (and
    the K/V it leaves in the cache) differs by one step, a difference of order 1e-2 here."""
    (tokens, logits), (ref_tokens, ref_logits) = _greedy(gguf_path, 2), _greedy(gguf_path, None)
    assert tokens == ref_tokens
    diffs = torch.tensor([(a - b).abs().max().item() / max(1.0, b.abs().max().item())
                          for req_id in ref_logits for a, b in zip(logits[req_id], ref_logits[req_id])])
    assert diffs.max() <= 3e-2
    assert diffs.median() <= 1e-5
    assert diffs.max() > 0  # the split is what ran


@pytest.mark.parametrize("threads", [2, 3])
def test_verify_step_rows_equal_one_token_steps_bitwise(gguf_path, threads):
    generator = torch.Generator().manual_seed(12)
    prompt, drafts = (torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in (13, 4))

    def runner() -> PagedRunner:
        paged = PagedRunner(_model(gguf_path, threads), block_size=4)
        paged.add("r", prompt + drafts)
        paged.step({"r": len(prompt)})
        return paged
    plain = runner()
    expected = torch.stack([plain.step({"r": 1})["r"] for _ in range(len(drafts))])
    got = runner().step({"r": len(drafts)}, every_token=True, num_draft_tokens=len(drafts) - 1)["r"]
    assert torch.equal(got, expected)
