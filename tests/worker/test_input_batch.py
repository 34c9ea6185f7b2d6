"""InputBatch against hand-made SchedulerOutputs: the diff protocol of output.py."""
import numpy as np
import pytest

from kvserve.kv_cache.interface import CircularBufferSpec, FullAttentionSpec, SlidingWindowSpec
from kvserve.sampling_params import SamplingParams
from kvserve.messages import CachedRequestData, NewRequestData, SchedulerOutput
from kvserve.worker.input_batch import InputBatch, InputPreparationError

BS = 4
FULL = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype="float32")


def new_req(req_id, prompt, block_ids, num_computed=0, outputs=()):
    return NewRequestData(req_id, list(prompt), SamplingParams(temperature=0), block_ids,
                          num_computed, list(outputs))


def sched(step, new=(), cached=(), num_sched=None, finished=()):
    cached_data = CachedRequestData()
    for req_id, new_blocks, num_computed in cached:
        cached_data.req_ids.append(req_id)
        cached_data.new_block_ids.append(new_blocks)
        cached_data.num_computed_tokens.append(num_computed)
    return SchedulerOutput(step, list(new), cached_data, dict(num_sched),
                           sum(num_sched.values()), finished_req_ids=set(finished))


def test_prefill_chunks_then_decode_slots_and_sampling():
    batch = InputBatch([FULL], max_model_len=64, max_num_rows=1)
    prompt_a, prompt_b = list(range(100, 110)), list(range(200, 203))
    out = sched(1, new=[new_req("a", prompt_a, ([3, 7],)), new_req("b", prompt_b, ([5],))],
                num_sched={"a": 6, "b": 3})
    batch.apply_scheduler_output(out)
    prepared = batch.prepare(out)
    assert prepared.req_ids == ["a", "b"]
    np.testing.assert_array_equal(prepared.input_ids, prompt_a[:6] + prompt_b)
    np.testing.assert_array_equal(prepared.positions, [0, 1, 2, 3, 4, 5, 0, 1, 2])
    np.testing.assert_array_equal(prepared.query_start_loc, [0, 6, 9])
    np.testing.assert_array_equal(prepared.seq_lens, [6, 3])
    # block 3 holds positions 0-3, block 7 positions 4-7.
    np.testing.assert_array_equal(prepared.slot_mappings[0], [12, 13, 14, 15, 28, 29, 20, 21, 22])
    np.testing.assert_array_equal(prepared.sample_mask, [False, True])
    np.testing.assert_array_equal(prepared.logits_indices, [8])
    batch.append_sampled_token("b", 999)

    out = sched(2, cached=[("a", ([9],), 6), ("b", None, 3)], num_sched={"a": 4, "b": 1})
    batch.apply_scheduler_output(out)
    prepared = batch.prepare(out)
    np.testing.assert_array_equal(prepared.input_ids, prompt_a[6:] + [999])
    np.testing.assert_array_equal(prepared.positions, [6, 7, 8, 9, 3])
    np.testing.assert_array_equal(prepared.slot_mappings[0], [30, 31, 36, 37, 23])
    np.testing.assert_array_equal(prepared.sample_mask, [True, True])
    np.testing.assert_array_equal(prepared.logits_indices, [3, 4])
    np.testing.assert_array_equal(prepared.block_tables[0], [[3, 7, 9], [5, 0, 0]])


def test_async_placeholder_uses_the_token_sampled_last_step():
    batch = InputBatch([FULL], max_model_len=32)
    out1 = sched(1, new=[new_req("a", [1, 2, 3], ([1],))], num_sched={"a": 3})
    batch.apply_scheduler_output(out1)
    batch.prepare(out1)
    # Step 2 was scheduled before step 1's token reached the scheduler.
    out2 = sched(2, cached=[("a", ([2],), 3)], num_sched={"a": 1})
    batch.append_sampled_token("a", 42)  # step 1's sample, applied by the runner
    batch.apply_scheduler_output(out2)
    prepared = batch.prepare(out2)
    np.testing.assert_array_equal(prepared.input_ids, [42])
    np.testing.assert_array_equal(prepared.positions, [3])


def test_scheduling_an_unknown_token_is_an_error():
    batch = InputBatch([FULL], max_model_len=32)
    out1 = sched(1, new=[new_req("a", [1, 2, 3], ([1],))], num_sched={"a": 3})
    batch.apply_scheduler_output(out1)
    out2 = sched(2, cached=[("a", None, 3)], num_sched={"a": 1})
    batch.apply_scheduler_output(out2)
    with pytest.raises(InputPreparationError, match="knows only 3"):
        batch.prepare(out2)


def test_resumed_request_replaces_state_and_finished_frees_row():
    batch = InputBatch([FULL], max_model_len=32, max_num_rows=1)
    out = sched(1, new=[new_req("a", [1, 2, 3], ([1],))], num_sched={"a": 3})
    batch.apply_scheduler_output(out)
    batch.append_sampled_token("a", 50)
    # Preempted, then resumed with its outputs; 4 tokens known, 2 computed from the cache.
    out = sched(5, new=[new_req("a", [1, 2, 3], ([6, 8],), num_computed=2, outputs=[50, 51])],
                num_sched={"a": 3})
    batch.apply_scheduler_output(out)
    prepared = batch.prepare(out)
    np.testing.assert_array_equal(prepared.input_ids, [3, 50, 51])
    np.testing.assert_array_equal(prepared.slot_mappings[0], [26, 27, 32])
    assert prepared.sample_mask.tolist() == [True]
    assert batch.states["a"].output_token_ids == [50, 51]
    batch.apply_scheduler_output(sched(6, finished=["a"], num_sched={}))
    assert "a" not in batch and batch._free_rows == [0]


def test_rows_grow_beyond_initial_capacity():
    batch = InputBatch([FULL], max_model_len=16, max_num_rows=2)
    news = [new_req(str(i), [i + 1] * (i + 1), ([i + 1],)) for i in range(5)]
    out = sched(1, new=news, num_sched={str(i): i + 1 for i in range(5)})
    batch.apply_scheduler_output(out)
    prepared = batch.prepare(out)
    assert batch.num_rows >= 5
    np.testing.assert_array_equal(prepared.input_ids, [1, 2, 2, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 5])


def test_hybrid_groups_sliding_and_circular_slots():
    sliding = SlidingWindowSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype="float32",
                                sliding_window=4)
    ring = CircularBufferSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype="float32",
                              sliding_window=4)
    assert ring.blocks_per_request == 2
    batch = InputBatch([FULL, sliding, ring], max_model_len=32)
    out = sched(1, new=[new_req("a", list(range(10)), ([1, 2, 3], [4, 5, 6], [7, 8]))],
                num_sched={"a": 10})
    batch.apply_scheduler_output(out)
    prepared = batch.prepare(out)
    np.testing.assert_array_equal(prepared.slot_mappings[0][[0, 4, 9]], [4, 8, 13])
    np.testing.assert_array_equal(prepared.slot_mappings[1][[0, 4, 9]], [16, 20, 25])
    # Ring of two blocks: positions 8-9 wrap back onto block 7.
    np.testing.assert_array_equal(prepared.slot_mappings[2][[0, 4, 8, 9]], [28, 32, 28, 29])
    np.testing.assert_array_equal(prepared.block_tables[2], [[7, 8]])


def _general_prepare(batch, out, monkeypatch):
    """`prepare` through the general flattening path (the single-decode one switched off)."""
    with monkeypatch.context() as patch:
        patch.setattr(InputBatch, "_one_decode_request", staticmethod(lambda *args: None))
        return batch.prepare(out)


def assert_same_batch(fast, general):
    assert fast.req_ids == general.req_ids and fast.draft_token_ids == general.draft_token_ids
    for name in ("rows", "num_scheduled_tokens", "num_computed_tokens", "input_ids", "positions",
                 "query_start_loc", "seq_lens", "sample_mask", "logits_indices", "num_draft_tokens", "req_index"):
        a, b = getattr(fast, name), getattr(general, name)
        assert a.dtype == b.dtype, name
        np.testing.assert_array_equal(a, b, err_msg=name)
    for a, b in zip(fast.slot_mappings + fast.block_tables, general.slot_mappings + general.block_tables,
                    strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("seed", range(6))
def test_a_single_decode_step_is_the_general_batch(seed, monkeypatch):
    """One running request's one token (a single stream's decode step, built from plain ints)
    gives exactly the batch of the general path: every group kind, placeholders (the step
    scheduled ahead, not sampling), and a request in a row other than the first."""
    rng = np.random.default_rng(seed)
    sliding = SlidingWindowSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype="float32", sliding_window=4)
    ring = CircularBufferSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype="float32", sliding_window=4)
    batch = InputBatch([FULL, sliding, ring], max_model_len=64, max_num_rows=2)
    prompt = rng.integers(3, 1000, int(rng.integers(1, 9))).tolist()
    other = sched(1, new=[new_req("other", [5, 6], ([40], [41], [42, 43]))], num_sched={"other": 2})
    batch.apply_scheduler_output(other)
    blocks = ([1], [2], [3, 4])
    out = sched(2, new=[new_req("a", prompt, blocks)], num_sched={"a": len(prompt)}, finished=["other"])
    batch.apply_scheduler_output(out)
    batch.append_sampled_token("a", int(rng.integers(3, 1000)))
    num_computed, next_block = len(prompt), 10
    for step in range(3, 40):
        new_blocks = None
        if num_computed % BS == 0:  # a new block for full and sliding groups; the ring reuses its two
            new_blocks = ([next_block], [next_block + 1], [])
            next_block += 2
        out = sched(step, cached=[("a", new_blocks, num_computed)], num_sched={"a": 1})
        batch.apply_scheduler_output(out)
        fast = batch.prepare(out)
        assert_same_batch(fast, _general_prepare(batch, out, monkeypatch))
        assert fast.sample_mask[0]
        num_computed += 1
        if rng.random() < 0.3:  # scheduled ahead: the placeholder's step, before the token is known
            ahead = sched(step, cached=[("a", None, num_computed)], num_sched={"a": 1})
            with pytest.raises(InputPreparationError, match="knows only"):
                batch.prepare(ahead)
        batch.append_sampled_token("a", int(rng.integers(3, 1000)))


def test_the_single_decode_path_leaves_other_steps_to_the_general_one(monkeypatch):
    batch = InputBatch([FULL], max_model_len=32)
    out = sched(1, new=[new_req("a", [1, 2, 3], ([1],)), new_req("b", [4, 5], ([2],))], num_sched={"a": 3, "b": 2})
    batch.apply_scheduler_output(out)
    batch.append_sampled_token("a", 7)
    batch.append_sampled_token("b", 8)
    steps = [sched(2, cached=[("a", None, 3), ("b", None, 2)], num_sched={"a": 1, "b": 1}),  # two requests
             sched(2, cached=[("a", None, 2)], num_sched={"a": 2})]  # two tokens of one
    for out in steps:
        assert InputBatch._one_decode_request(out, frozenset(), None) is None
        assert_same_batch(batch.prepare(out), _general_prepare(batch, out, monkeypatch))
    one = sched(3, cached=[("a", None, 3)], num_sched={"a": 1})
    assert InputBatch._one_decode_request(one, frozenset(), None) == ("a", 3)
    assert InputBatch._one_decode_request(one, {"a"}, None) is None  # a failed step's request is skipped
    assert InputBatch._one_decode_request(one, frozenset(), {"a": [9]}) is None  # drafts filled in
