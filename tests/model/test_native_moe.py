"""The native decoder's mixture-of-experts layers (#28, csrc/decoder/fused_decoder.c's moe_mlp)
against the per-op path of the same weights (moe.py's SparseMoeBlock), both fed the same tokens
(teacher forcing): tiny Qwen3-MoE (a dense layer between sparse ones), Mixtral (sliding window),
OLMoE (top-k weights as is, a Q/K norm over the whole projection) and a Qwen3-MoE with a gated
shared expert, in float32; routing edge cases (ties at and inside
the top-k boundary, experts no token picks); the same bits on 1, 2 and 3 threads, float32 and
GGUF experts held as stored (Q8_0, and llama.cpp's Q4_K_M where llama-quantize is built).
Quantized experts against the dequantized model: tests/model/test_moe.py's GGUF test, whose
one-token steps now run here."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvserve.model import moe
from kvserve.model.config import ModelConfig
from kvserve.model.native_decoder import NativeDecoder
from kvserve.native import cpu_kernels
from helpers.float_order import float32_reorder_bound
from helpers.native_steps import (count_native_steps, largest_relative_diff, native_model, per_op_model,
                                  run_chunks_of_two, steps_in_chunks_of_two)
from helpers.router_logits import RouterLogits
from paged_kv_helper import VOCAB, every_token_logits, save_tiny_model

pytestmark = pytest.mark.skipif(cpu_kernels.load_library() is None, reason="no native kernels")

# Same float32 math in another summation order (tests/helpers/float_order.py). A sparse layer
# chains more reductions than a dense one: besides the two norms, QKV, scores, softmax sum,
# weighted values and O, the router's logits, its softmax sum, the renormalizing sum, each
# expert's gate/up and down and the weighted sum over the top k: 13 < 2 x 9, so each of the
# three layers counts as two dense ones.
BOUND = float32_reorder_bound(num_layers=2 * 3)
# Prompts then teacher-forced tokens: chunks of 2 over three requests (<= 8 tokens a step),
# so every step runs natively.
PROMPT_LENS = [5, 13, 3]
NEW_TOKENS = 10


def _save_shared_expert_model(path: str, width: int = 32) -> ModelConfig:
    """The tiny Qwen3-MoE with a random gated shared expert of `width` on each sparse layer
    (Qwen3-Next's MLP; its other layer kinds stay out of the native decoder)."""
    tensors = load_file(f"{path}/model.safetensors")
    generator = torch.Generator().manual_seed(11)
    config = ModelConfig.from_path(path)
    for i, sparse in enumerate(config.sparse_layers):
        if not sparse:
            continue
        prefix = f"model.layers.{i}.mlp.shared_expert"
        for name, shape in (("gate_proj", (width, 64)), ("up_proj", (width, 64)), ("down_proj", (64, width))):
            tensors[f"{prefix}.{name}.weight"] = 0.2 * torch.randn(shape, generator=generator)
        tensors[f"{prefix}_gate.weight"] = 0.2 * torch.randn(1, 64, generator=generator)
    save_file(tensors, f"{path}/model.safetensors")
    return dataclasses.replace(config, shared_expert_intermediate_size=width)


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    cache = {}

    def get(name: str) -> ModelConfig:
        if name not in cache:
            family = "qwen3_moe" if name == "shared" else name
            path = save_tiny_model(family, tmp_path_factory.mktemp(name))
            cache[name] = _save_shared_expert_model(path) if name == "shared" else ModelConfig.from_path(path)
        return cache[name]
    return get


def _sequences(config: ModelConfig, seed: int) -> tuple[dict[str, list[int]], dict[str, int]]:
    generator = torch.Generator().manual_seed(seed)
    sequences = {f"r{i}": torch.randint(3, VOCAB, (n + NEW_TOKENS,), generator=generator).tolist()
                 for i, n in enumerate(PROMPT_LENS)}
    return sequences, {f"r{i}": n for i, n in enumerate(PROMPT_LENS)}


def _margin_ok_seed(config: ModelConfig, edit=None) -> tuple[dict, dict]:
    """Sequences whose every routing decision on the per-op path is clear of a tie by more than
    twice the bound (within that margin float order alone may pick another expert, a jump no
    rounding bound covers; random routers put about one decision in a few hundred that close)."""
    for seed in range(20):
        sequences, prompt_lens = _sequences(config, seed)
        recorder = RouterLogits()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(moe, "route", recorder)
            every_token_logits(per_op_model(config, edit), sequences, prompt_lens)
        if recorder.min_margin(config.num_experts_per_tok) > 2 * BOUND:
            return sequences, prompt_lens
    raise AssertionError("no seed of 20 routes clear of ties")


@pytest.mark.parametrize("name,threads", [("qwen3_moe", 1), ("qwen3_moe", 2), ("mixtral", 1), ("mixtral", 3),
                                          ("olmoe", 1), ("olmoe", 3), ("shared", 1), ("shared", 2)])
def test_native_moe_matches_per_op_path(configs, monkeypatch, name, threads):
    """Every step native (prompt chunks over cached context and one-token steps, up to 6 tokens),
    logits within the float-order bound of the per-op path's."""
    config = configs(name)
    assert config.is_moe and (config.shared_expert_intermediate_size > 0) == (name == "shared")
    sequences, prompt_lens = _margin_ok_seed(config)
    per_op = run_chunks_of_two(per_op_model(config), sequences, prompt_lens)
    native_steps = count_native_steps(monkeypatch)
    native = run_chunks_of_two(native_model(config, threads=threads), sequences, prompt_lens)
    assert native_steps[0] == steps_in_chunks_of_two(sequences, prompt_lens)
    assert largest_relative_diff(native, per_op) <= BOUND


def _set_routers(rows):
    """An edit setting every sparse layer's router to `rows(num_experts, hidden)` (and top_k)."""
    def edit(model):
        with torch.inference_mode():
            for layer in model.layers:
                if isinstance(layer.mlp, moe.SparseMoeBlock):
                    layer.mlp.gate.weight.copy_(rows(*layer.mlp.gate.weight.shape))
    return edit


def _dominant(signs: list[int], top_k: int, unpicked_nan: bool = False):
    """Routers whose first len(signs) rows are sign * 1000 u (u a random unit-ish row): those
    experts' logits dwarf the others' (rows of 0.2 randn) for every token, so the top k comes
    from them; with `unpicked_nan`, the other experts' weights are NaN."""
    def rows(num_experts, hidden):
        generator = torch.Generator().manual_seed(21)
        weight = 0.2 * torch.randn(num_experts, hidden, generator=generator)
        u = torch.randn(hidden, generator=generator)
        for e, sign in enumerate(signs):
            weight[e] = sign * 1000.0 * u
        return weight

    def edit(model):
        _set_routers(rows)(model)
        for layer in model.layers:
            if isinstance(layer.mlp, moe.SparseMoeBlock):
                layer.mlp.top_k = top_k
                if unpicked_nan:
                    with torch.inference_mode():
                        for expert in layer.mlp.experts[len(signs):]:
                            for param in expert.parameters():
                                param.fill_(float("nan"))
    return edit


def _edge_case(config, monkeypatch, edit) -> tuple[dict, dict, RouterLogits, NativeDecoder, list[int], int]:
    sequences, prompt_lens = _sequences(config, 0)
    recorder = RouterLogits()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(moe, "route", recorder)
        per_op = run_chunks_of_two(per_op_model(config, edit), sequences, prompt_lens)
    native_steps = count_native_steps(monkeypatch)
    model = native_model(config, edit=edit)
    native = run_chunks_of_two(model, sequences, prompt_lens)
    return per_op, native, recorder, model._native, native_steps, steps_in_chunks_of_two(sequences, prompt_lens)


def test_ties_inside_the_top_k_run_natively(configs, monkeypatch):
    """Experts 0 and 1 tie exactly (equal router rows) and, for every token whose u.x > 0, are
    its top 2 (else expert 2's row, -u, is on top): either order picks the same two experts,
    summed in ascending id, so the native call keeps every step."""
    config = configs("qwen3_moe")
    per_op, native, recorder, decoder, native_steps, num_steps = _edge_case(config, monkeypatch,
                                                                            _dominant([1, 1, -1], 2))
    picks = torch.cat([ids for _, ids in recorder.calls])
    assert (picks.sort(-1).values == torch.tensor([0, 1])).all(-1).any()  # the tied pair picked
    assert decoder.num_routing_ties == 0 and native_steps[0] == num_steps
    assert largest_relative_diff(native, per_op) <= BOUND


@pytest.mark.parametrize("rows", ["tied pair", "zero router"])
def test_ties_at_the_top_k_boundary_go_to_the_per_op_path(configs, monkeypatch, rows):
    """A tie across the top-k boundary is broken by torch.topk's algorithm (topk(zeros(8), 2)
    picks 6 and 5 on CPU), which the native call does not reproduce: it hands such steps back,
    and they come out as the per-op path's. A zero router ties every expert for every token:
    every step with a sparse layer goes back, and the logits are the per-op path's bits."""
    config = configs("qwen3_moe")
    assert torch.topk(torch.zeros(8), 2).indices.tolist() != [0, 1]  # why the call cannot pick them itself
    edit = _dominant([1, 1], 1) if rows == "tied pair" else _set_routers(lambda e, h: torch.zeros(e, h))
    per_op, native, _, decoder, native_steps, num_steps = _edge_case(config, monkeypatch, edit)
    assert decoder.num_routing_ties > 0
    if rows == "zero router":
        assert native_steps[0] == 0 and decoder.num_routing_ties == num_steps
        assert all(torch.equal(native[r], per_op[r]) for r in per_op)
    assert largest_relative_diff(native, per_op) <= BOUND


def test_experts_no_token_picks_are_never_read(configs, monkeypatch):
    """Top 1 of routers whose rows 0 and 1 are +1000u and -1000u: every token goes to expert 0 or 1,
    the other experts' weights are NaN, and the native logits stay finite and within the bound."""
    config = configs("mixtral")
    per_op, native, recorder, decoder, native_steps, num_steps = _edge_case(
        config, monkeypatch, _dominant([1, -1], 1, unpicked_nan=True))
    assert set(torch.cat([ids for _, ids in recorder.calls]).flatten().tolist()) == {0, 1}
    assert native_steps[0] == num_steps
    assert all(torch.isfinite(native[r]).all() for r in native)
    assert largest_relative_diff(native, per_op) <= BOUND


def _moe_gguf(tmp_path, configs, type_name: str) -> str:
    """The tiny Qwen3-MoE as a GGUF of `type_name` (Q8_0: the test's writer; q4_k_m: the zoo's
    tiny Qwen3-MoE shape quantized by llama.cpp, skipped where llama-quantize is not built)."""
    from kvserve.bench import zoo
    if type_name == "q4_k_m":
        from kvserve.bench.llama_build import find_tool
        if find_tool("llama-quantize") is None:
            pytest.skip("llama-quantize is not built here (kvserve bench zoo builds it)")
        source = zoo.write_random_gguf(zoo.SHAPES["tiny-qwen3moe"], str(tmp_path / "moe.f16.gguf"), "f16")
        path = str(tmp_path / "moe.q4_k_m.gguf")
        zoo.quantize_with_llama_cpp(source, path, zoo.QUANT_TYPES["q4_k_m"])
        return path
    gguf = pytest.importorskip("gguf")
    from helpers.gguf_writer import write_gguf
    from paged_kv_helper import load_hf
    path = str(tmp_path / "moe.q8_0.gguf")
    write_gguf(load_hf(configs("qwen3_moe").path), path, gguf.GGMLQuantizationType.Q8_0)
    return path


@pytest.mark.parametrize("source", ["float32", "Q8_0", "q4_k_m"])
def test_thread_count_gives_the_same_bits(configs, tmp_path, source):
    """Each expert's rows split in whole tiles and every thread routing alike: 1, 2 and 3
    threads give bit-identical logits (float32 experts, GGUF experts held as stored)."""
    config = configs("qwen3_moe") if source == "float32" else ModelConfig.from_path(_moe_gguf(tmp_path, configs, source))
    sequences, prompt_lens = _sequences(config, 0)
    sequences = {r: [t % config.vocab_size for t in s] for r, s in sequences.items()}
    results = [run_chunks_of_two(native_model(config, threads=threads), sequences, prompt_lens) for threads in (1, 2, 3)]
    for other in results[1:]:
        assert all(torch.equal(other[r], results[0][r]) for r in results[0])


def _split_runs(config, edit, sequences, prompt_lens) -> dict[tuple[str, int], dict[str, torch.Tensor]]:
    """Teacher-forced logits of the native call with each MoE split forced, on 1, 2 and 3 threads."""
    results = {}
    for split in ("rows", "experts"):
        for threads in (1, 2, 3):
            model = native_model(config, threads=threads, edit=edit)
            model._native.moe_split = split
            assert model._native.moe_split == split
            results[split, threads] = run_chunks_of_two(model, sequences, prompt_lens)
    return results


@pytest.mark.parametrize("source", ["float32", "Q8_0"])
def test_whole_experts_per_thread_give_the_same_bits(configs, tmp_path, monkeypatch, source):
    """The chosen experts split over the threads whole (each thread runs gate/up, activation and
    down of a run of experts balanced by work) or by each expert's rows: every row is multiplied
    by the same kernel on the same inputs and summed in the same order, so both splits on 1, 2
    and 3 threads give bit-identical logits, and every step stays native."""
    config = configs("qwen3_moe") if source == "float32" else ModelConfig.from_path(_moe_gguf(tmp_path, configs, source))
    sequences, prompt_lens = _sequences(config, 0)
    sequences = {r: [t % config.vocab_size for t in s] for r, s in sequences.items()}
    native_steps = count_native_steps(monkeypatch)
    results = _split_runs(config, None, sequences, prompt_lens)
    assert native_steps[0] == len(results) * steps_in_chunks_of_two(sequences, prompt_lens)
    first = results["rows", 1]
    for other in results.values():
        assert all(torch.equal(other[r], first[r]) for r in first)


def _all_on_expert_0(model) -> None:
    """Every token's top 1 is expert 0: the embeddings' column 0 is 100 (the residual stream's
    column 0 stays far above the rest, so each MLP input's column 0 is positive), each sparse
    layer's MLP norm weighs it 1 and its router row 0 is 1000 e_0 (logit ~1000 x_0 against the
    other rows' 0.2 randn . x)."""
    with torch.inference_mode():
        model.embed_tokens.weight[:, 0] = 100.0
        for layer in model.layers:
            if isinstance(layer.mlp, moe.SparseMoeBlock):
                layer.post_attention_layernorm.weight[0] = 1.0
                layer.mlp.top_k = 1
                layer.mlp.gate.weight[0].zero_()
                layer.mlp.gate.weight[0, 0] = 1000.0


@pytest.mark.parametrize("case", ["every token on one expert", "experts no token picks"])
def test_whole_experts_per_thread_routing_edge_cases(configs, monkeypatch, case):
    """Every token on expert 0 (one expert holds all rows, the other threads get none), and top 1
    of rows +1000u / -1000u with the unpicked experts' weights NaN (never read): both splits, 1
    to 3 threads, the same finite bits, within the bound of the per-op path."""
    config = configs("mixtral")
    edit = _all_on_expert_0 if case == "every token on one expert" else _dominant([1, -1], 1, unpicked_nan=True)
    sequences, prompt_lens = _sequences(config, 0)
    recorder = RouterLogits()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(moe, "route", recorder)
        per_op = run_chunks_of_two(per_op_model(config, edit), sequences, prompt_lens)
    picked = set(torch.cat([ids for _, ids in recorder.calls]).flatten().tolist())
    assert picked == ({0} if case == "every token on one expert" else {0, 1})
    native_steps = count_native_steps(monkeypatch)
    results = _split_runs(config, edit, sequences, prompt_lens)
    assert native_steps[0] == len(results) * steps_in_chunks_of_two(sequences, prompt_lens)
    first = results["rows", 1]
    for other in results.values():
        assert all(torch.equal(other[r], first[r]) and torch.isfinite(other[r]).all() for r in first)
    assert largest_relative_diff(first, per_op) <= BOUND
