"""The state groups' own pool (#29): the layout arithmetic on real hybrid shapes, the pool's
routing of frees, resets and events across its two id spaces, and the views of it.

Real shapes, as kvserve's layers declare them (`GatedDeltaNet.state_shapes`,
`Mamba2Shape.state_shapes`: a conv state [K - 1, conv_dim] and a recurrent state, float32):
- Qwen3-Next-80B-A3B: 48 layers, full attention every 4th (12 layers: 2 KV heads of 256,
  bfloat16); 36 Gated DeltaNet layers with 16 key heads and 32 value heads of 128, conv
  kernel 4: conv_dim = 2 * 16 * 128 + 32 * 128 = 8192, state (32, 128, 128).
- Granite-4.0-H-Small: 40 layers, 4 attention (8 KV heads of 128, bfloat16) and 36 Mamba-2
  layers with 128 heads of 64, state size 128, 1 group, conv kernel 4: conv_dim =
  128 * 64 + 2 * 128 = 8448, state (128, 64, 128).
"""
from __future__ import annotations

import logging

import pytest

from kvserve.kv_cache.events import KVEventRecorder
from kvserve.kv_cache.interface import FullAttentionSpec, StateSpec
from kvserve.kv_cache.layout import (MAX_STATE_SHARE, StatePoolSizing, budget_split, get_kv_cache_config,
                                     kv_bytes_wanted, num_state_blocks_needed)
from kvserve.kv_cache.snapshot import snapshot_kv_cache

from kv_helpers import admit, check, complete_step, full_spec, make_manager, sliding_spec, state_spec

GIB = 2**30
BLOCK = 16


def _qwen3_next_layers() -> dict:
    attention = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=256, dtype="bfloat16")
    state = StateSpec(block_size=BLOCK, shapes=((3, 8192), (32, 128, 128)), dtype="float32")
    return {f"model.layers.{i}.{'self_attn' if i % 4 == 3 else 'linear_attn'}": attention if i % 4 == 3 else state
            for i in range(48)}


def _granite_4_h_small_layers() -> dict:
    attention = FullAttentionSpec(block_size=BLOCK, num_kv_heads=8, head_size=128, dtype="bfloat16")
    state = StateSpec(block_size=BLOCK, shapes=((3, 8448), (128, 64, 128)), dtype="float32")
    return {f"model.layers.{i}.{'self_attn' if i % 10 == 5 else 'mamba'}": attention if i % 10 == 5 else state
            for i in range(40)}


MODELS = {"qwen3-next-80b-a3b": _qwen3_next_layers, "granite-4.0-h-small": _granite_4_h_small_layers}


def _split(layers: dict) -> tuple[dict, int, int]:
    """(the attention layers alone, bytes of one attention block id, of one state slot)."""
    attention = {name: spec for name, spec in layers.items() if not isinstance(spec, StateSpec)}
    state_slot = sum(spec.page_size_bytes for spec in layers.values() if isinstance(spec, StateSpec))
    return attention, sum(spec.page_size_bytes for spec in attention.values()), state_slot


@pytest.mark.parametrize("model", MODELS)
def test_real_shapes_hold_nearly_as_many_attention_tokens_as_attention_alone(model):
    """64 GiB, 8 running requests, no prefix caching: the state pool holds 3 slots per running
    request (its running state and the two steps in flight) and the null block; the attention
    blocks take the rest, so the attention tokens are those of the same attention layers alone
    less the state share (2.9% for Qwen3-Next, 5.6% for Granite). One shared pool held ~1/196
    (Qwen3-Next) and ~1/558 (Granite) of them."""
    layers = MODELS[model]()
    attention_layers, attention_block_bytes, slot_bytes = _split(layers)
    budget = 64 * GIB
    sizing = StatePoolSizing(max_num_seqs=8, max_num_batched_tokens=2048, enable_caching=False)
    config = get_kv_cache_config(layers, budget, state_pool_sizing=sizing)
    attention_alone = get_kv_cache_config(attention_layers, budget)

    assert config.num_state_blocks == 3 * 8 + 1
    state_bytes = config.num_state_blocks * slot_bytes
    assert config.num_blocks == (budget - state_bytes) // attention_block_bytes
    state_share = state_bytes / budget
    assert state_share < 0.06
    # Whole blocks only: at most one block below the exact share.
    assert config.num_blocks >= (1 - state_share) * attention_alone.num_blocks - 1
    one_pool_blocks = budget // (attention_block_bytes + slot_bytes)
    assert config.num_blocks > 150 * one_pool_blocks
    assert sum(t.size for t in config.kv_cache_tensors) <= budget


@pytest.mark.parametrize("model", MODELS)
def test_with_prefix_caching_the_state_pool_is_what_the_running_requests_and_snapshots_need(model):
    """8 running requests, 512 tokens a step, caching on: in use at once at most 3 * 8 + 2 * 512 / 16
    = 88 slots (running states and the snapshots of two steps in flight), as many again kept
    for prefix hits, and the null block: 177 slots, never more, whatever the budget."""
    layers = MODELS[model]()
    _, attention_block_bytes, slot_bytes = _split(layers)
    sizing = StatePoolSizing(max_num_seqs=8, max_num_batched_tokens=512, enable_caching=True)
    assert num_state_blocks_needed(BLOCK, sizing) == 2 * (3 * 8 + 2 * 512 // BLOCK) + 1 == 177
    for budget in (400 * GIB, 4096 * GIB):
        config = get_kv_cache_config(layers, budget, state_pool_sizing=sizing)
        assert config.num_state_blocks == 177
        assert config.num_blocks == (budget - 177 * slot_bytes) // attention_block_bytes


@pytest.mark.parametrize("model", MODELS)
def test_the_state_share_is_capped_at_half_the_budget(model, caplog):
    """The default sizing (64 running requests, 2048 tokens a step, caching) would need 897 slots
    of 75 or 147 MiB; in 64 GiB the state pool gets half the budget, with a warning."""
    layers = MODELS[model]()
    _, attention_block_bytes, slot_bytes = _split(layers)
    budget = 64 * GIB
    with caplog.at_level(logging.WARNING, logger="kvserve.kv_cache.layout"):
        config = get_kv_cache_config(layers, budget)
    assert num_state_blocks_needed(BLOCK, StatePoolSizing()) == 897
    assert config.num_state_blocks == int(budget * MAX_STATE_SHARE) // slot_bytes
    assert config.num_blocks == (budget - config.num_state_blocks * slot_bytes) // attention_block_bytes
    assert "state slots" in caplog.text
    attention, state = budget_split(config)
    assert (attention.kind, state.kind) == ("attention", "state")
    assert state.num_bytes == config.num_state_blocks * slot_bytes <= budget * MAX_STATE_SHARE
    assert attention.num_bytes == config.num_blocks * attention_block_bytes
    assert attention.num_bytes + state.num_bytes <= budget


def test_a_state_only_model_and_explicit_counts():
    state = StateSpec(block_size=4, shapes=((2,), (3, 2)), dtype="float32")  # 32 B a slot
    only_state = get_kv_cache_config({"s": state}, available_memory_bytes=32 * 10)
    assert (only_state.num_blocks, only_state.num_state_blocks) == (10, 0)
    assert [(share.kind, share.num_blocks) for share in budget_split(only_state)] == [("all", 10)]
    hybrid = get_kv_cache_config({"a": full_spec(4), "s": state}, available_memory_bytes=0, num_blocks=6,
                                 num_state_blocks=5)
    assert (hybrid.num_blocks, hybrid.num_state_blocks) == (6, 5)
    assert [(t.size, t.shared_by) for t in hybrid.kv_cache_tensors] == [(6 * 32, ["a"]), (5 * 32, ["s"])]
    with pytest.raises(ValueError, match="state pool"):
        get_kv_cache_config({"a": full_spec(4), "s": state}, 0, num_blocks=6, num_state_blocks=1)


# ---------------------------------------------------------------- the pool's two id spaces

def _split_manager(**kwargs):
    return make_manager([full_spec(4), sliding_spec(4, window=8), state_spec(4)], num_blocks=12,
                        num_state_blocks=6, hash_block_size=4, **kwargs)


def test_state_slots_come_from_their_own_pool_and_frees_find_their_pool():
    manager = _split_manager()
    pool, state_pool = manager.block_pool, manager.block_pool.state_pool
    request = manager.new_request("r", list(range(10)))
    admit(manager, request)
    full, sliding, state = manager.get_blocks("r").blocks
    assert all(pool.owns(b) for b in full + sliding)
    assert all(state_pool.owns(b) and not pool.owns(b) for b in state if not b.is_null)
    # Ids overlap: the first state slot has the id of the first attention block.
    assert state[0].block_id == full[0].block_id == 1
    assert pool.get_num_free_blocks() == 11 - 6 and state_pool.get_num_free_blocks() == 5 - 3
    check(manager)
    # A deferred free of the mixed list (the seed's path) returns each block to its pool.
    blocks = manager.pop_blocks_for_free(request)
    pool.free_blocks(blocks)
    assert pool.get_num_free_blocks() == 11 and state_pool.get_num_free_blocks() == 5
    check(manager)


def test_a_short_state_pool_refuses_the_allocation_and_changes_nothing_else():
    """3 usable state slots: a 10-token prompt takes all 3 (snapshots at 4 and 8, the running
    state); a second prompt is refused though the attention pool has room."""
    manager = make_manager([full_spec(4), state_spec(4)], num_blocks=20, num_state_blocks=4, hash_block_size=4)
    first = manager.new_request("a", list(range(10)))
    admit(manager, first)
    assert manager.block_pool.state_pool.get_num_free_blocks() == 0
    free_attention = manager.block_pool.get_num_free_blocks()
    second = manager.new_request("b", list(range(50, 60)))
    assert manager.allocate_slots(second, 10) is None
    assert manager.block_pool.get_num_free_blocks() == free_attention
    assert manager.usage == 1.0  # the state pool is full
    check(manager)


def test_hits_on_states_from_the_state_pool_and_reset_covers_both_pools():
    manager = _split_manager()
    recorder = manager.block_pool.kv_events = KVEventRecorder()
    assert manager.block_pool.state_pool.kv_events is recorder
    prompt = list(range(13))
    first = manager.new_request("a", prompt)
    admit(manager, first)
    complete_step(first, 13, output_token=99)
    manager.free(first)
    assert manager.block_pool.state_pool.cached_block_hash_to_block  # snapshots at 4, 8, 12
    # The state pool's snapshots are published as the state group's (2) stored blocks.
    stored = [event for event in recorder.take() if type(event).__name__ == "BlockStoredEvent"]
    assert sum(len(event.block_hashes) for event in stored if event.group_id == 2) == 3
    second = manager.new_request("b", prompt + [7])
    num_hit, _ = admit(manager, second)
    assert num_hit == 12
    state_table = manager.get_blocks("b").blocks[2]
    assert manager.block_pool.state_pool.owns(state_table[2]) and state_table[2].block_hash is not None
    manager.free(second)
    recorder.take()
    assert manager.reset_prefix_cache()
    assert not manager.block_pool.cached_block_hash_to_block
    assert not manager.block_pool.state_pool.cached_block_hash_to_block
    assert [type(event).__name__ for event in recorder.take()] == ["AllBlocksClearedEvent"]
    check(manager)


def test_the_snapshot_shows_each_group_its_own_pool():
    manager = _split_manager()
    request = manager.new_request("r", list(range(10)))
    admit(manager, request)
    snapshot = snapshot_kv_cache(manager)
    full, sliding, state = snapshot.groups
    assert snapshot.pool == full.pool == sliding.pool
    assert snapshot.state_pool == state.pool
    assert (state.pool.num_blocks, state.pool.blocks_in_use) == (5, 3)
    assert (snapshot.pool.num_blocks, snapshot.pool.blocks_in_use) == (11, 6)
    one_pool = snapshot_kv_cache(make_manager([full_spec(4), state_spec(4)], num_blocks=12))
    assert one_pool.state_pool is None


def test_what_sequences_want_counts_attention_per_token_and_states_per_slot():
    """The CPU default budget's want (`ModelRunner.available_kv_memory_bytes`): 4 sequences of
    10 tokens want 3 blocks of 4 each in the attention layer (4 * 3 * 64 B) and, in each of two
    state layers, the 3 * 4 + 2 * (64 // 4) = 44 slots in use twice over plus the null block
    (89 slots of 32 B); a dense model wants only its pages."""
    sizing = StatePoolSizing(max_num_seqs=4, max_num_batched_tokens=64, enable_caching=True)
    attention = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=2, dtype="float32")  # 64 B a block
    state = StateSpec(block_size=4, shapes=((2,), (3, 2)), dtype="float32")  # 32 B a slot
    assert kv_bytes_wanted({"a": attention}, 10, sizing) == 4 * 3 * 64
    assert kv_bytes_wanted({"a": attention, "s0": state, "s1": state}, 10, sizing) == 4 * 3 * 64 + 2 * 89 * 32


def test_the_cap_yields_to_one_request_of_max_model_len_when_the_budget_holds_it():
    """Blocks of 16, a 1 KiB attention page and a 4 KiB state slot; 64 requests, 2048-token steps,
    caching, max_model_len 8192. One request alone needs min(8192 / 16, 2 * 2048 / 16 + 2) = 258
    state slots (the scheduler's admission bound) and 512 attention blocks, each pool's null block
    besides. In 2 MiB half the budget holds 256 slots; the pool gets 259 instead, and the longest
    request stays 8192 tokens. In 1.5 MiB the two do not fit together: the cap (192) stays."""
    from kvserve.scheduler.admission import max_tokens_in_pool
    attention = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype="float32")
    state = StateSpec(block_size=16, shapes=((1024,),), dtype="float32")
    layers = {"a": attention, "s": state}
    sizing = StatePoolSizing(max_num_seqs=64, max_num_batched_tokens=2048, enable_caching=True, max_model_len=8192)
    config = get_kv_cache_config(layers, 2 * 2**20, state_pool_sizing=sizing)
    assert config.num_state_blocks == 259
    assert config.num_blocks == (2 * 2**20 - 259 * 4096) // 1024
    assert max_tokens_in_pool(config, 8192, 2048) == 8192
    capped = get_kv_cache_config(layers, 3 * 2**19, state_pool_sizing=sizing)
    assert capped.num_state_blocks == (3 * 2**19 // 2) // 4096 == 192
    assert max_tokens_in_pool(capped, 8192, 2048) < 8192
