"""A dense model's KV-cache layout does not change with the split state pool (#29):
the configs below were computed by `get_kv_cache_config` before the state pool existed
(commit b024ec6) and are pinned here by the sha256 of their repr (every block count,
tensor size, sharing list and group spec), so any change to a dense layout fails."""
import hashlib

from kvserve.kv_cache.interface import FullAttentionSpec, SlidingWindowSpec
from kvserve.kv_cache.layout import StatePoolSizing, get_kv_cache_config

LLAMA = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=64, dtype="bfloat16")
GEMMA_FULL = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=256, dtype="bfloat16")
GEMMA_SWA = SlidingWindowSpec(block_size=16, num_kv_heads=4, head_size=256, dtype="bfloat16", sliding_window=512)
DRAFT = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype="float32")

EXPECTED_ONE_GROUP = "108840c5fe72f3eb3de9bd6205e1cf4b054feaccf64c57cf904e80705b0dd0ce"
EXPECTED_THREE_GROUPS = "04613ac5ba04ee50e1121ae33e6390784e4f2f3e416c287d9ba0c363c02f5676"


def _digest(config) -> str:
    layout = (config.num_blocks, config.kv_cache_tensors, config.kv_cache_groups)
    return hashlib.sha256(repr(layout).encode()).hexdigest()


def test_a_one_group_dense_layout_is_unchanged():
    specs = {f"model.layers.{i}.self_attn": LLAMA for i in range(16)}
    config = get_kv_cache_config(specs, 2 * 2**30)
    assert config.num_blocks == 4096
    assert config.num_state_blocks == 0
    assert _digest(config) == EXPECTED_ONE_GROUP


def test_a_sliding_window_hybrid_with_a_draft_is_unchanged():
    specs = {f"model.layers.{i}.self_attn": (GEMMA_FULL if i % 6 == 5 else GEMMA_SWA) for i in range(26)}
    specs.update({f"draft.model.layers.{i}.self_attn": DRAFT for i in range(2)})
    # The engine passes its scheduler's sizing for a state pool; a dense model has none.
    config = get_kv_cache_config(specs, 3 * 10**9, state_pool_sizing=StatePoolSizing(max_num_seqs=3))
    assert config.num_blocks == 2034
    assert config.num_state_blocks == 0
    assert _digest(config) == EXPECTED_THREE_GROUPS

