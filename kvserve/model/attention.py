"""Attention over a paged KV cache: the per-step metadata, the KV tensors and
the portable torch backend (CPU, and CUDA as a fallback).

KV layout, per layer: one tensor `[2, num_kv_heads, num_blocks, block_size,
head_size]` (K at index 0, V at 1). Token slot s of block b is row
`b * block_size + s` of the per-head `[num_blocks * block_size, head_size]`
view. Heads outermost lets a gather of rows come out as `[heads, requests,
keys, dim]`, which the attention matmuls consume without a transposing copy.
Layers of different KV-cache groups may share one backing buffer
(`KVCacheTensor.shared_by`): they use disjoint block ids from one pool.

Per step and per KV-cache group, `AttentionMetadata.plan()` turns the batch
into gather indices and masks once; every layer of the group reuses them.
A layer attends to the cached part of the context (gathered from the cache,
positions before this step's first token) plus this step's own K/V (taken
from the fresh projections). Order of the cache write:
- block-table groups write first, then read: a request may hit prefix blocks
  that another request of the same step is filling (the KV manager caches
  blocks when it allocates them);
- circular-buffer groups read first, then write: a chunk may overwrite ring
  slots that its own first tokens still need, and ring blocks are never shared.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvserve.kv_cache.interface import (AttentionSpec, CircularBufferSpec, KVCacheConfig, KVCacheSpec,
                                        SlidingWindowSpec)
from kvserve.kv_cache.utils import KVCacheBlockCopy
from kvserve.model import cpu_kernels


@dataclass
class AttentionSubBatch:
    """Requests of one shape class (decode or prefill) padded to one query length."""

    token_index: torch.Tensor  # [n, max_q] flat token index per (request, query row); pads clamp to a valid one
    valid_rows: torch.Tensor  # [n * max_q] bool, rows that are real tokens
    key_blocks: torch.Tensor  # [n, max_blocks] cache blocks holding the keys read from the cache (pads -> 0)
    mask: torch.Tensor  # [n, max_q, max_blocks * block_size (+ max_q with new_keys)] bool, True = may attend
    out_index: torch.Tensor  # flat token index of each valid row, in row order
    new_keys: bool  # append this step's fresh K/V after the cached keys (circular groups)
    # The padded rows are exactly the batch's tokens in order (no pads, one sub-batch):
    # queries and outputs then need no gather/scatter.
    is_whole_batch: bool = False


@dataclass
class NativeTokens:
    """Tokens attended by the native CPU kernel, reading K/V in place from the cache."""

    token_index: torch.Tensor  # [n] flat token index
    positions: torch.Tensor  # [n] position of each; it reads keys up to and including it
    table_row: torch.Tensor  # [n] row of `block_table` holding its request's blocks
    block_table: torch.Tensor  # [B, max_blocks] int64, contiguous
    window: int | None


@dataclass
class AttentionPlan:
    """Gather/scatter indices of one step for one KV-cache group, shared by its layers."""

    sub_batches: list[AttentionSubBatch]
    write_token_index: torch.Tensor | None  # tokens whose K/V are stored (None: all)
    write_slots: torch.Tensor  # where they go
    write_before_read: bool = True
    native: NativeTokens | None = None
    # Prompts computed from scratch this step (no cached context): (first token, length).
    # They attend only to their own fresh K/V, causally, without padding or a gather.
    fresh_prompts: list[tuple[int, int]] = field(default_factory=list)
    window: int | None = None  # the layers' sliding window


@dataclass
class AttentionMetadata:
    """One KV-cache group's view of a step (the runner builds one per group).

    Tensors: `query_start_loc` [B+1] (token offsets of each request in the flat
    batch), `seq_lens` [B] (context length including this step's tokens),
    `block_table` [B, max_blocks] (block ids, pads 0), `slot_mapping` [T]
    (cache row of each new token; None lets the backend derive it from the
    block table). `spec` tells the backend how the group stores K/V (window,
    circular ring). Build with `AttentionMetadata.build` to get the derived
    fields filled in.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor | None
    max_query_len: int
    max_seq_len: int
    spec: KVCacheSpec | None = None
    _plans: dict = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, spec: KVCacheSpec, query_lens: list[int], seq_lens: list[int],
              block_table: torch.Tensor, device: torch.device | str = "cpu") -> "AttentionMetadata":
        """Metadata from per-request query lengths, context lengths and the padded block table."""
        query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.int64)
        query_start_loc[1:] = torch.tensor(query_lens, dtype=torch.int64).cumsum(0)
        metadata = cls(query_start_loc=query_start_loc.to(device),
                       seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
                       block_table=block_table.to(device=device, dtype=torch.int64),
                       slot_mapping=None, max_query_len=max(query_lens, default=0),
                       max_seq_len=max(seq_lens, default=0), spec=spec)
        metadata.slot_mapping = compute_slot_mapping(spec, metadata.block_table, metadata.query_start_loc,
                                                     metadata.seq_lens)
        return metadata

    def plan(self, block_size: int, sliding_window: int | None, native: bool = False) -> AttentionPlan:
        """The step's plan for layers of this block size and window; `native` lets the CPU kernel
        take the short queries (see `native_kernel_usable`)."""
        key = (block_size, sliding_window, native)
        if key not in self._plans:
            self._plans[key] = _build_plan(self, block_size, sliding_window, native)
        return self._plans[key]


def native_kernel_usable(kv_cache: torch.Tensor, q: torch.Tensor) -> bool:
    """The native CPU kernel can serve attention of queries `q` [T, Hq, D] over this cache
    (CPU, float32/bfloat16, a shape it takes, built)."""
    return (kv_cache.device.type == "cpu" and cpu_kernels.supports_dtype(kv_cache.dtype)
            and cpu_kernels.supports_dtype(q.dtype) and kv_cache.is_contiguous()
            and cpu_kernels.supports_shape(q.shape[1], kv_cache.shape[1], q.shape[2])
            and cpu_kernels.load_library() is not None)


def token_positions(query_start_loc: torch.Tensor, seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(request index, position) of every flat token."""
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    req_index = torch.repeat_interleave(torch.arange(len(query_lens), device=seq_lens.device), query_lens)
    offset_in_req = torch.arange(int(query_start_loc[-1]), device=seq_lens.device) - query_start_loc[req_index]
    return req_index, (seq_lens - query_lens)[req_index] + offset_in_req


def _ring_blocks(spec: KVCacheSpec | None) -> int | None:
    return spec.blocks_per_request if isinstance(spec, CircularBufferSpec) else None


def compute_slot_mapping(spec: KVCacheSpec, block_table: torch.Tensor, query_start_loc: torch.Tensor,
                         seq_lens: torch.Tensor) -> torch.Tensor:
    """Cache row of every new token: block_table[req, p // bs] * bs + p % bs (ring-indexed for circular groups)."""
    req_index, positions = token_positions(query_start_loc, seq_lens)
    return _slots(block_table, req_index, positions, spec.block_size, _ring_blocks(spec))


def _slots(block_table: torch.Tensor, req_index: torch.Tensor, positions: torch.Tensor, block_size: int,
           ring_blocks: int | None) -> torch.Tensor:
    block_index = positions // block_size
    if ring_blocks is not None:
        block_index = block_index % ring_blocks
    return block_table[req_index, block_index] * block_size + positions % block_size


def _build_plan(md: AttentionMetadata, block_size: int, window: int | None, native: bool) -> AttentionPlan:
    ring_blocks = _ring_blocks(md.spec)
    md.block_table = md.block_table.long()
    md.query_start_loc = md.query_start_loc.long()
    md.seq_lens = md.seq_lens.long()
    query_lens = md.query_start_loc[1:] - md.query_start_loc[:-1]
    context_lens = md.seq_lens - query_lens
    req_index, positions = token_positions(md.query_start_loc, md.seq_lens)
    num_tokens = int(md.query_start_loc[-1])
    # Ring groups read before they write, which the kernel (reading only the cache) cannot.
    native = native and ring_blocks is None
    short = (query_lens > 0) & (query_lens <= _NATIVE_MAX_QUERY_LEN) if native else query_lens == 1
    native_tokens, decode_groups = None, []
    if native:
        native_tokens = _native_tokens(md, short, req_index, positions, window)
    else:
        decode_rows = short.nonzero().flatten()
        decode_groups = _length_groups(decode_rows, _blocks_read(context_lens[decode_rows], 1, block_size, window))
    is_fresh = ~short & (query_lens > 1) & (context_lens == 0)
    fresh_prompts = list(zip(md.query_start_loc[:-1][is_fresh].tolist(), query_lens[is_fresh].tolist()))
    # Prompt chunks over cached context (chunked prefill, prefix hits) differ in length: each
    # group pads only to its own longest, so a batch of mixed prompts wastes little.
    prefill_rows = (~short & ~is_fresh & (query_lens > 0)).nonzero().flatten()
    prefill_groups = _length_groups(prefill_rows, _prefill_cost(query_lens[prefill_rows], context_lens[prefill_rows],
                                                                block_size, window))
    sub_batches = []
    for rows in (*decode_groups, *prefill_groups):
        if len(rows):
            sub_batches.append(_build_sub_batch(md, rows, query_lens[rows], context_lens[rows],
                                                block_size, window, ring_blocks))
    if len(sub_batches) == 1 and _covers_batch_in_order(sub_batches[0], num_tokens):
        sub_batches[0].is_whole_batch = True
    if ring_blocks is not None:
        slots = _slots(md.block_table, req_index, positions, block_size, ring_blocks)
        # A ring slot is reused every ring_capacity positions: of the tokens of this
        # step that collide, only the last may be written.
        keep = positions + ring_blocks * block_size >= md.seq_lens[req_index]
        write_index = keep.nonzero().flatten()
        return AttentionPlan(sub_batches, write_index, slots[write_index], write_before_read=False,
                             fresh_prompts=fresh_prompts, window=window)
    slots = md.slot_mapping.long() if md.slot_mapping is not None else _slots(
        md.block_table, req_index, positions, block_size, None)
    return AttentionPlan(sub_batches, None, slots, native=native_tokens, fresh_prompts=fresh_prompts,
                         window=window)


# Queries of up to this many tokens go to the native kernel (each token reads
# its keys once per KV head); longer ones are prefills, where the padded
# matmul path (SDPA) reuses each key across many queries.
_NATIVE_MAX_QUERY_LEN = 16


def _native_tokens(md: AttentionMetadata, requests: torch.Tensor, req_index: torch.Tensor,
                   positions: torch.Tensor, window: int | None) -> NativeTokens | None:
    token_index = requests[req_index].nonzero().flatten()
    if not len(token_index):
        return None
    return NativeTokens(token_index=token_index, positions=positions[token_index].contiguous(),
                        table_row=req_index[token_index].contiguous(), block_table=md.block_table.contiguous(),
                        window=window)


# A decode sub-batch pads every request to its longest context. Splitting one
# off costs a few more small ops per layer (~0.1 ms); it pays when it spares at
# least this many padded (request, block) reads: ~3 MB of bf16 K/V per layer for
# the default model. Few sub-batches (the longest requests first) catch most
# of the waste of a mixed-length batch.
_MIN_SAVED_BLOCK_READS = 256
_MAX_DECODE_SUB_BATCHES = 4


def _covers_batch_in_order(sub: AttentionSubBatch, num_tokens: int) -> bool:
    index = sub.token_index.flatten()
    return (index.numel() == num_tokens and bool(sub.valid_rows.all())
            and bool((index == torch.arange(num_tokens, device=index.device)).all()))


def _blocks_read(context_lens: torch.Tensor, query_len: int, block_size: int, window: int | None) -> torch.Tensor:
    """Cache blocks each request's keys span (what `_build_sub_batch` gathers)."""
    end = context_lens + query_len
    first_key = (context_lens - (window - 1)).clamp(min=0) if window else torch.zeros_like(context_lens)
    return (end + block_size - 1) // block_size - first_key // block_size


def _prefill_cost(query_lens: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                  window: int | None) -> torch.Tensor:
    """A prompt chunk's attention work in (query block, key block) pairs: what padding it to a
    longer member of its sub-batch wastes, in the units of `_length_groups`."""
    query_blocks = (query_lens + block_size - 1) // block_size
    return query_blocks * _blocks_read(context_lens, 0, block_size, window).clamp(min=0) + query_blocks * query_blocks


def _length_groups(rows: torch.Tensor, num_blocks: torch.Tensor) -> list[torch.Tensor]:
    """`rows` split into at most _MAX_DECODE_SUB_BATCHES groups of similar length.

    Rows sorted by blocks (descending); each split cuts the group where padding
    the rows after the cut to their own longest saves the most block reads,
    while that saving reaches _MIN_SAVED_BLOCK_READS."""
    if len(rows) < 2:
        return [rows]
    order = torch.argsort(num_blocks, descending=True, stable=True)
    blocks = num_blocks[order].tolist()
    bounds = [0, len(blocks)]  # group i is sorted rows bounds[i]:bounds[i+1]
    while len(bounds) - 1 < _MAX_DECODE_SUB_BATCHES:
        best_saving, best_cut = 0, None
        for start, end in zip(bounds, bounds[1:]):
            for cut in range(start + 1, end):
                saving = (blocks[start] - blocks[cut]) * (end - cut)
                if saving > best_saving:
                    best_saving, best_cut = saving, cut
        if best_cut is None or best_saving < _MIN_SAVED_BLOCK_READS:
            break
        bounds = sorted(bounds + [best_cut])
    # Each group keeps the batch order (a lone group is the input itself).
    return [rows[order[start:end].sort().values] for start, end in zip(bounds, bounds[1:])]


def _build_sub_batch(md: AttentionMetadata, rows: torch.Tensor, query_lens: torch.Tensor,
                     context_lens: torch.Tensor, block_size: int, window: int | None,
                     ring_blocks: int | None) -> AttentionSubBatch:
    device = query_lens.device
    max_q = int(query_lens.max())
    q_offsets = torch.arange(max_q, device=device)
    q_valid = q_offsets[None, :] < query_lens[:, None]  # [n, max_q]
    starts = md.query_start_loc[rows]
    token_index = starts[:, None] + torch.where(q_valid, q_offsets[None, :], 0)
    q_pos = context_lens[:, None] + q_offsets[None, :]  # [n, max_q]

    # Keys read from the cache: [first_key, end), fetched as whole blocks (big
    # contiguous rows gather fast). A window needs only the last (window - 1)
    # positions before the step's first token. Ring groups read only the
    # positions before this step (the new ones come from k/v directly).
    new_keys = ring_blocks is not None
    end = context_lens if new_keys else context_lens + query_lens
    first_key = (context_lens - (window - 1)).clamp(min=0) if window else torch.zeros_like(context_lens)
    first_block = first_key // block_size
    num_blocks = (end + block_size - 1) // block_size - first_block
    max_blocks = int(num_blocks.max()) if len(num_blocks) else 0
    b_offsets = torch.arange(max_blocks, device=device)
    block_valid = b_offsets[None, :] < num_blocks[:, None]
    logical_block = torch.where(block_valid, first_block[:, None] + b_offsets[None, :], 0)
    if new_keys:
        logical_block = logical_block % ring_blocks
    key_blocks = torch.where(block_valid, md.block_table[rows[:, None], logical_block], 0)
    k_offsets = torch.arange(max_blocks * block_size, device=device)
    k_pos = (first_block * block_size)[:, None] + k_offsets[None, :]  # [n, max_keys]
    k_valid = (k_pos >= first_key[:, None]) & (k_pos < end[:, None])

    mask = k_valid[:, None, :] & (k_pos[:, None, :] <= q_pos[:, :, None])
    if window:
        mask = mask & (q_pos[:, :, None] - k_pos[:, None, :] < window)
    pad_rows = ~q_valid[:, :, None]
    if new_keys:
        new_mask = (q_offsets[None, :, None] >= q_offsets[None, None, :]) & q_valid[:, None, :]
        if window:
            new_mask = new_mask & (q_offsets[None, :, None] - q_offsets[None, None, :] < window)
        # Pad query rows attend to one real key so no row is all-masked (no NaNs).
        new_mask = new_mask | (pad_rows & (q_offsets[None, None, :] == 0))
        mask = torch.cat([mask, new_mask.expand(len(rows), -1, -1)], dim=2)
    else:
        # Pad query rows attend to one real key so no row is all-masked (no NaNs).
        mask = mask | (pad_rows & (k_pos == first_key[:, None])[:, None, :])
    valid_rows = q_valid.flatten()
    return AttentionSubBatch(token_index=token_index, valid_rows=valid_rows, key_blocks=key_blocks, mask=mask,
                             out_index=token_index.flatten()[valid_rows], new_keys=new_keys)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    plan: AttentionPlan, scale: float, softcap: float | None) -> torch.Tensor:
    """q: [T, Hq, D], k/v: [T, Hkv, D] of this step's tokens (already rotated).

    Returns [T, Hq, D]; stores this step's K/V in the cache (see the module docstring for the order)."""
    num_kv_heads, block_size, head_dim = kv_cache.shape[1], kv_cache.shape[3], kv_cache.shape[4]
    if plan.write_before_read:
        _store(kv_cache, k, v, plan)
    out = None
    if plan.native is not None:
        out = q.new_empty(q.shape)
        tokens = plan.native
        cpu_kernels.paged_attention_cpu(q, kv_cache, out, tokens.token_index, tokens.positions, tokens.block_table,
                                        tokens.table_row, tokens.window, scale, softcap)
    for start, length in plan.fresh_prompts:
        out = q.new_empty(q.shape) if out is None else out
        end = start + length
        out[start:end] = _causal_prompt(q[start:end], k[start:end], v[start:end], scale, softcap, plan.window)
    for sub in plan.sub_batches:
        n, num_blocks = sub.key_blocks.shape
        # One gather for K and V of every request of the sub-batch: [2, Hkv, n, keys, D].
        keys, values = kv_cache.index_select(2, sub.key_blocks.flatten()).view(
            2, num_kv_heads, n, num_blocks * block_size, head_dim)
        if sub.new_keys:
            keys = torch.cat([keys, _rows(k, sub).permute(2, 0, 1, 3)], dim=2)
            values = torch.cat([values, _rows(v, sub).permute(2, 0, 1, 3)], dim=2)
        attended = _attend(_rows(q, sub), keys, values, sub.mask, scale, softcap)
        if sub.is_whole_batch:
            out = attended.reshape(q.shape)
        else:
            out = q.new_empty(q.shape) if out is None else out
            out[sub.out_index] = attended.flatten(0, 1)[sub.valid_rows]
    if not plan.write_before_read:
        _store(kv_cache, k, v, plan)
    return out


def _causal_prompt(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, softcap: float | None,
                   window: int | None) -> torch.Tensor:
    """One prompt attending to itself: q [L, Hq, D], k/v [L, Hkv, D] -> [L, Hq, D]."""
    length = q.shape[0]
    if not softcap and (window is None or window >= length):
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                             is_causal=True, scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1)
    pos = torch.arange(length, device=q.device)
    mask = pos[None, :] <= pos[:, None]
    if window:
        mask &= pos[:, None] - pos[None, :] < window
    return _attend(q[None], k.permute(1, 0, 2)[:, None], v.permute(1, 0, 2)[:, None], mask[None], scale, softcap)[0]


def _rows(x: torch.Tensor, sub: AttentionSubBatch) -> torch.Tensor:
    """This step's per-token tensor [T, H, D] as the sub-batch's padded [n, max_q, H, D]."""
    if sub.is_whole_batch:
        return x.view(sub.token_index.shape + x.shape[1:])
    return x[sub.token_index]


def _store(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan) -> None:
    if (cpu_kernels.usable_for(k, v, kv_cache) and k.stride() == v.stride() and kv_cache.is_contiguous()
            and plan.write_slots.dtype == torch.int64 and plan.write_slots.is_contiguous()):
        cpu_kernels.store_kv(k, v, kv_cache, plan.write_slots, plan.write_token_index)
        return
    kv_rows = kv_cache.view(2, kv_cache.shape[1], -1, kv_cache.shape[4])
    if plan.write_token_index is not None:
        k, v = k[plan.write_token_index], v[plan.write_token_index]
    kv_rows[0].index_copy_(1, plan.write_slots, k.transpose(0, 1).to(kv_rows.dtype))
    kv_rows[1].index_copy_(1, plan.write_slots, v.transpose(0, 1).to(kv_rows.dtype))


# torch's CPU SDPA kernel is slow for short queries (decode); the explicit path wins there.
_SDPA_MIN_QUERY_LEN = 32


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
            softcap: float | None) -> torch.Tensor:
    """q: [n, Lq, Hq, D]; k/v: [Hkv, n, Lk, D]; mask: [n, Lq, Lk] -> [n, Lq, Hq, D].

    GQA without repeating K/V: the query heads of one KV head form the rows of one matmul."""
    n, lq, hq, d = q.shape
    hkv = k.shape[0]
    group = hq // hkv
    if not softcap and lq >= _SDPA_MIN_QUERY_LEN:
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(0, 1), v.transpose(0, 1),
                                             attn_mask=mask[:, None], scale=scale, enable_gqa=True)
        return out.transpose(1, 2)
    # [Hkv, n, group*Lq, D]
    qg = q.view(n, lq, hkv, group, d).permute(2, 0, 3, 1, 4).reshape(hkv, n, group * lq, d)
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(hkv, n, group, lq, -1).masked_fill(~mask[None, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(hkv, n, group * lq, -1)
    out = torch.matmul(probs, v)  # [Hkv, n, group*Lq, D]
    return out.view(hkv, n, group, lq, d).permute(1, 3, 0, 2, 4).reshape(n, lq, hq, d)


# -- KV tensors ---------------------------------------------------------------------------

def kv_cache_shape(spec: AttentionSpec, num_blocks: int) -> tuple[int, ...]:
    """[K/V, kv heads, blocks, slots per block, head size] (see the module docstring)."""
    return (2, spec.num_kv_heads, num_blocks, spec.block_size, spec.head_size)


def _torch_dtype(dtype) -> torch.dtype:
    return dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype).removeprefix("torch."))


def allocate_kv_caches(kv_cache_config: KVCacheConfig, layer_specs: dict[str, KVCacheSpec],
                       device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """One zeroed KV tensor per layer; layers named together in a `KVCacheTensor` share its buffer."""
    num_blocks = kv_cache_config.num_blocks
    caches: dict[str, torch.Tensor] = {}
    for tensor in kv_cache_config.kv_cache_tensors:
        if torch.device(device).type == "cpu":
            buffer = cpu_kernels.zeros_on_huge_pages(tensor.size).view(torch.int8)
        else:
            buffer = torch.zeros(tensor.size, dtype=torch.int8, device=device)
        for name in tensor.shared_by:
            spec = layer_specs[name]
            dtype = _torch_dtype(spec.dtype)
            needed = spec.page_size_bytes * num_blocks
            if needed > tensor.size:
                raise ValueError(f"KV tensor of {tensor.size} bytes is too small for {name} ({needed} bytes)")
            caches[name] = buffer[:needed].view(dtype).view(kv_cache_shape(spec, num_blocks))
    for group in kv_cache_config.kv_cache_groups:
        for name in group.layer_names:
            if name not in caches:
                spec = layer_specs[name]
                caches[name] = torch.zeros(kv_cache_shape(spec, num_blocks), dtype=_torch_dtype(spec.dtype),
                                           device=device)
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
            kv_caches[name][:, :, dst] = kv_caches[name][:, :, src]


def is_windowed(spec: KVCacheSpec) -> bool:
    return isinstance(spec, (SlidingWindowSpec, CircularBufferSpec))
