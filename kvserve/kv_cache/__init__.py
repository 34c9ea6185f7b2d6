"""The paged KV cache: pure Python, no torch.

Data flow: `layout.get_kv_cache_config` turns per-layer specs (`interface`)
and a memory budget into a `KVCacheConfig`. `manager.KVCacheManager` is what
the scheduler calls: it asks the `coordinator` for the longest prefix hit of a
request (its `block_hashes`, made by `utils.get_request_block_hasher`), then
allocates through one `single_type_manager` per KV-cache group, all drawing
from one `block_pool.BlockPool` (a hybrid's state groups from its `state_pool`),
whose free queue order is the eviction order.
Block ids and CoW copies (`utils.KVCacheBlockCopy`) leave through
`SchedulerOutput`; blocks come back through `free` or `pop_blocks_for_free`.
"""
