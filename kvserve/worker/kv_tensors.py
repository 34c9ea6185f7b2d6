"""The KV tensors of one rank: allocation for a `KVCacheConfig` and the
copy-on-write block copies the scheduler asks for.

Layout per attention layer: `[2, num_kv_heads, num_blocks, block_size, head_size]`
(see `kvserve.model.attention.metadata`). A recurrent-state layer (`StateSpec`)
gets a tuple of tensors `[num_slots, *shape]`, one per state shape (slot id =
block id of the state groups' pool: `num_state_blocks` slots when the layout gives
them a pool of their own, else `num_blocks`), carved one after another from its buffer. On the CPU the buffers sit
on transparent huge pages where the OS allows (`cpu_kernels.zeros_on_huge_pages`).
"""
from __future__ import annotations

import torch

from kvserve.kv_cache.interface import AttentionSpec, KVCacheConfig, KVCacheSpec, StateSpec
from kvserve.kv_cache.layout import num_pages
from kvserve.kv_cache.utils import KVCacheBlockCopy
from kvserve.native import cpu_kernels


def kv_cache_shape(spec: AttentionSpec, num_blocks: int) -> tuple[int, ...]:
    """[K/V, kv heads, blocks, slots per block, head size] (see the module docstring)."""
    return (2, spec.num_kv_heads, num_blocks, spec.block_size, spec.head_size)


def _torch_dtype(dtype) -> torch.dtype:
    return dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype).removeprefix("torch."))


def _layer_cache(buffer: torch.Tensor, spec: KVCacheSpec, num_blocks: int):
    """The layer's view of its zeroed int8 `buffer`: one KV tensor, or a state layer's tuple."""
    dtype = _torch_dtype(spec.dtype)
    if not isinstance(spec, StateSpec):
        return buffer[:spec.page_size_bytes * num_blocks].view(dtype).view(kv_cache_shape(spec, num_blocks))
    states, offset = [], 0
    for shape, slot_size in zip(spec.shapes, spec.slot_sizes):
        num_bytes = slot_size * dtype.itemsize * num_blocks
        states.append(buffer[offset:offset + num_bytes].view(dtype).view(num_blocks, *shape))
        offset += num_bytes
    return tuple(states)


def allocate_kv_caches(kv_cache_config: KVCacheConfig, layer_specs: dict[str, KVCacheSpec],
                       device: torch.device | str = "cpu") -> dict:
    """One zeroed KV tensor (a tuple of state tensors for a state layer) per layer; layers
    named together in a `KVCacheTensor` share its buffer."""
    caches: dict[str, torch.Tensor] = {}
    for tensor in kv_cache_config.kv_cache_tensors:
        if torch.device(device).type == "cpu":
            buffer = cpu_kernels.zeros_on_huge_pages(tensor.size).view(torch.int8)
        else:
            buffer = torch.zeros(tensor.size, dtype=torch.int8, device=device)
        for name in tensor.shared_by:
            spec = layer_specs[name]
            num_blocks = num_pages(kv_cache_config, spec)
            needed = spec.page_size_bytes * num_blocks
            if needed > tensor.size:
                raise ValueError(f"KV tensor of {tensor.size} bytes is too small for {name} ({needed} bytes)")
            caches[name] = _layer_cache(buffer, spec, num_blocks)
    for group in kv_cache_config.kv_cache_groups:
        for name in group.layer_names:
            if name not in caches:
                spec = layer_specs[name]
                num_blocks = num_pages(kv_cache_config, spec)
                buffer = torch.zeros(spec.page_size_bytes * num_blocks, dtype=torch.int8, device=device)
                caches[name] = _layer_cache(buffer, spec, num_blocks)
    return caches


def copy_kv_blocks(kv_caches: dict[str, torch.Tensor], kv_cache_config: KVCacheConfig,
                   copies: list[KVCacheBlockCopy]) -> None:
    """Apply copy-on-write block copies to every layer of each copy's group.

    Whole blocks are copied: slots past `num_tokens` belong to the destination's
    owner, which overwrites them before reading them."""
    if not copies:
        return
    by_group: dict[int, list[KVCacheBlockCopy]] = {}
    for copy in copies:
        by_group.setdefault(copy.group_id, []).append(copy)
    for group_id, group_copies in by_group.items():
        layer_names = kv_cache_config.kv_cache_groups[group_id].layer_names
        device = kv_caches[layer_names[0]].device
        src = torch.tensor([c.src_block_id for c in group_copies], device=device)
        dst = torch.tensor([c.dst_block_id for c in group_copies], device=device)
        for name in layer_names:
            cache = kv_caches[name]
            if isinstance(cache, tuple):  # a state layer's slots
                for state in cache:
                    state[dst] = state[src]
            else:
                cache[:, :, dst] = cache[:, :, src]
