"""gpt-oss from GGUF (#28): a tiny random gpt-oss with MXFP4 experts, converted by llama.cpp's own
convert_hf_to_gguf.py (from llama-cpp-python's sdist, tests/helpers/gpt_oss_gguf.py), loaded by
kvserve: its config read from the GGUF keys equals the one read from the Hugging Face directory,
the file dequantized to float32 matches transformers in float32 (experts dequantized, exactly)
under teacher forcing, the MXFP4 experts run as stored within the activation-rounding bound of
that, and `kvserve generate --model x.gguf` answers."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from kvserve.model.config import ModelConfig
from kvserve.model.loader import load_model
from helpers.tiny_models import min_router_margin
from paged_kv_helper import PagedRunner, every_token_logits, held_weights, load_hf, run_teacher_forced

pytest.importorskip("gguf")

# |our logit - transformers' logit| <= MAX_RELATIVE_DIFF * max(1, max |transformers' logit|).
# Both run the same float32 operations (the experts' weights are the same float32 values: an
# MXFP4 value is a 4-bit code times a power of two, exact in float32, and the converter only
# moves its bits); only the order of reductions may differ. tests/model/test_moe.py derives
# 1.5e-4 for 19 chained reductions of up to 128 terms (gamma_128 = 7.6e-6 each, Higham 3.1);
# this 2-layer model has 13 (6 per layer plus the LM head), of at most 64 terms (hidden 64;
# attention spans at most 40 tokens), so the same figure bounds it with room.
MAX_RELATIVE_DIFF = 1.5e-4
SEQUENCE_LENGTHS = [9, 17, 26, 33, 40, 14]


@pytest.fixture(scope="module")
def gpt_oss_files(tmp_path_factory):
    """(transformers' float32 reference model, its directory, the GGUF path)."""
    from helpers.gpt_oss_gguf import convert_to_gguf, converter_or_skip, save_mxfp4_gpt_oss
    converter = converter_or_skip()
    root = tmp_path_factory.mktemp("gpt_oss_gguf")
    reference_dir, mxfp4_dir = str(root / "reference"), str(root / "mxfp4")
    save_mxfp4_gpt_oss(reference_dir, mxfp4_dir)
    path = convert_to_gguf(mxfp4_dir, str(root / "gpt-oss-mxfp4.gguf"), converter)
    return load_hf(reference_dir), reference_dir, path


def test_gguf_config_equals_the_hf_directory_config(gpt_oss_files):
    """Every field the decoder reads, from the GGUF keys (sliding pattern, YaRN unrounded, sinks,
    biased clamped-SwiGLU experts, softmax after top-k) as from config.json; the stop tokens are
    gpt-oss's three, found by name in the vocabulary (the file's EOS is <|return|> alone)."""
    _, reference_dir, path = gpt_oss_files
    ours, theirs = ModelConfig.from_path(path), ModelConfig.from_path(reference_dir)
    fields = ("architecture", "family", "num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
              "vocab_size", "layer_types", "sliding_window", "rope", "rope_local", "attention_bias", "qk_norm",
              "num_experts", "num_experts_per_tok", "moe_intermediate_size", "sparse_layers", "softmax_after_topk",
              "router_bias", "expert_bias", "swiglu_limit", "swiglu_alpha", "attention_sinks", "o_proj_bias",
              "tie_word_embeddings", "bos_token_id", "max_position_embeddings")
    assert {f: getattr(ours, f) for f in fields} == {f: getattr(theirs, f) for f in fields}
    assert ours.layer_types == ["sliding", "full"] and ours.rope.rope_type == "yarn" and not ours.rope.truncate
    assert ours.rms_norm_eps == pytest.approx(theirs.rms_norm_eps, rel=2 ** -23)  # stored as float32
    assert sorted(ours.eos_token_ids) == sorted(theirs.eos_token_ids)


def test_gguf_tokenizer_speaks_harmony_as_the_hf_one(gpt_oss_files):
    """The tokenizer built from the GGUF's keys has every harmony token as one token (so the
    server reads its replies by channel) and encodes a harmony prompt as the directory's does."""
    from transformers import AutoTokenizer
    from kvserve.model.tokenizer_files import load_tokenizer
    from kvserve.server.harmony import harmony_token_ids
    _, reference_dir, path = gpt_oss_files
    ours, theirs = load_tokenizer(path), AutoTokenizer.from_pretrained(reference_dir)
    assert harmony_token_ids(ours) == harmony_token_ids(theirs) is not None
    prompt = "<|start|>user<|message|>abc: ab ba<|end|><|start|>assistant<|channel|>analysis<|message|>"
    assert ours.encode(prompt, add_special_tokens=False) == theirs.encode(prompt, add_special_tokens=False)


def test_gguf_dequantized_matches_transformers_under_teacher_forcing(gpt_oss_files):
    """The file loaded as float32 on paged KV (blocks of 4, prefill chunks of 8 beside one-token
    steps, so the sliding layer's window of 12 is crossed) against transformers: every row of
    logits within MAX_RELATIVE_DIFF. Only sequences whose every routing decision is clear of a
    tie by more than rounding can move it are compared (see test_moe)."""
    hf, _, path = gpt_oss_files
    plain = load_model(ModelConfig.from_path(path, quantization="none", dtype="float32"))
    generator = torch.Generator().manual_seed(5)
    candidates = {f"r{i}": torch.randint(3, 256, (n,), generator=generator).tolist()
                  for i, n in enumerate(SEQUENCE_LENGTHS)}
    sequences = {r: s for r, s in candidates.items() if min_router_margin(hf, s) > 2 * MAX_RELATIVE_DIFF}
    assert len(sequences) >= 3 and max(map(len, sequences.values())) > 2 * 12
    prompt_lens = {r: len(s) // 2 for r, s in sequences.items()}
    logits = run_teacher_forced(PagedRunner(plain, block_size=4), sequences, prompt_lens, chunk=8)
    with torch.inference_mode():
        for req_id, tokens in sequences.items():
            ref = hf(torch.tensor([tokens])).logits[0, prompt_lens[req_id] - 1:].float()
            assert logits[req_id].shape == ref.shape
            assert (logits[req_id] - ref).abs().max().item() <= MAX_RELATIVE_DIFF * max(1.0, ref.abs().max().item())


def test_mxfp4_experts_run_as_stored_within_activation_rounding(gpt_oss_files):
    """Quantization "auto": every expert projection is held as the file's own MXFP4 blocks (not
    widened; the same values as the dequantizing loader's), and each layer's MoE block, on the
    hidden states the float32 load computes for real sequences (prefill and one-token rows),
    stays within the activation-rounding bound (tests/helpers/activation_rounding.py) of the
    float32 block: the reference block run again with each expert matmul's input moved by the
    int8 rounding's noise, DRAW_MARGIN times the largest deviation.

    Compared block by block, not on the model's logits: the MXFP4 kernels round activations to
    int8 (they have no int16 mode), which moves the next layer's router logits by about 1e-2 of
    their scale, and this tiny random router puts near-ties within that of nearly every
    sequence; a flipped expert is a jump no rounding bound covers. On the same input, the
    router (float32, not held quantized) picks the same experts in both blocks."""
    from helpers.activation_rounding import DRAW_MARGIN, ROUNDING_RUNS, dithered_inputs, quantized_half_steps
    from kvserve.model import quantized
    if quantized.kernel_isa() is None:
        pytest.skip("no native kernels")
    _, _, path = gpt_oss_files
    config = ModelConfig.from_path(path)
    held = load_model(config)
    plain = load_model(ModelConfig.from_path(path, quantization="none", dtype="float32"))
    experts = {name: weight for name, weight in held_weights(held, plain).items() if ".experts." in name}
    assert len(experts) == 2 * config.num_experts * config.num_layers  # gate_up and down of each
    stored = [part for weight in experts.values() for part in getattr(weight, "parts", [weight])]
    assert {type(part).__name__ for part in stored} == {"StoredWeight"}
    assert {part.type_name for part in stored} == {"MXFP4"}

    generator = torch.Generator().manual_seed(1)
    sequences = {f"r{i}": torch.randint(3, 256, (n,), generator=generator).tolist() for i, n in enumerate([11, 29])}
    half_steps = quantized_half_steps(plain, held)
    draws = torch.Generator().manual_seed(2)
    for layer in range(config.num_layers):
        for x in _mlp_inputs(plain, layer, sequences) + [_mlp_inputs(plain, layer, sequences)[1][-1:]]:
            with torch.inference_mode():
                reference, ours = plain.layers[layer].mlp(x), held.layers[layer].mlp(x)
                worst = 0.0
                with dithered_inputs(plain, half_steps, draws) as perturbed:
                    for _ in range(ROUNDING_RUNS):
                        worst = max(worst, (plain.layers[layer].mlp(x) - reference).abs().max().item())
            assert perturbed[0] > 0
            scale = reference.abs().max().item()
            bound = DRAW_MARGIN * worst + 1e-5 * scale
            assert (ours - reference).abs().max().item() <= bound
            assert bound < 0.05 * scale  # still tells wrong weights apart


def _mlp_inputs(model, layer: int, sequences: dict[str, list[int]]) -> list[torch.Tensor]:
    """The inputs [tokens, hidden] of layer `layer`'s MoE block, one per sequence, as `model`
    computes them over the whole sequence in one step."""
    captured = []
    hook = model.layers[layer].mlp.register_forward_pre_hook(lambda _m, args: captured.append(args[0].detach().clone()))
    try:
        for req_id, tokens in sequences.items():
            every_token_logits(model, {req_id: tokens}, {req_id: 1})
    finally:
        hook.remove()
    return [x.reshape(-1, x.shape[-1]) for x in captured]


def test_kvserve_generate_answers_from_the_gguf(gpt_oss_files):
    """`kvserve generate --model gpt-oss.gguf` in float32: each token it picks is transformers'
    argmax on the same sequence (teacher forced), or within the float-order bound of it (a
    near-tie either may break its way)."""
    hf, reference_dir, path = gpt_oss_files
    prompt = "hello world"
    result = subprocess.run([sys.executable, "-m", "kvserve", "generate", "--model", path, "--json",
                             "--max-tokens", "6", "--temperature", "0", "--no-chat-template",
                             "--quantization", "none", "--dtype", "float32", prompt],
                            capture_output=True, text=True, timeout=300, env={**os.environ, "KVSERVE_LOG_LEVEL": "ERROR"})
    assert result.returncode == 0, result.stderr[-2000:]
    reply = json.loads(result.stdout.strip().splitlines()[-1])
    from transformers import AutoTokenizer
    prompt_ids = AutoTokenizer.from_pretrained(reference_dir).encode(prompt)
    assert reply["num_prompt_tokens"] == len(prompt_ids) and reply["num_generated_tokens"] == 6
    tokens = reply["token_ids"]
    with torch.inference_mode():
        rows = hf(torch.tensor([prompt_ids + tokens[:-1]])).logits[0, len(prompt_ids) - 1:].float()
    for token, row in zip(tokens, rows):
        assert row.max().item() - row[token].item() <= 2 * MAX_RELATIVE_DIFF * max(1.0, row.abs().max().item())


def test_gguf_experts_and_sinks_shard_across_tensor_parallel_ranks(gpt_oss_files, monkeypatch):
    """Two ranks load their shard of the GGUF's experts (gate/up rows, down columns, the expert
    biases; the router whole) and of the attention sinks (their query heads'); the ranks' MoE
    outputs add up to the unsharded block's. No process group: the all-reduce is the sum taken
    here. Bound: the same float32 operations, each down-projection sum of 32 terms split into
    two halves (reordered), on top of the block's three reductions of at most 64 terms:
    3 * 64 * 2**-24 = 1.2e-5 of the output's scale (as tests/model/test_moe.py derives)."""
    from kvserve.model.parallel import TPContext
    _, _, path = gpt_oss_files
    config = ModelConfig.from_path(path, quantization="none", dtype="float32")
    full = load_model(config)
    ranks = [load_model(config, tp_rank=rank, tp_size=2) for rank in range(2)]
    monkeypatch.setattr(TPContext, "all_reduce", lambda self, tensor: tensor)
    x = torch.randn(6, config.hidden_size, generator=torch.Generator().manual_seed(8))
    for layer in range(config.num_layers):
        with torch.inference_mode():
            ours, ref = sum(rank.layers[layer].mlp(x) for rank in ranks), full.layers[layer].mlp(x)
        assert (ours - ref).abs().max().item() <= 1.2e-5 * max(1.0, ref.abs().max().item())
        sinks = torch.cat([rank.layers[layer].self_attn.sinks for rank in ranks])
        assert torch.equal(sinks, full.layers[layer].self_attn.sinks)
