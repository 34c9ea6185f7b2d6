"""BlockPool and FreeKVCacheBlockQueue: exact ids, exact order."""
import pytest

from kvserve.kv_cache.block_pool import BlockPool
from kvserve.kv_cache.utils import (
    BlockHashWithGroupId,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    make_block_hash_with_group_id,
)


def _ids(blocks):
    return [block.block_id for block in blocks]


def _queue_ids(pool):
    return _ids(pool.free_block_queue.get_all_free_blocks())


class _HashedRequest:
    """The one attribute `cache_full_blocks` reads."""

    def __init__(self, num_units: int, tag: str = "r"):
        self.block_hashes = [f"{tag}{i}".encode() for i in range(num_units)]


def test_free_queue_order_and_middle_removal():
    blocks = [KVCacheBlock(i) for i in range(6)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert queue.num_free_blocks == 6
    assert queue.popleft() is blocks[0]
    queue.remove(blocks[3])
    assert _ids(queue.get_all_free_blocks()) == [1, 2, 4, 5]
    assert _ids(queue.popleft_n(2)) == [1, 2]
    queue.append_n([blocks[0], blocks[3]])
    queue.prepend_n([blocks[2], blocks[1]])
    assert _ids(queue.get_all_free_blocks()) == [2, 1, 4, 5, 0, 3]
    assert queue.num_free_blocks == 6
    with pytest.raises(ValueError):
        queue.popleft_n(7)
    assert queue.num_free_blocks == 6
    with pytest.raises(RuntimeError):
        queue.remove(KVCacheBlock(99))


def test_fresh_pool_has_null_block_and_hands_out_ids_in_order():
    pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=4)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.get_num_free_blocks() == 7
    assert _ids(pool.get_new_blocks(3)) == [1, 2, 3]
    assert [b.ref_cnt for b in pool.blocks[1:4]] == [1, 1, 1]
    with pytest.raises(ValueError):
        pool.get_new_blocks(5)
    assert pool.get_num_free_blocks() == 4
    assert pool.get_usage() == pytest.approx(3 / 7)
    pool.check_invariants({1: 1, 2: 1, 3: 1})


def test_free_puts_unhashed_at_head_and_hashed_at_tail_in_given_order():
    pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=4)
    blocks = pool.get_new_blocks(6)
    request = _HashedRequest(num_units=3)
    # Blocks 1..3 are full, cached blocks of one request; 4..6 are unhashed.
    pool.cache_full_blocks(request, blocks[:3], 0, 3, block_size=4, kv_cache_group_id=0)
    pool.free_blocks([blocks[2], blocks[5], blocks[1], blocks[4]])
    # unhashed run [6, 5] before the never-used block 7; hashed run [3, 2] at the tail
    assert _queue_ids(pool) == [6, 5, 7, 3, 2]
    pool.free_blocks([blocks[0], blocks[3]])
    assert _queue_ids(pool) == [4, 6, 5, 7, 3, 2, 1]
    pool.check_invariants()
    # the null block is ignored by free and touch
    pool.free_blocks([pool.null_block])
    pool.touch([pool.null_block])
    assert pool.get_num_free_blocks() == 7
    pool.check_invariants()


def test_touch_revives_a_cached_free_block_and_handout_evicts():
    pool = BlockPool(num_gpu_blocks=6, enable_caching=True, hash_block_size=4)
    blocks = pool.get_new_blocks(2)
    request = _HashedRequest(num_units=2)
    pool.cache_full_blocks(request, blocks, 0, 2, block_size=4, kv_cache_group_id=0)
    pool.free_blocks(reversed(blocks))
    assert _queue_ids(pool) == [3, 4, 5, 2, 1]
    hit = pool.get_cached_block(request.block_hashes[0], [0])
    assert _ids(hit) == [1]
    pool.touch(hit)
    assert pool.get_num_free_blocks() == 4 and blocks[0].ref_cnt == 1
    pool.check_invariants({1: 1})
    # Handing out block 2 (after 3, 4, 5) evicts its key.
    assert _ids(pool.get_new_blocks(4)) == [3, 4, 5, 2]
    assert pool.get_cached_block(request.block_hashes[1], [0]) is None
    assert blocks[1].block_hash is None and pool.num_evictions == 1
    assert pool.get_cached_block(request.block_hashes[0], [0]) == [blocks[0]]
    pool.check_invariants({1: 1, 2: 1, 3: 1, 4: 1, 5: 1})


def test_same_content_in_two_blocks_and_two_groups():
    pool = BlockPool(num_gpu_blocks=6, enable_caching=True, hash_block_size=4)
    a, b, c = pool.get_new_blocks(3)
    request = _HashedRequest(num_units=1)
    pool.cache_full_blocks(request, [a], 0, 1, 4, kv_cache_group_id=0)
    pool.cache_full_blocks(request, [b], 0, 1, 4, kv_cache_group_id=0)
    pool.cache_full_blocks(request, [c], 0, 1, 4, kv_cache_group_id=1)
    assert a.block_hash == b.block_hash != c.block_hash
    assert pool.get_cached_block(request.block_hashes[0], [0, 1])[1] is c
    pool.free_blocks([a, b, c])
    pool.get_new_blocks(2)  # 4, 5
    assert _ids(pool.get_new_blocks(1)) == [1]  # evicts a, b still holds the key
    assert pool.get_cached_block(request.block_hashes[0], [0]) == [b]
    pool.check_invariants({1: 1, 4: 1, 5: 1})


def test_interior_keys_when_hash_unit_is_smaller_than_the_block():
    pool = BlockPool(num_gpu_blocks=4, enable_caching=True, hash_block_size=2)
    (block,) = pool.get_new_blocks(1)
    request = _HashedRequest(num_units=2)
    pool.cache_partial_block(request, block, num_tokens=2, kv_cache_group_id=0, block_size=4)
    assert block.block_hash_num_tokens == 2
    pool.cache_full_blocks(request, [block], 0, 1, block_size=4, kv_cache_group_id=0)
    assert block.block_hash == make_block_hash_with_group_id(request.block_hashes[1], 0)
    assert block.block_hash_num_tokens == 4
    # Both boundaries map to the block.
    assert pool.get_cached_block(request.block_hashes[0], [0]) == [block]
    pool.check_invariants({1: 1})
    pool.free_blocks([block])
    pool.get_new_blocks(3)
    assert pool.cached_block_hash_to_block == {}
    pool.check_invariants({1: 1, 2: 1, 3: 1})


def test_reset_prefix_cache_refused_while_held():
    pool = BlockPool(num_gpu_blocks=4, enable_caching=True, hash_block_size=4)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(_HashedRequest(2), blocks, 0, 2, 4, 0)
    assert pool.reset_prefix_cache() is False
    assert blocks[0].block_hash is not None and len(pool.cached_block_hash_to_block) == 2
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.cached_block_hash_to_block == {}
    assert all(block.block_hash is None for block in pool.blocks)
    pool.check_invariants()


def test_caching_disabled_frees_everything_to_the_head():
    pool = BlockPool(num_gpu_blocks=5, enable_caching=False, hash_block_size=4)
    blocks = pool.get_new_blocks(3)
    pool.free_blocks(reversed(blocks))
    assert _queue_ids(pool) == [3, 2, 1, 4]
    pool.check_invariants()


def test_check_invariants_detects_corruption():
    pool = BlockPool(num_gpu_blocks=5, enable_caching=True, hash_block_size=4)
    blocks = pool.get_new_blocks(2)
    with pytest.raises(AssertionError, match="holders"):
        pool.check_invariants({1: 2, 2: 1})
    blocks[0].ref_cnt = 0  # held nowhere, yet not in the free queue
    with pytest.raises(AssertionError, match="free queue"):
        pool.check_invariants()
    blocks[0].ref_cnt = 1
    blocks[1].set_block_hash(BlockHashWithGroupId(b"unregistered"), num_tokens=4)
    with pytest.raises(AssertionError, match="map"):
        pool.check_invariants()
