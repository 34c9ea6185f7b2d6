"""The native decoder on steps of 9 to 128 tokens (batched decode, mixed prefill and
decode steps, prompt chunks the per-op path gives the tiled prefill attention) over quantized
weights, against the per-op torch path of the same model, both
fed the same tokens (teacher forcing) and each within the activation-rounding bound of the
float32 model (the GGUF dequantized), with the rows and the attention shared
out over threads, for weights held as stored (csrc/linear/gguf_rows.c, int8 activations) and
repacked (int16 activations: the panel GEMM on every path it has); and the step sizes it
must decline."""
from __future__ import annotations

import pytest

from kvserve.native import cpu_kernels, dispatch
from kvserve.native import isa as isa_table
from kvserve.model import native_decoder, quantized
from kvserve.model.config import ModelConfig
from kvserve.model.loader import load_model
from helpers.kernel_switches import env_kernels
from helpers.native_steps import record_step_sizes
from paged_kv_helper import PagedRunner, load_hf, prompts_of_lengths, random_prompts, run_greedy, save_tiny_model

pytestmark = pytest.mark.skipif(cpu_kernels.load_library() is None or quantized.kernel_isa() is None,
                                reason="no native kernels")
gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QType  # noqa: E402
from helpers.gguf_writer import write_gguf  # noqa: E402

PANEL_PATHS = [path for path in isa_table.ISAS if dispatch.available("quant_gemm", path)]
# No fixed bound between the two paths: both run the same matmul kernels on the same rows,
# but what they round to int8/int16 per block comes out of float code of another order
# (RMSNorm, RoPE, attention in C against torch), so an input within float32 rounding of the
# middle between two steps rounds one step apart (seen on Intel Xeons, not on AMD Zen 5). So
# each path's logits must lie within the bound that activation rounding allows of the float32
# model (tests/helpers/activation_rounding.py, derived per run), the two within twice it.
# Weights held repacked (int16 activations) take the panel GEMM from 4 rows, which on AVX-512
# rounds weights and inputs to bfloat16: `repacked_half_steps` draws that rounding too.


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    paths = {}

    def get(family: str, qtype: QType) -> str:
        key = (family, qtype)
        if key not in paths:
            path = str(tmp_path_factory.mktemp("gguf") / f"tiny-{family}-{qtype.name}.gguf")
            write_gguf(load_hf(save_tiny_model(family, tmp_path_factory.mktemp(family))), path, qtype)
            paths[key] = path
        return paths[key]
    return get


@pytest.fixture
def step_sizes(monkeypatch):
    """The token count of every step the native decoder ran (did not decline)."""
    return record_step_sizes(monkeypatch)


# Kernel switches that hold the weights repacked for the older kernels (and its panel GEMM):
# the stored-block kernels take int8 activations only.
REPACKED = {"quant_act_bits": 16}


def _run(path: str, prompts, new_tokens: int, chunk: int, native: bool, isa: str | None = None,
         threads: int | None = None, follow=None, **switches):
    """`run_greedy` on the model at `path`, native or per-op; `follow`: another run's tokens."""
    model = load_model(ModelConfig.from_path(path),
                       kernel_config=env_kernels(**({"quant_isa": isa} if isa else {}), **switches))
    if not native:
        model._native = None  # decided: the torch path
    elif threads:
        model._native = native_decoder.NativeDecoder.for_model(model)
        model._native.num_threads = threads
    return run_greedy(PagedRunner(model, block_size=4), prompts, new_tokens, chunk=chunk, follow=follow)


def _assert_same(ours, ref, path: str, prompts: dict[str, list[int]], **switches) -> None:
    """`ours` ran following `ref`'s greedy tokens (teacher forcing: a near-tie between two
    float orders is no failure); each within the activation-rounding bound of the float32
    model run on the same tokens, so within twice it of each other."""
    import torch
    from helpers.activation_rounding import max_deviation, quantized_half_steps, repacked_half_steps, rounding_bound
    from paged_kv_helper import every_token_logits

    (tokens, logits), (ref_tokens, ref_logits) = ours, ref
    assert tokens == ref_tokens
    held = load_model(ModelConfig.from_path(path), kernel_config=env_kernels(**switches))
    plain = load_model(ModelConfig.from_path(path, quantization="none", dtype="float32"))
    plain._native = None  # decided: the per-op path, in float32
    sequences = {r: prompt + tokens[r][:-1] for r, prompt in prompts.items()}
    prompt_lens = {r: len(prompt) for r, prompt in prompts.items()}
    half_steps = (repacked_half_steps if switches.get("quant_act_bits") == 16 else quantized_half_steps)(plain, held)
    reference, bound = rounding_bound(plain, half_steps,
                                      lambda model: every_token_logits(model, sequences, prompt_lens))
    stacked = [{r: torch.stack(rows) for r, rows in run.items()} for run in (logits, ref_logits)]
    assert max(max_deviation(run, reference) for run in stacked) <= bound
    assert max_deviation(*stacked) <= 2 * bound
    # The bound still tells a broken path apart (a wrong weight or a skipped layer moves logits
    # by their whole range): int8 rounding on this random tiny model (large init, 24 decode
    # steps) draws up to about a quarter of the range, int16 far less.
    assert bound < 0.5 * min((ref.amax(-1) - ref.amin(-1)).min().item() for ref in reference.values())


@pytest.mark.parametrize("layout", ["stored", "repacked"])
@pytest.mark.parametrize("isa", PANEL_PATHS)
def test_batched_and_mixed_steps_match_the_torch_path(gguf_path, step_sizes, isa, layout):
    """12 requests, prompt chunks of 4: the first steps mix prefill chunks of several
    requests (up to 48 tokens), later ones mix the last chunks with decodes, then 12-token
    decode steps over cached context; threads 2 share out rows (panels where repacked) and
    attention tokens."""
    path = gguf_path("llama", QType.Q4_1)
    switches = REPACKED if layout == "repacked" else {}
    if layout == "stored" and "Q4_1" not in quantized.stored_types(env_kernels(quant_isa=isa)):
        pytest.skip(f"Q4_1 is not held as stored on the {isa} path")
    prompts = random_prompts(12, seed=1)
    ref = _run(path, prompts, 24, chunk=4, native=False, isa=isa, **switches)
    ours = _run(path, prompts, 24, chunk=4, native=True, isa=isa, threads=2, follow=ref[0], **switches)
    assert max(step_sizes) > 16 and sum(size > 8 for size in step_sizes) >= 20
    _assert_same(ours, ref, path, prompts, quant_isa=isa, **switches)


def test_long_prompt_chunks_match_the_torch_paths_tiled_prefill(gguf_path, step_sizes, monkeypatch):
    """Prompt chunks of 40 tokens, three requests a step (up to 120 tokens): the per-op path
    attends each chunk with the tiled prefill kernel (csrc/attention/prefill_attention.c, an
    online softmax over key tiles), the native call token by token (paged_attention.c, the
    exact two-pass softmax). The same attention in another float32 order, so no equality:
    teacher forced, each path within the activation-rounding bound of the float32 model
    (`_assert_same`; float32 order is far below the int8 steps that bound draws)."""
    path = gguf_path("llama", QType.Q4_1)
    tiled_chunks: list[int] = []
    tiled = cpu_kernels.prefill_attention_cpu

    def recording(q, kv_cache, out, chunk_start, chunk_len, *args, **kwargs):
        tiled_chunks.extend(chunk_len.tolist())
        return tiled(q, kv_cache, out, chunk_start, chunk_len, *args, **kwargs)
    monkeypatch.setattr(cpu_kernels, "prefill_attention_cpu", recording)
    prompts = prompts_of_lengths([90, 57, 41], seed=4)
    ref = _run(path, prompts, 8, chunk=40, native=False)
    assert tiled_chunks.count(40) >= 4  # every full chunk took the tiled kernel on the per-op path
    tiled_chunks.clear()
    ours = _run(path, prompts, 8, chunk=40, native=True, threads=2, follow=ref[0])
    assert max(step_sizes) == 120 and not tiled_chunks  # the native call ran the prompt chunks itself
    _assert_same(ours, ref, path, prompts)


@pytest.mark.parametrize("family,qtype", [("llama", QType.Q8_0), ("qwen2", QType.Q4_0)])
def test_forty_sequences_decoding_together(gguf_path, step_sizes, family, qtype):
    path = gguf_path(family, qtype)
    prompts = random_prompts(40, seed=2)
    ref = _run(path, prompts, 12, chunk=1, native=False)
    ours = _run(path, prompts, 12, chunk=1, native=True, follow=ref[0])  # chunk 1: one token per request and step
    assert step_sizes.count(40) >= 14 and max(step_sizes) == 40  # until the shortest request ends
    _assert_same(ours, ref, path, prompts)


def test_steps_past_the_limit_and_plain_weights_are_declined(gguf_path, step_sizes, tmp_path):
    path = gguf_path("llama", QType.Q4_1)
    decoder = native_decoder.NativeDecoder.for_model(load_model(ModelConfig.from_path(path), kernel_config=env_kernels()))
    assert decoder.max_tokens == native_decoder.MAX_TOKENS
    prompts = {"long": random_prompts(1, seed=3)["r0"] * 10}  # > 128 tokens in one chunk: the torch path
    ref = _run(path, prompts, 2, chunk=1000, native=False)
    ours = _run(path, prompts, 2, chunk=1000, native=True, follow=ref[0])
    assert step_sizes == [1]  # only the decode step after the prompt
    _assert_same(ours, ref, path, prompts)
    no_panel = load_model(ModelConfig.from_path(path), kernel_config=env_kernels(quant_panel_rows=0, **REPACKED))
    assert native_decoder.NativeDecoder.for_model(no_panel).max_tokens == native_decoder.SMALL_STEP_TOKENS
    if quantized.stored_types(env_kernels()):  # stored weights: the row kernel takes every step size
        stored = load_model(ModelConfig.from_path(path), kernel_config=env_kernels(quant_panel_rows=0))
        assert native_decoder.NativeDecoder.for_model(stored).max_tokens == native_decoder.MAX_TOKENS
    plain = load_model(ModelConfig.from_path(save_tiny_model("llama", tmp_path / "llama")), kernel_config=env_kernels())
    assert native_decoder.NativeDecoder.for_model(plain).max_tokens == native_decoder.SMALL_STEP_TOKENS
