"""Greedy outputs and logits of DecoderModel on paged KV against transformers
(eager attention, float32) on random-weight tiny models of every family."""
from __future__ import annotations

import pytest
import torch
import transformers

from kvserve.kv_cache.utils import KVCacheBlockCopy
from kvserve.native import cpu_kernels
from kvserve.model.config import ModelConfig
from kvserve.model.loader import load_model
from helpers.kernel_switches import env_kernels
from helpers.float_order import TINY_MODEL_REORDER_BOUND
from paged_kv_helper import (WINDOW, PagedRunner, assert_hf_logits_close, hf_greedy, prompts_of_lengths, run_greedy,
                             tiny_models_with_reference)

FAMILIES = ["llama", "llama3", "mistral", "qwen2", "qwen3", "gemma2", "gemma3"]
# Same float32 math in a different order: tests/helpers/float_order.py derives the bound.
MAX_LOGIT_DIFF = TINY_MODEL_REORDER_BOUND
NUM_NEW = 6


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tiny_models_with_reference(tmp_path_factory)


def _check_against_hf(hf, prompts, tokens, logits) -> None:
    """Against transformers fed our greedy tokens (teacher forcing, not its own greedy run)."""
    assert_hf_logits_close(hf, prompts, tokens, logits, MAX_LOGIT_DIFF)


@pytest.mark.parametrize("family", FAMILIES)
def test_mixed_batch_chunked_prefill_matches_transformers(models, family):
    hf, config = models(family)
    model = load_model(config, kernel_config=env_kernels())
    # 29 and 40 exceed the sliding window (12); chunk 11 splits them over several steps.
    prompts = prompts_of_lengths([3, 29, 17, 40, 1])
    tokens, logits = run_greedy(PagedRunner(model, block_size=4), prompts, NUM_NEW, chunk=11)
    _check_against_hf(hf, prompts, tokens, logits)


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma3"])
def test_long_single_chunk_prefill_matches_transformers(models, family):
    """Whole 40+ token prompts in one step (the attention backend's long-query path)."""
    hf, config = models(family)
    prompts = prompts_of_lengths([45, 38, 2], seed=7)
    tokens, logits = run_greedy(PagedRunner(load_model(config, kernel_config=env_kernels()), block_size=8), prompts, 3, chunk=64)
    _check_against_hf(hf, prompts, tokens, logits)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "gemma3"])
def test_prefix_reuse_and_cow_copy_match_transformers(models, family):
    hf, config = models(family)
    runner = PagedRunner(load_model(config, kernel_config=env_kernels()), block_size=4)
    base = prompts_of_lengths([22], seed=1)["r0"]
    run_greedy(runner, {"a": base}, 1, chunk=64)
    shared = runner.requests["a"].block_ids
    tail = prompts_of_lengths([9], seed=2)["r0"]

    # Full-block reuse: 16 cached tokens = 4 whole blocks of every group.
    runner.add("b", base[:16] + tail, shared_blocks=[t[:4] for t in shared], num_computed=16)
    # Partial hit: 18 tokens cached, the 5th block copied (CoW) into a block of c's own.
    own = [runner.new_block() for _ in shared]
    runner.copy_blocks([KVCacheBlockCopy(g, shared[g][4], own[g], 2) for g in range(len(shared))])
    runner.add("c", base[:18] + tail, shared_blocks=[t[:4] + [own[g]] for g, t in enumerate(shared)],
               num_computed=18)
    prompts = {"b": base[:16] + tail, "c": base[:18] + tail}
    tokens, logits = run_greedy(runner, prompts, NUM_NEW, chunk=5)
    _check_against_hf(hf, prompts, tokens, logits)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_prefix_blocks_filled_in_the_same_step_match_transformers(models, family):
    """The KV manager caches blocks when it allocates them, so a request may hit
    blocks that another request of the same step is writing."""
    hf, config = models(family)
    runner = PagedRunner(load_model(config, kernel_config=env_kernels()), block_size=4)
    base, tail = prompts_of_lengths([22], seed=5)["r0"], prompts_of_lengths([9], seed=6)["r0"]
    runner.add("a", base)
    shared = runner.reserve("a", len(base))
    runner.add("b", base[:16] + tail, shared_blocks=[t[:4] for t in shared], num_computed=16)
    prompts = {"a": base, "b": base[:16] + tail}
    tokens, logits = run_greedy(runner, prompts, NUM_NEW, chunk=64)
    _check_against_hf(hf, prompts, tokens, logits)


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gemma3"])
def test_circular_buffer_kv_matches_transformers(models, family):
    hf, config = models(family)
    runner = PagedRunner(load_model(config, kernel_config=env_kernels()), block_size=4, sliding_window_kv="circular")
    # Ring = ceil(12 / 4) + 1 = 4 blocks (16 slots): a 20-token chunk wraps the ring within one step.
    assert any(type(s).__name__ == "CircularBufferSpec" for s in runner.specs.values())
    prompts = prompts_of_lengths([45, 7, 30], seed=3)
    tokens, logits = run_greedy(runner, prompts, NUM_NEW + 10, chunk=20)
    assert 45 + NUM_NEW + 10 > 4 * 4 + WINDOW
    _check_against_hf(hf, prompts, tokens, logits)


def test_hybrid_model_declares_two_kv_groups(models):
    _, config = models("gemma2")
    model = load_model(config, kernel_config=env_kernels())
    specs = model.kv_cache_specs(16, torch.float32)
    kinds = {type(spec).__name__ for spec in specs.values()}
    assert kinds == {"FullAttentionSpec", "SlidingWindowSpec"}
    assert {s.sliding_window for s in specs.values() if hasattr(s, "sliding_window")} == {WINDOW}
    circular = model.kv_cache_specs(16, torch.float32, sliding_window_kv="circular")
    assert {type(s).__name__ for s in circular.values()} == {"FullAttentionSpec", "CircularBufferSpec"}


def test_bfloat16_model_tracks_float32(models):
    hf, config = models("llama")
    prompts = prompts_of_lengths([13, 21], seed=4)
    config_bf16 = ModelConfig.from_path(config.path, dtype="bfloat16")
    _, logits32 = run_greedy(PagedRunner(load_model(config, kernel_config=env_kernels())), prompts, 1, chunk=64)
    _, logits16 = run_greedy(PagedRunner(load_model(config_bf16, kernel_config=env_kernels())), prompts, 1, chunk=64)
    for req_id in prompts:
        ref = logits32[req_id][0]
        # bf16 keeps ~3 significant digits; compare relative to the logit scale.
        assert (logits16[req_id][0] - ref).abs().max() < 0.05 * ref.abs().max()


@pytest.mark.parametrize("layout", ["onednn", "onednn-keep-plain", "panels"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2"])
def test_packed_cpu_weights_match_transformers(models, family, layout):
    """Packed linear weights: same outputs. "panels" (the runner's CPU default for float32
    where the native kernels build): held only in the float32 panel matmul's layout, every
    step through it. oneDNN: without keep_plain the plain weights are dropped (the
    embedding, tied or not, stays); with it the decode steps (3 rows) run through the
    small-batch kernel on them."""
    panels, keep_plain = layout == "panels", layout == "onednn-keep-plain"
    if not panels and not torch.backends.mkldnn.is_available():
        pytest.skip("oneDNN not available")
    if (keep_plain and not cpu_kernels.small_linear_supported(torch.float32)) or (
            panels and cpu_kernels.load_library() is None):
        pytest.skip("the native matmul kernel is not built on this CPU")
    hf, config = models(family)
    model = load_model(config, kernel_config=env_kernels())
    assert model.pack_linear_weights(keep_plain=keep_plain, panels=panels)
    qkv = model.layers[0].self_attn.qkv_proj
    if keep_plain:
        assert qkv.small_batch_kernel and qkv.weight is not None and model.lm_head.weight is not None
    else:
        assert qkv.weight is None and model.lm_head.weight is None
        assert (qkv.panel_weight is not None) == panels
    assert model.embed_tokens.weight is not None
    prompts = prompts_of_lengths([3, 29, 17], seed=5)
    tokens, logits = run_greedy(PagedRunner(model, block_size=4), prompts, NUM_NEW, chunk=11)
    _check_against_hf(hf, prompts, tokens, logits)


@pytest.mark.parametrize("keep_plain", [False, True], ids=["packed-only", "small-batch-kernel"])
def test_packed_bfloat16_weights_match_plain_bfloat16(models, keep_plain):
    if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        pytest.skip("oneDNN bfloat16 not available")
    if keep_plain and not cpu_kernels.small_linear_supported(torch.bfloat16):
        pytest.skip("the bfloat16 small-batch matmul kernel is not built on this CPU")
    _, config = models("llama")
    config_bf16 = ModelConfig.from_path(config.path, dtype="bfloat16")
    prompts = prompts_of_lengths([13, 21], seed=6)
    packed, plain = load_model(config_bf16, kernel_config=env_kernels()), load_model(config_bf16, kernel_config=env_kernels())
    assert packed.pack_linear_weights(keep_plain=keep_plain)
    # The per-op matmuls compared, not the native decoder (test_native_decoder_bf16.py).
    packed._native = plain._native = None
    # Two prompts and four new tokens: the decode steps have 2 rows (the kernel's range).
    plain_tokens, plain_logits = run_greedy(PagedRunner(plain), prompts, 4, chunk=64)
    packed_tokens, packed_logits = run_greedy(PagedRunner(packed), prompts, 4, chunk=64)
    for req_id in prompts:
        # Steps compared while both runs fed the same tokens (bf16 noise may flip a near-tie).
        same_history = 1 + next((i for i, (a, b) in enumerate(zip(plain_tokens[req_id], packed_tokens[req_id]))
                                 if a != b), len(plain_tokens[req_id]))
        assert same_history >= 2  # the prefill step and at least one decode step
        for ref, got in list(zip(plain_logits[req_id], packed_logits[req_id]))[:same_history]:
            # Both bf16 with float32 accumulation; only the summation order differs.
            assert (got - ref).abs().max() < 0.02 * ref.abs().max()


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_prompt_chunks_of_mixed_length_pack_and_match_transformers(models, family):
    """Second chunks of 150 and 4 tokens over cached context in one step: they attend in
    separate sub-batches (neither padded to the other) and greedy output equals transformers'."""
    from kvserve.kv_cache.interface import FullAttentionSpec
    from kvserve.model.attention import AttentionMetadata

    spec = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=16, dtype=torch.float32)
    block_table = torch.arange(1, 2 * 80 + 1).view(2, 80)
    plan = AttentionMetadata.build(spec, [150, 4], [300, 154], block_table).plan(4, None)
    assert sorted(sub.token_index.shape[1] for sub in plan.sub_batches) == [4, 150]

    hf, config = models(family)
    prompts = prompts_of_lengths([300, 154], seed=11)
    tokens, logits = run_greedy(PagedRunner(load_model(config, kernel_config=env_kernels()), block_size=4,
                                            num_blocks=1024), prompts, 3,
                                chunk=150)
    _check_against_hf(hf, prompts, tokens, logits)


# Ours in bfloat16 against transformers in bfloat16 (the outside oracle): both round
# weights and activations to 8 significant bits, in different orders, so their
# prefill logits differ by a few bfloat16 steps of the logit scale. The bound: at most
# 3% of the largest float32 logit apart, and no further from float32 than twice
# transformers' own bfloat16 distance from it (plus one bfloat16 step of the scale).
BF16_MAX_DIFF_OF_SCALE = 0.03


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2"])
def test_bfloat16_matches_transformers_in_bfloat16(models, family):
    hf32, config = models(family)
    hf16 = transformers.AutoModelForCausalLM.from_pretrained(
        config.path, dtype=torch.bfloat16, attn_implementation="eager").eval()
    ours = load_model(ModelConfig.from_path(config.path, dtype="bfloat16"), kernel_config=env_kernels())
    prompts = prompts_of_lengths([13, 21, 6], seed=9)
    _, logits = run_greedy(PagedRunner(ours, block_size=4), prompts, 1, chunk=64)
    for req_id, prompt in prompts.items():
        _, (ref16,) = hf_greedy(hf16, prompt, 1)
        _, (ref32,) = hf_greedy(hf32, prompt, 1)
        scale = ref32.abs().max().item()
        ours16 = logits[req_id][0].float()
        assert (ours16 - ref16).abs().max().item() <= BF16_MAX_DIFF_OF_SCALE * scale, req_id
        hf_error = (ref16 - ref32).abs().max().item()
        assert (ours16 - ref32).abs().max().item() <= 2 * hf_error + scale / 128, req_id
