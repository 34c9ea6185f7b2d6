"""get_kv_cache_config: grouping by spec, tensor sharing across groups, block count from the budget."""
import pytest

from kvserve.kv_cache.interface import FullAttentionSpec, SlidingWindowSpec
from kvserve.kv_cache.layout import num_pages
from kvserve.kv_cache.utils import get_kv_cache_config, get_scheduler_block_size, kv_cache_group_block_sizes

FULL = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype="float32")  # 2*16*2*8*4 = 2048 B
SWA = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=8, dtype="float32", sliding_window=64)
SMALL = FullAttentionSpec(block_size=32, num_kv_heads=1, head_size=8, dtype="bfloat16")  # 2*32*1*8*2 = 1024 B


def _check_tensors_fit(config, layer_specs):
    for tensor in config.kv_cache_tensors:
        for name in tensor.shared_by:
            assert layer_specs[name].page_size_bytes * num_pages(config, layer_specs[name]) <= tensor.size


def test_one_group_gets_one_tensor_per_layer():
    layer_specs = {"l0": FULL, "l1": FULL, "l2": FULL}
    config = get_kv_cache_config(layer_specs, available_memory_bytes=3 * 2048 * 10 + 5)
    assert config.num_blocks == 10
    assert [(g.layer_names, g.kv_cache_spec) for g in config.kv_cache_groups] == [(["l0", "l1", "l2"], FULL)]
    assert [(t.size, t.shared_by) for t in config.kv_cache_tensors] == [
        (20480, ["l0"]), (20480, ["l1"]), (20480, ["l2"])]
    _check_tensors_fit(config, layer_specs)


def test_hybrid_groups_share_tensors_by_layer_index():
    layer_specs = {"a": FULL, "b": SWA, "c": FULL, "d": SWA, "e": SWA}
    config = get_kv_cache_config(layer_specs, available_memory_bytes=10**6)
    assert [g.layer_names for g in config.kv_cache_groups] == [["a", "c"], ["b", "d", "e"]]
    assert [t.shared_by for t in config.kv_cache_tensors] == [["a", "b"], ["c", "d"], ["e"]]
    # One block id costs one page in each of the 3 tensor slots.
    assert config.num_blocks == 10**6 // (3 * 2048)
    _check_tensors_fit(config, layer_specs)


def test_unequal_page_sizes_use_the_largest_per_slot():
    layer_specs = {"a": FULL, "b": SMALL, "c": SMALL}
    config = get_kv_cache_config(layer_specs, available_memory_bytes=0, num_blocks=7)
    assert config.num_blocks == 7
    assert [(t.size, t.shared_by) for t in config.kv_cache_tensors] == [(2048 * 7, ["a", "b"]), (1024 * 7, ["c"])]
    assert kv_cache_group_block_sizes(config) == [16, 32]
    assert get_scheduler_block_size(config) == 32
    _check_tensors_fit(config, layer_specs)


def test_budget_too_small_is_an_error():
    with pytest.raises(ValueError, match="at least 2"):
        get_kv_cache_config({"a": FULL}, available_memory_bytes=2048)
    with pytest.raises(ValueError):
        get_kv_cache_config({}, available_memory_bytes=10**6)


def test_state_layers_share_no_tensor_with_attention_layers():
    """An attention tensor holds block b's K/V as rows scattered over the whole buffer (heads
    outermost), a state tensor slot c whole at c * its page: shared, the two would overlap
    (a regression: Granite's hybrid lost its states to the attention layer's K/V). Each state
    layer gets its own tensor, and a block id costs its pages in both."""
    from kvserve.kv_cache.interface import StateSpec
    state = StateSpec(block_size=16, shapes=((3, 8), (2, 4, 4)), dtype="float32")  # (24 + 32) * 4 = 224 B
    layer_specs = {"s0": state, "a": FULL, "s1": state, "b": SWA}
    config = get_kv_cache_config(layer_specs, available_memory_bytes=10**6)
    shared = [set(t.shared_by) for t in config.kv_cache_tensors]
    assert {"s0"} in shared and {"s1"} in shared and {"a", "b"} in shared and len(shared) == 3
    # Default sizing (64 running requests, 2048 tokens a step, caching on, block 16): twice
    # 3 * 64 + 2 * (2048 // 16) = 448 slots in use at once, plus the null block.
    assert config.num_state_blocks == 2 * 448 + 1
    assert config.num_blocks == (10**6 - 897 * 2 * 224) // 2048
    assert [t.size for t in config.kv_cache_tensors if t.shared_by == ["s0"]] == [897 * 224]
    _check_tensors_fit(config, layer_specs)


def test_attention_layers_share_a_tensor_only_with_rows_of_one_size():
    """A draft of another head size beside its target: its K/V rows of a block differ in
    size, so block 2 of one would overlap blocks 1 and 5 of the other in a shared buffer
    (heads outermost). Its layers get tensors of their own; equal rows still share."""
    target = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype="float32")
    draft = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=32, dtype="float32")
    same_rows = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype="float32")
    layer_specs = {"model.layers.0.a": target, "draft.model.layers.0.a": draft, "other.model.layers.0.a": same_rows}
    config = get_kv_cache_config(layer_specs, available_memory_bytes=0, num_blocks=8)
    shared = [set(t.shared_by) for t in config.kv_cache_tensors]
    assert shared == [{"model.layers.0.a", "other.model.layers.0.a"}, {"draft.model.layers.0.a"}]
    _check_tensors_fit(config, layer_specs)
