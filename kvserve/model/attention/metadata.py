"""Attention metadata: one KV-cache group's view of a step and the plan its layers share.

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

from kvserve.kv_cache.interface import CircularBufferSpec, KVCacheSpec, SlidingWindowSpec, StateSpec, cdiv


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
class PrefillChunks:
    """Prompt chunks attended by the native prefill kernel (csrc/attention/prefill_attention.c),
    reading K/V in place from the cache: chunk c is `length[c]` consecutive tokens from flat
    token `start[c]` on, at positions `first_pos[c]`.. of the request in row `table_row[c]`."""

    start: torch.Tensor  # [C] int64
    length: torch.Tensor  # [C]
    first_pos: torch.Tensor  # [C]
    table_row: torch.Tensor  # [C]
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
    prefill: PrefillChunks | None = None
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
    req_index: torch.Tensor | None = None  # [T] request of each token (None: derived when asked)
    # Speculative drafts among the step's tokens: every matmul picks its kernel as for the
    # step without them (`quantized.linear`'s `num_draft_rows`).
    num_draft_tokens: int = 0
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

    def token_request_index(self) -> torch.Tensor:
        """[T] int64: the request (row of `block_table`) of each flat token."""
        if self.req_index is None:
            self.req_index = token_positions(self.query_start_loc.long(), self.seq_lens.long())[0]
        return self.req_index

    def plan(self, block_size: int, sliding_window: int | None, native: bool = False,
             prefill: bool = False) -> AttentionPlan:
        """The step's plan for layers of this block size and window; `native` gives the short
        queries to the native CPU kernel (`NativeTokens`), which reads their keys in place, and
        with `prefill` the longer ones to the native prefill kernel (`PrefillChunks`)."""
        key = (block_size, sliding_window, native, prefill)
        if key not in self._plans:
            self._plans[key] = _build_plan(self, block_size, sliding_window, native, prefill)
        return self._plans[key]


@dataclass
class StateMetadata:
    """One recurrent-state group's view of a step (the runner builds one per state group).

    State layers keep their state in slots: slot id = block id of the group, one
    row of each of the layer's state tensors `[num_blocks, *shape]`.
    - `query_start_loc` [B+1] int64: token offsets of each request in the flat batch;
      `seq_lens` [B]: context length including this step's tokens.
    - `read_slot` [B] int64: the slot holding each request's state before its first
      token of this step; -1: start from zeros (a fresh prompt, or a recompute).
    - `write_req`, `write_after`, `write_slot` [W] int64: after token `write_after`
      (1..query_len) of request `write_req`'s tokens in this step, store the state in
      `write_slot`. Every request has one write at its query_len (its running
      state); a step crossing block-size boundaries also writes the snapshot at
      each boundary whose block is held (the ones prefix caching keeps).
    A slot being written is never read by another request of the same step, nor by a
    step still in flight (the KV manager's fences). A request may read and write the
    same slot (its running state, updated in place): read it before writing.
    Build with `StateMetadata.build`.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    read_slot: torch.Tensor
    write_req: torch.Tensor
    write_after: torch.Tensor
    write_slot: torch.Tensor
    max_query_len: int
    max_seq_len: int
    spec: StateSpec | None = None
    num_draft_tokens: int = 0  # always 0: speculative decoding does not run with state layers

    @classmethod
    def build(cls, spec: StateSpec, query_lens, num_computed_tokens, block_table,
              device: torch.device | str = "cpu") -> "StateMetadata":
        """Metadata from per-request query lengths, tokens computed before the step and the
        group's block table rows ([B, max_blocks], block i holding the state after token
        (i + 1) * block_size; 0 = the null block: nothing held there)."""
        query_lens = [int(n) for n in query_lens]
        num_computed = [int(n) for n in num_computed_tokens]
        table = torch.as_tensor(block_table, dtype=torch.int64).cpu()
        read_slot, writes = state_slots(spec.block_size, query_lens, num_computed, table)
        query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.int64)
        query_start_loc[1:] = torch.tensor(query_lens, dtype=torch.int64).cumsum(0)
        seq_lens = [n + q for n, q in zip(num_computed, query_lens)]
        write_columns = torch.tensor(writes, dtype=torch.int64).reshape(-1, 3).t()
        return cls(query_start_loc=query_start_loc.to(device),
                   seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
                   read_slot=torch.tensor(read_slot, dtype=torch.int64, device=device),
                   write_req=write_columns[0].to(device), write_after=write_columns[1].to(device),
                   write_slot=write_columns[2].to(device), max_query_len=max(query_lens, default=0),
                   max_seq_len=max(seq_lens, default=0), spec=spec)

    def writes_of(self, request: int) -> list[tuple[int, int]]:
        """(after token, slot) of request `request`'s writes, in token order."""
        mask = self.write_req == request
        return list(zip(self.write_after[mask].tolist(), self.write_slot[mask].tolist()))


def state_slots(block_size: int, query_lens: list[int], num_computed: list[int],
                block_table: torch.Tensor) -> tuple[list[int], list[tuple[int, int, int]]]:
    """(read slot per request, [(request, after token, slot)] writes): see `StateMetadata`."""
    read_slot, writes = [], []
    for req, (start, query_len) in enumerate(zip(num_computed, query_lens)):
        row = block_table[req]
        read_slot.append(_held_slot(row, cdiv(start, block_size) - 1, req) if start > 0 else -1)
        end = start + query_len
        for boundary in range(start // block_size + 1, end // block_size + 1):
            slot = int(row[boundary - 1]) if boundary - 1 < len(row) else 0
            if slot and boundary * block_size < end:
                writes.append((req, boundary * block_size - start, slot))
        if query_len:
            writes.append((req, query_len, _held_slot(row, cdiv(end, block_size) - 1, req)))
    return read_slot, writes


def _held_slot(row: torch.Tensor, index: int, req: int) -> int:
    slot = int(row[index]) if index < len(row) else 0
    if slot <= 0:
        raise ValueError(f"state group: request {req} holds no block at table index {index}")
    return slot


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


def _build_plan(md: AttentionMetadata, block_size: int, window: int | None, native: bool,
                prefill: bool) -> AttentionPlan:
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
    longer = ~short & (query_lens > 0)
    prefill_chunks = None
    if native and prefill:
        prefill_chunks = _prefill_chunks(md, longer.nonzero().flatten(), query_lens, context_lens, window)
        longer = torch.zeros_like(longer)  # nothing left for the torch path
    is_fresh = longer & (query_lens > 1) & (context_lens == 0)
    fresh_prompts = list(zip(md.query_start_loc[:-1][is_fresh].tolist(), query_lens[is_fresh].tolist()))
    # Prompt chunks over cached context (chunked prefill, prefix hits) differ in length: each
    # group pads only to its own longest, so a batch of mixed prompts wastes little.
    prefill_rows = (longer & ~is_fresh).nonzero().flatten()
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
    return AttentionPlan(sub_batches, None, slots, native=native_tokens, prefill=prefill_chunks,
                         fresh_prompts=fresh_prompts, window=window)


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


def _prefill_chunks(md: AttentionMetadata, rows: torch.Tensor, query_lens: torch.Tensor, context_lens: torch.Tensor,
                    window: int | None) -> PrefillChunks | None:
    if not len(rows):
        return None
    return PrefillChunks(start=md.query_start_loc[rows].contiguous(), length=query_lens[rows].contiguous(),
                         first_pos=context_lens[rows].contiguous(), table_row=rows.contiguous(),
                         block_table=md.block_table.contiguous(), window=window)


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


def is_windowed(spec: KVCacheSpec) -> bool:
    """Whether layers of `spec` attend to a sliding window (paged or ring-buffered)."""
    return isinstance(spec, (SlidingWindowSpec, CircularBufferSpec))
