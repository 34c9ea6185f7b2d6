"""Greedy tokens through the real scheduler + ModelRunner + model are greedy under
transformers (float32, eager attention) on tiny random Llama and Gemma-2 models: fed each
prompt and the tokens the engine took, the reference gives every one of them its largest
logit, up to float32 rounding (tests/helpers/greedy_check.py: a near-tie that another float
order breaks the other way is no failure).

Gemma-2's sliding window (12) is shorter than most prompts, so the hybrid KV
layout (a full-attention group and a sliding-window or circular-buffer group)
matters.
"""
import pytest

from engine_helpers import assert_pool_whole, greedy_params, make_engine, run_to_completion
from helpers.greedy_check import assert_greedy_continuations
from tiny_models import load_reference, random_prompts, save_tiny_model

MAX_TOKENS = 12
SHARED_PREFIX = list(range(10, 33))  # 23 tokens: not a multiple of the block size
DISTINCT = random_prompts(6, 2, 40, seed=1)
SHARED = random_prompts(3, 1, 9, seed=2, shared_prefix=SHARED_PREFIX)
PROMPTS = DISTINCT + SHARED


@pytest.fixture(scope="module", params=["llama", "gemma2"])
def model_and_reference(request, tmp_path_factory):
    path = save_tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, path, load_reference(path)


def check(core, prompts, reference, max_tokens=MAX_TOKENS):
    outputs = run_to_completion(core, prompts, greedy_params(max_tokens))
    assert_greedy_continuations(reference, prompts, [outputs[str(i)] for i in range(len(prompts))], max_tokens)
    assert_pool_whole(core)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_mixed_batch_matches_transformers(model_and_reference, async_scheduling):
    _, path, reference = model_and_reference
    core = make_engine(path, async_scheduling=async_scheduling)
    try:
        check(core, PROMPTS, reference)
    finally:
        core.shutdown()


def test_same_step_prefix_hits(model_and_reference):
    """The KV manager caches blocks when it allocates them, so a request admitted in the
    same step hits blocks that an earlier request of that step writes."""
    _, path, reference = model_and_reference
    core = make_engine(path)
    try:
        check(core, SHARED, reference)
        assert core.get_stats().prefix_cache_hits > 0
    finally:
        core.shutdown()


def test_no_prefix_caching(model_and_reference):
    _, path, reference = model_and_reference
    core = make_engine(path, enable_prefix_caching=False)
    try:
        check(core, PROMPTS, reference)
    finally:
        core.shutdown()


def test_prefix_hits_with_partial_block_copies(model_and_reference):
    """Block 8, hash unit 2: the shared 23-token prefix hits inside a block (CoW copy)."""
    kind, path, reference = model_and_reference
    core = make_engine(path, block_size=8, hash_block_size=2)
    try:
        check(core, SHARED[:1], reference)
        stats_before = core.get_stats()
        outputs = run_to_completion(core, SHARED[1:], greedy_params(MAX_TOKENS), first_id=100)
        assert_greedy_continuations(reference, SHARED[1:], [outputs[str(100 + i)] for i in range(2)], MAX_TOKENS)
        assert core.get_stats().prefix_cache_hits > stats_before.prefix_cache_hits
        if kind == "llama":  # hybrid models only hit where every group agrees: whole blocks
            assert core.executor.num_block_copies > 0
        assert_pool_whole(core)
    finally:
        core.shutdown()


def test_chunked_prefill(model_and_reference):
    _, path, reference = model_and_reference
    core = make_engine(path, max_num_batched_tokens=7)
    try:
        check(core, PROMPTS, reference)
        assert core.executor.max_tokens_per_step <= 7
    finally:
        core.shutdown()


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_preemption_and_recompute(model_and_reference, async_scheduling):
    kind, path, reference = model_and_reference
    # 30-34 blocks of 4 tokens: the 9 requests (up to 52 tokens each) cannot all fit.
    # (Gemma-2's two groups draw from one pool; its window group holds few blocks.)
    num_blocks, bytes_per_block = {"llama": (30, 2 * 2 * 2 * 16 * 4 * 4), "gemma2": (34, 2 * 2 * 2 * 16 * 4 * 4)}[kind]
    core = make_engine(path, kv_cache_memory=num_blocks * bytes_per_block, async_scheduling=async_scheduling)
    try:
        check(core, PROMPTS, reference)
        assert core.get_stats().num_preemptions > 0
    finally:
        core.shutdown()


def test_gemma_circular_buffer_windows(model_and_reference):
    kind, path, reference = model_and_reference
    if kind != "gemma2":
        pytest.skip("only Gemma-2 has windowed layers")
    core = make_engine(path, sliding_window_kv="circular", max_num_batched_tokens=9)
    try:
        check(core, PROMPTS, reference)
    finally:
        core.shutdown()


def test_logprobs_match_transformers_log_softmax(model_and_reference):
    """Logprobs come from the logits row of each request's last token, in a mixed batch
    where some requests ask for logprobs and some do not."""
    import torch

    from kvserve.engine.core import EngineCoreRequest
    from kvserve.sampling_params import SamplingParams

    _, path, reference = model_and_reference
    core = make_engine(path, max_num_batched_tokens=16)
    try:
        for i, prompt in enumerate(DISTINCT[:4]):
            logprobs = 3 if i % 2 == 0 else None
            core.add_request(EngineCoreRequest(str(i), prompt, SamplingParams(
                temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=logprobs)))
        logprobs_by_req = {str(i): [] for i in range(4)}
        while core.has_unfinished_requests():
            for output in core.step():
                logprobs_by_req[output.request_id].extend(output.new_logprobs or [])
        for i in range(4):
            entries = logprobs_by_req[str(i)]
            if i % 2:
                assert entries == []
                continue
            taken = [e.sampled_token_id for e in entries]
            assert_greedy_continuations(reference, [DISTINCT[i]], [taken], 4)
            with torch.inference_mode():  # teacher forced on the engine's own tokens
                want = torch.log_softmax(reference(torch.tensor([DISTINCT[i] + taken])).logits[0].float(), dim=-1)
            for step, entry in enumerate(entries):
                row = want[len(DISTINCT[i]) - 1 + step]
                assert entry.sampled_logprob == pytest.approx(row[entry.sampled_token_id].item(), abs=1e-4)
                assert entry.sampled_rank == 1
                # The top 3 as the reference has them, up to the order of near-ties.
                assert entry.top_logprobs == sorted(entry.top_logprobs, reverse=True)
                assert entry.top_logprobs == pytest.approx(row[entry.top_token_ids].tolist(), abs=1e-4)
                assert entry.top_logprobs == pytest.approx(row.topk(3).values.tolist(), abs=1e-4)
        assert_pool_whole(core)
    finally:
        core.shutdown()
