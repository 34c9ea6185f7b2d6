"""The native decoder's layers with fewer barriers (csrc/decoder/fused_decoder.c,
NativeDecoder.fewer_barriers): the O and down projections split by input columns (here GGUF
tensors as stored, on every kernel path: gguf_rows.c's runs), each thread multiplying its own
columns (its attention heads' output, its columns of the MLP activation) into partial products
over fixed runs of input blocks, added up in run order after one barrier; on steps of a few
tokens attention goes by query heads, each thread computing the QKV rows and writing the K/V
its heads read. On a model wide enough for several runs (SmolLM2's head layout: 9 query heads
of 64 over 3 KV heads; O's runs whole heads, 4 + 4 + 4 + 6 blocks; an intermediate width of 25
blocks): the logits do not depend on the thread count (1: no split of the work; 2: each
thread's query heads are whole runs of O's input, so it multiplies them without waiting, and
both write the KV head they share; 3: one KV head a thread, its heads not whole runs, so O
waits for every head; 4: by query heads again, not whole runs), a speculative verify step's
rows equal one-token steps bit for bit, and, both fed the same tokens, the split's logits and
the per-op path's are each within the bound int8 activation rounding allows of the float32
model's."""
from __future__ import annotations

import pytest
import torch
import transformers

from helpers.activation_rounding import max_deviation, quantized_half_steps, rounding_bound
from helpers.kernel_switches import env_kernels
from helpers.native_steps import count_native_steps
from kvserve.model import native_decoder
from kvserve.model.stored_weight import StoredWeight
from kvserve.native import cpu_kernels
from kvserve.model.config import ModelConfig
from kvserve.model.loader import load_model
from paged_kv_helper import VOCAB, PagedRunner, every_token_logits, load_hf, run_greedy, run_teacher_forced

pytestmark = pytest.mark.skipif(cpu_kernels.load_library() is None, reason="no C compiler for the native kernels")
gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QType  # noqa: E402
from helpers.gguf_writer import write_gguf  # noqa: E402

# O's input: 576 columns = 9 heads of 64, 18 blocks; down's: 800 columns = 25 blocks.
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


def _model(path: str, threads: int | None, **switches):
    """The model held quantized, int8 activations; `threads` None: the per-op path, else the
    native decoder with fewer barriers (the split) on that many threads."""
    model = load_model(ModelConfig.from_path(path), kernel_config=env_kernels(quant_act_bits=8, **switches))
    assert isinstance(model.layers[0].mlp.down_proj.quant_weight, StoredWeight)  # the split of stored weights
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


def test_logits_match_the_per_op_path(gguf_path, monkeypatch):
    """Both paths fed the same tokens (a near-tie between two float orders is no failure):
    the split's partial products add up in another float32 order than the per-op path's
    one-row kernel, so where a hidden state lies within that rounding of the middle between
    two int8 steps, the two round it (and the K/V left in the cache) one step apart. Each is
    then an int8 rounding of the same float32 model, within the bound that rounding allows
    (tests/helpers/activation_rounding.py), so the two within twice that bound of each other.
    Every step (prefill chunks too) takes the int8 row kernel: no panel or dense GEMM, whose
    bfloat16 rounding is another model of error."""
    every_row_kernel = dict(quant_panel_rows=0, quant_gemm_rows=0)
    generator = torch.Generator().manual_seed(11)
    prompt_lens = {"r0": 5, "r1": 10}
    sequences = {r: torch.randint(3, VOCAB, (n + NUM_NEW,), generator=generator).tolist()
                 for r, n in prompt_lens.items()}
    native_steps = count_native_steps(monkeypatch)
    split = run_teacher_forced(PagedRunner(_model(gguf_path, 2, **every_row_kernel)), sequences, prompt_lens, chunk=3)
    assert native_steps[0] == NUM_NEW + 4  # every step ran natively: r1's 4 prefill chunks, then 16 single tokens
    per_op_model = _model(gguf_path, None, **every_row_kernel)
    per_op = run_teacher_forced(PagedRunner(per_op_model), sequences, prompt_lens, chunk=3)
    assert native_steps[0] == NUM_NEW + 4
    plain = load_model(ModelConfig.from_path(gguf_path, quantization="none", dtype="float32"))
    reference, bound = rounding_bound(plain, quantized_half_steps(plain, per_op_model),
                                      lambda m: every_token_logits(m, sequences, prompt_lens))
    assert max_deviation(split, reference) <= bound
    assert max_deviation(per_op, reference) <= bound
    assert max_deviation(split, per_op) <= 2 * bound


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
