"""Turn a model's per-layer KV specs and a memory budget into a `KVCacheConfig`.

Layout (vLLM-like): layers of one model with equal specs form one group (one
block table per request); a second model's layers (a speculative draft, whose
layer names carry a prefix such as `draft.`) get groups of their own.
All groups draw block ids from one pool and a block id belongs to one group
at a time, so layer j of every group can share one backing
tensor: `KVCacheTensor` j is `shared_by` the j-th layer of each group and
holds `num_blocks` pages of the largest page size among them. Block id b is
page b of every layer tensor of the group that holds it. The cost of one
block id is therefore the sum over tensor slots of their page size, and
`num_blocks = budget // that`. With one group this is one tensor per layer.

Recurrent-state layers (`StateSpec`) share no tensor with attention layers: an
attention tensor holds a block's K/V as scattered rows (heads outermost, see
`kvserve.model.attention.metadata`), a state tensor its slots one after another, so
block b of one and slot c of the other would overlap. Each state layer has its own
tensor, and a block id costs its attention pages plus its state pages. For the
same reason attention layers share a tensor only when their K/V rows of one block
(block_size x head_size elements) have the same size: block b's rows then sit at
row indices k * num_blocks + b, disjoint for distinct ids whatever the head counts
(a draft of another head size next to its target gets tensors of its own).
"""
from __future__ import annotations

from math import gcd, lcm

from kvserve.kv_cache.interface import (AttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheSpec, KVCacheTensor,
                                        StateSpec, dtype_size_bytes)


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
                        num_blocks: int | None = None) -> KVCacheConfig:
    """The cache layout for `layer_specs` within `available_memory_bytes` (or with
    exactly `num_blocks` blocks when given). Raises ValueError when fewer than two
    blocks fit (block 0 is the null block)."""
    if not layer_specs:
        raise ValueError("no KV-cache layers")
    groups = group_layers_by_spec(layer_specs)
    sharing_sets = _attention_sharing_sets(groups)
    slot_page_sizes = [_tensor_slot_page_sizes(sharing) for sharing in sharing_sets]
    state_layers = [(name, group.kv_cache_spec.page_size_bytes) for group in groups
                    if isinstance(group.kv_cache_spec, StateSpec) for name in group.layer_names]
    bytes_per_block = sum(map(sum, slot_page_sizes)) + sum(page for _, page in state_layers)
    if num_blocks is None:
        num_blocks = available_memory_bytes // bytes_per_block
    if num_blocks < 2:
        raise ValueError(f"KV-cache budget of {available_memory_bytes} bytes holds {num_blocks} blocks of "
                         f"{bytes_per_block} bytes; at least 2 are needed")
    tensors = [KVCacheTensor(size=page_size * num_blocks,
                             shared_by=[group.layer_names[slot] for group in sharing if len(group.layer_names) > slot])
               for sharing, page_sizes in zip(sharing_sets, slot_page_sizes)
               for slot, page_size in enumerate(page_sizes)]
    tensors += [KVCacheTensor(size=page * num_blocks, shared_by=[name]) for name, page in state_layers]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups)


def kv_cache_group_block_sizes(kv_cache_config: KVCacheConfig) -> list[int]:
    return [group.kv_cache_spec.block_size for group in kv_cache_config.kv_cache_groups]


def get_scheduler_block_size(kv_cache_config: KVCacheConfig) -> int:
    """The LCM of the groups' block sizes: a step boundary common to every table."""
    return lcm(*kv_cache_group_block_sizes(kv_cache_config))


def get_default_hash_block_size(kv_cache_config: KVCacheConfig) -> int:
    """The GCD of the prefix-cacheable groups' block sizes (the first group's size if none is)."""
    sizes = [g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups if g.kv_cache_spec.prefix_cacheable]
    return gcd(*sizes) if sizes else kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
