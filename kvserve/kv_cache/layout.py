"""Turn a model's per-layer KV specs and a memory budget into a `KVCacheConfig`.

Layout (vLLM-like): layers of one model with equal specs form one group (one
block table per request); a second model's layers (a speculative draft, whose
layer names carry a prefix such as `draft.`) get groups of their own.
The attention groups draw block ids from one pool and a block id belongs to one
group at a time, so layer j of every attention group can share one backing
tensor: `KVCacheTensor` j is `shared_by` the j-th layer of each group and
holds `num_blocks` pages of the largest page size among them. Block id b is
page b of every layer tensor of the group that holds it. The cost of one
block id is therefore the sum over tensor slots of their page size, and
`num_blocks = budget // that`. With one group this is one tensor per layer.

Recurrent-state layers (`StateSpec`) share no tensor with attention layers: an
attention tensor holds a block's K/V as scattered rows (heads outermost, see
`kvserve.model.attention.metadata`), a state tensor its slots one after another, so
block b of one and slot c of the other would overlap. Each state layer has its own
tensor. For the same reason attention layers share a tensor only when their K/V rows of one block
(block_size x head_size elements) have the same size: block b's rows then sit at
row indices k * num_blocks + b, disjoint for distinct ids whatever the head counts
(a draft of another head size next to its target gets tensors of its own).

A split pool for states (#29; chosen over vLLM's one pool of equal pages). When a
model has both attention and state layers, the state groups draw block ids from a
pool of their own (`KVCacheConfig.num_state_blocks`: its own ids, free queue and LRU
order; a state slot id is a block id of that pool), the attention groups from the
main pool (`num_blocks`). An attention block id then costs only attention pages and
a state block id only state pages. With one pool an id cost both (a state page per
state layer reserved under every K/V block, and the reverse): for Qwen3-Next's
shapes (36 Gated DeltaNet layers of ~2 MB of float32 state, 12 attention layers of
32 KB of bfloat16 K/V per 16-token block) an id cost ~200x its K/V, so a budget held
~200x fewer attention tokens than a dense model with those 12 layers.
vLLM instead gives every page the same size (it raises the attention block size
until an attention page holds a state, then pads the state page) and lets layer j
of every group share one tensor. That needs block-major K/V pages; kvserve's K/V
tensors are heads-outermost, so a block's K/V is rows scattered over the buffer and
cannot overlap a contiguous state slot, and vLLM's coarse pages would also snapshot
states only every few hundred tokens (kvserve keeps one per attention block).

The state pool is sized for what the scheduler can have in use at once
(`num_state_blocks_needed`, derivation there): each running request's running state
and the snapshots its steps in flight write, plus, with prefix caching, as many
again for snapshots kept in the cache. The rest of the budget goes to attention
blocks. The state share is capped at `MAX_STATE_SHARE` of the budget (unless one
request of max_model_len needs more and the budget holds it): a state pool short
of that bound only makes requests wait for slots (the scheduler preempts or holds
them back), never computes wrong (a very short pool also caps the longest request,
`scheduler.admission`). A state-only model keeps one pool.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from math import gcd, lcm

from kvserve.kv_cache.interface import (AttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheSpec, KVCacheTensor,
                                        StateSpec, cdiv, dtype_size_bytes)

logger = logging.getLogger(__name__)

# The most of the budget the state pool takes when the running requests would need more.
MAX_STATE_SHARE = 0.5


@dataclass(frozen=True)
class StatePoolSizing:
    """What bounds the state slots in use at once: `max_num_seqs` running requests,
    `max_num_batched_tokens` per step, and whether prefix caching keeps snapshots.
    The defaults are `SchedulerConfig`'s and `CacheConfig`'s."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_caching: bool = True
    max_model_len: int | None = None  # when known: the cap on the state share yields to one such request


def num_state_blocks_needed(block_size: int, sizing: StatePoolSizing) -> int:
    """The state pool's size, null block included, for one state group of `block_size`.

    In use at once (`StateManager`): a request whose processed tokens are p and whose
    steps in flight (at most two: the one being processed and the one being
    scheduled) hold q1 and q2 more keeps table entries cdiv(p, B) - 1 .. cdiv(p + q1 +
    q2, B) - 1, that is at most 1 + cdiv(q1, B) + cdiv(q2, B) <= 3 + q1 // B + q2 // B
    blocks. Over R = max_num_seqs running requests, with each step scheduling at most
    T = max_num_batched_tokens tokens: 3 * R + 2 * (T // B). Without prefix caching the
    entries between are null: at most 3 per request. With caching, as many slots again
    keep the latest released snapshots for prefix hits.
    """
    num_running = sizing.max_num_seqs
    if not sizing.enable_caching:
        return 3 * num_running + 1
    in_flight = 3 * num_running + 2 * (sizing.max_num_batched_tokens // block_size)
    return 2 * in_flight + 1


def kv_bytes_wanted(layer_specs: dict[str, KVCacheSpec], num_tokens: int, sizing: StatePoolSizing) -> int:
    """What `sizing.max_num_seqs` sequences of `num_tokens` tokens want: the attention layers'
    pages for every token, and the state slots `num_state_blocks_needed` counts (a state
    layer's page is per slot, not per token)."""
    attention_bytes, state_bytes = 0, 0
    for spec in layer_specs.values():
        if isinstance(spec, StateSpec):
            state_bytes += spec.page_size_bytes * num_state_blocks_needed(spec.block_size, sizing)
        else:
            attention_bytes += -(-num_tokens // spec.block_size) * spec.page_size_bytes
    return sizing.max_num_seqs * attention_bytes + state_bytes


def group_layers_by_spec(layer_specs: dict[str, KVCacheSpec]) -> list[KVCacheGroupSpec]:
    """One group per distinct (model, spec), in order of first appearance."""
    layers_by_key: dict[tuple[str, KVCacheSpec], list[str]] = {}
    for layer_name, spec in layer_specs.items():
        layers_by_key.setdefault((_model_prefix(layer_name), spec), []).append(layer_name)
    return [KVCacheGroupSpec(layer_names, spec) for (_, spec), layer_names in layers_by_key.items()]


def _model_prefix(layer_name: str) -> str:
    """What names the model a layer belongs to: the text before `layers.`."""
    prefix, found, _ = layer_name.partition("layers.")
    return prefix if found else ""


def _attention_sharing_sets(groups: list[KVCacheGroupSpec]) -> list[list[KVCacheGroupSpec]]:
    """The attention groups whose layers may share tensors (equal K/V row bytes; see the
    module docstring), in order of first appearance."""
    sets: dict[int, list[KVCacheGroupSpec]] = {}
    for group in groups:
        spec = group.kv_cache_spec
        if isinstance(spec, AttentionSpec):
            sets.setdefault(spec.block_size * spec.head_size * dtype_size_bytes(spec.dtype), []).append(group)
        elif not isinstance(spec, StateSpec):
            raise TypeError(f"no KV-cache layout for {type(spec).__name__}")
    return list(sets.values())


def _tensor_slot_page_sizes(groups: list[KVCacheGroupSpec]) -> list[int]:
    if not groups:
        return []
    num_slots = max(len(group.layer_names) for group in groups)
    return [max(group.kv_cache_spec.page_size_bytes for group in groups if len(group.layer_names) > slot)
            for slot in range(num_slots)]


def get_kv_cache_config(layer_specs: dict[str, KVCacheSpec], available_memory_bytes: int,
                        num_blocks: int | None = None, num_state_blocks: int | None = None,
                        state_pool_sizing: StatePoolSizing | None = None) -> KVCacheConfig:
    """The cache layout for `layer_specs` within `available_memory_bytes` (or with
    exactly `num_blocks` attention blocks and `num_state_blocks` state blocks when
    given). A model with both attention and state layers gets a state pool sized by
    `state_pool_sizing` (module docstring). Raises ValueError when fewer than two
    blocks fit in a pool (block 0 is the null block)."""
    if not layer_specs:
        raise ValueError("no KV-cache layers")
    groups = group_layers_by_spec(layer_specs)
    sharing_sets = _attention_sharing_sets(groups)
    slot_page_sizes = [_tensor_slot_page_sizes(sharing) for sharing in sharing_sets]
    state_layers = [(name, group.kv_cache_spec.page_size_bytes) for group in groups
                    if isinstance(group.kv_cache_spec, StateSpec) for name in group.layer_names]
    attention_bytes_per_block = sum(map(sum, slot_page_sizes))
    state_bytes_per_block = sum(page for _, page in state_layers)
    if sharing_sets and state_layers:
        state_block_size = next(g.kv_cache_spec.block_size for g in groups if isinstance(g.kv_cache_spec, StateSpec))
        sizing = state_pool_sizing or StatePoolSizing()
        if num_state_blocks is None and num_blocks is not None:
            num_state_blocks = num_state_blocks_needed(state_block_size, sizing)
        elif num_state_blocks is None:
            num_state_blocks = _state_pool_blocks(state_block_size, state_bytes_per_block, attention_bytes_per_block,
                                                  available_memory_bytes, sizing)
        if num_state_blocks < 2:
            raise ValueError(f"a state pool needs at least 2 blocks, got {num_state_blocks}")
        bytes_per_block = attention_bytes_per_block
        budget = available_memory_bytes - num_state_blocks * state_bytes_per_block
    else:
        num_state_blocks = 0
        bytes_per_block = attention_bytes_per_block + state_bytes_per_block
        budget = available_memory_bytes
    if num_blocks is None:
        num_blocks = max(budget, 0) // bytes_per_block
    if num_blocks < 2:
        raise ValueError(f"KV-cache budget of {available_memory_bytes} bytes holds {num_blocks} blocks of "
                         f"{bytes_per_block} bytes; at least 2 are needed")
    tensors = [KVCacheTensor(size=page_size * num_blocks,
                             shared_by=[group.layer_names[slot] for group in sharing if len(group.layer_names) > slot])
               for sharing, page_sizes in zip(sharing_sets, slot_page_sizes)
               for slot, page_size in enumerate(page_sizes)]
    num_slots = num_state_blocks or num_blocks
    tensors += [KVCacheTensor(size=page * num_slots, shared_by=[name]) for name, page in state_layers]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups,
                         num_state_blocks=num_state_blocks)


def _state_pool_blocks(block_size: int, bytes_per_block: int, attention_bytes_per_block: int, budget: int,
                       sizing: StatePoolSizing) -> int:
    """`num_state_blocks_needed`, cut to `MAX_STATE_SHARE` of the budget, but never below what
    one request of `max_model_len` tokens needs alone (the scheduler's admission bound of its
    state groups) while the budget also holds that request's attention blocks: a shorter state
    pool would cap the longest request (`scheduler.admission`) below max_model_len. A cut
    pool makes requests wait for slots."""
    needed = num_state_blocks_needed(block_size, sizing)
    cap = int(budget * MAX_STATE_SHARE) // bytes_per_block
    if sizing.max_model_len is not None:
        num_blocks = cdiv(sizing.max_model_len, block_size)
        one_request = min(num_blocks, cdiv(2 * sizing.max_num_batched_tokens, block_size) + 2) + 1
        if one_request * bytes_per_block + (num_blocks + 1) * attention_bytes_per_block <= budget:
            cap = max(cap, one_request)
    if needed > cap:
        logger.warning("the running requests may need %d state slots, but the KV budget gives them %d: "
                       "requests wait for slots when they run short", needed, cap)
    return min(needed, cap)


def num_pages(kv_cache_config: KVCacheConfig, spec: KVCacheSpec) -> int:
    """Pages (blocks, or state slots) a layer of `spec` has: its pool's block count."""
    if isinstance(spec, StateSpec) and kv_cache_config.num_state_blocks:
        return kv_cache_config.num_state_blocks
    return kv_cache_config.num_blocks


@dataclass(frozen=True)
class PoolShare:
    """One pool's part of the budget: its blocks (null block included) and bytes."""

    kind: str  # "attention", "state", or "all" (one pool)
    num_blocks: int
    num_bytes: int


def budget_split(kv_cache_config: KVCacheConfig) -> list[PoolShare]:
    """How the layout spends its memory, per pool (one entry when there is one pool)."""
    state_layers = {name for group in kv_cache_config.kv_cache_groups if isinstance(group.kv_cache_spec, StateSpec)
                    for name in group.layer_names}
    state_bytes = sum(t.size for t in kv_cache_config.kv_cache_tensors if set(t.shared_by) <= state_layers)
    total = sum(t.size for t in kv_cache_config.kv_cache_tensors)
    if not kv_cache_config.num_state_blocks:
        return [PoolShare("all", kv_cache_config.num_blocks, total)]
    return [PoolShare("attention", kv_cache_config.num_blocks, total - state_bytes),
            PoolShare("state", kv_cache_config.num_state_blocks, state_bytes)]


def kv_cache_group_block_sizes(kv_cache_config: KVCacheConfig) -> list[int]:
    return [group.kv_cache_spec.block_size for group in kv_cache_config.kv_cache_groups]


def get_scheduler_block_size(kv_cache_config: KVCacheConfig) -> int:
    """The LCM of the groups' block sizes: a step boundary common to every table."""
    return lcm(*kv_cache_group_block_sizes(kv_cache_config))


def get_default_hash_block_size(kv_cache_config: KVCacheConfig) -> int:
    """The GCD of the prefix-cacheable groups' block sizes (the first group's size if none is)."""
    sizes = [g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups if g.kv_cache_spec.prefix_cacheable]
    return gcd(*sizes) if sizes else kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
