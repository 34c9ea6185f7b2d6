"""The KV tensors of one rank: allocation for a `KVCacheConfig` and the
copy-on-write block copies the scheduler asks for.

Layout per attention layer: `[2, num_kv_heads, num_blocks, block_size, head_size]`
(see `kvserve.model.attention.metadata`). A recurrent-state layer (`StateSpec`)
gets a tuple of tensors `[num_slots, *shape]`, one per state shape (slot id =
block id of the state groups' pool: `num_state_blocks` slots when the layout gives
them a pool of their own, else `num_blocks`), carved one after another from its buffer.
On the CPU each buffer is an anonymous mapping of its own (untouched blocks take no memory) and moves to
transparent huge pages as its used part grows (`KVHugePageGrowth`).
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
            buffer = cpu_kernels.zeros_on_huge_pages(tensor.size, advise=False).view(torch.int8)
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


class KVHugePageGrowth:
    """Moves the KV tensors' used part to transparent huge pages as it grows.

    Each attention layer tensor is 2 x kv-heads regions, one per (K/V, head), each
    `num_blocks` block slices long; block b lies at the same offset in every region. A huge
    page is faulted in whole on its first byte, so advising a whole pool at allocation made
    2 MiB of every region resident on the first token (512 MiB for a Llama-3.2-1B at any pool
    size). Blocks are handed out from the low ids up, so the used part of every region is
    about [0, highest block id in use]. Advice starts once that part is a huge page long
    and then covers twice the used part, rounded up to whole huge pages: huge pages faulted
    ahead of use are at most as many bytes as the used ones (plus one), and a long context (where
    the TLB misses cost) still reads its
    blocks through huge pages (those already faulted as 4 KiB pages are merged by khugepaged).
    """

    def __init__(self, kv_caches: dict) -> None:
        regions: dict[int, tuple[int, int]] = {}
        for cache in kv_caches.values():
            if not isinstance(cache, torch.Tensor) or cache.dim() != 5 or cache.device.type != "cpu":
                continue
            block_bytes = cache.stride(2) * cache.element_size()
            region_bytes = cache.shape[2] * block_bytes
            for index in range(cache.shape[0] * cache.shape[1]):
                regions[cache.data_ptr() + index * region_bytes] = (region_bytes, block_bytes)
        self.regions = regions
        self.advised_bytes = dict.fromkeys(regions, 0)
        self.num_blocks_seen = 0

    def note_blocks(self, highest_block_id: int) -> None:
        """Called with the highest block id a step uses; advises more huge pages when due."""
        if highest_block_id < self.num_blocks_seen:
            return
        self.num_blocks_seen = highest_block_id + 1
        for start, (region_bytes, block_bytes) in self.regions.items():
            used = self.num_blocks_seen * block_bytes
            if used < cpu_kernels.HUGE_PAGE_BYTES:
                continue
            huge = cpu_kernels.HUGE_PAGE_BYTES
            target = min(region_bytes, -(-2 * used // huge) * huge)  # whole huge pages: few calls
            advised = self.advised_bytes[start]
            if target > advised:
                cpu_kernels.advise_huge_pages(start + advised, target - advised)
                self.advised_bytes[start] = target


def highest_block_id(scheduler_output) -> int:
    """The highest block id a step's new and newly grown block tables hold (-1: none)."""
    highest = -1
    for new_req in scheduler_output.scheduled_new_reqs:
        for ids in new_req.block_ids:
            if ids:
                highest = max(highest, max(ids))
    for group_ids in scheduler_output.scheduled_cached_reqs.new_block_ids:
        for ids in group_ids or ():
            if ids:
                highest = max(highest, max(ids))
    return highest


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
