"""The runner's persistent per-request state, held in preallocated numpy arrays.

A `SchedulerOutput` is a diff: new requests arrive in full, running ones as
"N more tokens, these extra blocks". `InputBatch` applies the diff in place
(one row per live request: its known token ids and one block-table row per
KV-cache group), so a decode step only gathers from arrays instead of
rebuilding Python lists. Tokens the runner samples are appended to the row
at once: under async scheduling the next step may already be scheduled
with that token as a placeholder, and the runner is the one party that
knows it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvserve.kv_cache.interface import KVCacheSpec, cdiv
from kvserve.sampling_params import SamplingParams
from kvserve.messages import NewRequestData, SchedulerOutput


class InputPreparationError(RuntimeError):
    """A SchedulerOutput does not match the runner's state (a contract violation)."""


@dataclass
class RequestState:
    """What the runner remembers about one request between steps."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    generator: Any = None  # torch.Generator for seeded requests
    grammar: Any = None  # llguidance matcher of a structured-output request (sampling rank only)
    # Tokens sampled since the matcher last advanced: the mask thread feeds them to it before
    # filling the next mask (`LogitsConstraints`), off the step's critical path.
    grammar_backlog: list[int] = field(default_factory=list)
    # Greedy with nothing between the logits and their argmax (no logprobs, penalties,
    # logit bias or grammar); min_tokens may still ban stop tokens (`takes_argmax`).
    plain_greedy: bool = field(init=False)

    def __post_init__(self) -> None:
        params = self.sampling_params
        self.plain_greedy = (params.is_greedy and params.logprobs is None and not params.needs_penalties
                             and not params.logit_bias and params.structured_outputs is None)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def takes_argmax(self) -> bool:
        """Its next token is the argmax of the raw logits (`plain_greedy`, past min_tokens)."""
        return self.plain_greedy and len(self.output_token_ids) >= self.sampling_params.min_tokens


class BlockTable:
    """One KV-cache group's block tables, a row per batch slot.

    `ring_size` set means a circular-buffer group: position p lives in
    table entry (p // block_size) % ring_size.
    """

    def __init__(self, max_num_rows: int, max_blocks_per_row: int, block_size: int,
                 ring_size: int | None = None) -> None:
        self.block_size = block_size
        self.ring_size = ring_size
        self.table = np.zeros((max_num_rows, max_blocks_per_row), dtype=np.int64)
        self.num_blocks = np.zeros(max_num_rows, dtype=np.int64)

    @classmethod
    def for_spec(cls, spec: KVCacheSpec, max_num_rows: int, max_model_len: int) -> "BlockTable":
        ring_size = getattr(spec, "blocks_per_request", None)
        max_blocks = ring_size if ring_size is not None else cdiv(max_model_len, spec.block_size)
        return cls(max_num_rows, max_blocks, spec.block_size, ring_size)

    def grow_rows(self, max_num_rows: int) -> None:
        extra = max_num_rows - self.table.shape[0]
        self.table = np.pad(self.table, ((0, extra), (0, 0)))
        self.num_blocks = np.pad(self.num_blocks, (0, extra))

    def set_row(self, row: int, block_ids: list[int]) -> None:
        self.num_blocks[row] = 0
        self.append_to_row(row, block_ids)

    def append_to_row(self, row: int, block_ids: list[int]) -> None:
        start = int(self.num_blocks[row])
        end = start + len(block_ids)
        if end > self.table.shape[1]:
            raise InputPreparationError(
                f"block table row overflow: {end} blocks > {self.table.shape[1]} per request")
        self.table[row, start:end] = block_ids
        self.num_blocks[row] = end

    def block_indices(self, positions: np.ndarray) -> np.ndarray:
        block_indices = positions // self.block_size
        if self.ring_size is not None:
            block_indices %= self.ring_size
        return block_indices

    def slot_mapping(self, rows_per_token: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """KV slot (block_id * block_size + offset) of each token."""
        block_ids = self.table[rows_per_token, self.block_indices(positions)]
        return block_ids * self.block_size + positions % self.block_size

    def rows(self, rows: np.ndarray) -> np.ndarray:
        """The tables of the given rows, cut to the longest of them."""
        width = max(int(self.num_blocks[rows].max()), 1) if len(rows) else 1
        return self.table[rows, :width]


@dataclass
class PreparedBatch:
    """One step's flattened inputs, in the row order the runner chose.

    Requests are laid out back to back: request i owns token slots
    query_start_loc[i]:query_start_loc[i+1]. `sample_mask[i]` is True when
    request i's scheduled tokens reach its last known token (so the step
    samples one token for it); `logits_indices` holds those requests' last
    token slots. A request with `num_draft_tokens[i] = k` draft tokens
    scheduled after its last known token has its last k + 1 slots in
    `logits_indices` (one target distribution per draft, plus the bonus).
    """

    req_ids: list[str]
    rows: np.ndarray
    num_scheduled_tokens: np.ndarray
    num_computed_tokens: np.ndarray
    input_ids: np.ndarray
    positions: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    slot_mappings: list[np.ndarray]
    block_tables: list[np.ndarray]
    sample_mask: np.ndarray
    logits_indices: np.ndarray
    num_draft_tokens: np.ndarray | None = None
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    req_index: np.ndarray | None = None  # [T] request (index into req_ids) of each token

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @property
    def total_draft_tokens(self) -> int:
        """The step's speculative draft tokens, over all its requests."""
        return 0 if self.num_draft_tokens is None else int(self.num_draft_tokens.sum())

    @property
    def sampled_req_ids(self) -> list[str]:
        return [rid for rid, sampled in zip(self.req_ids, self.sample_mask) if sampled]


class InputBatch:
    """Rows of per-request token ids and block tables, updated from scheduler diffs."""

    def __init__(self, kv_cache_specs: list[KVCacheSpec], max_model_len: int,
                 max_num_rows: int = 16) -> None:
        self.max_model_len = max_model_len
        self.token_ids = np.zeros((max_num_rows, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_rows, dtype=np.int64)
        self.block_tables = [BlockTable.for_spec(spec, max_num_rows, max_model_len)
                             for spec in kv_cache_specs]
        self.states: dict[str, RequestState] = {}
        self.req_id_to_row: dict[str, int] = {}
        self._free_rows = list(range(max_num_rows - 1, -1, -1))

    @property
    def num_rows(self) -> int:
        return self.token_ids.shape[0]

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.req_id_to_row

    # ---- applying the scheduler's diff ----------------------------------

    def apply_scheduler_output(self, scheduler_output: SchedulerOutput,
                               make_generator=None) -> None:
        """Drop finished requests, add new/resumed ones, extend running ones' tables."""
        for req_id in scheduler_output.finished_req_ids:
            self.remove_request(req_id)
        for new_req in scheduler_output.scheduled_new_reqs:
            self.add_request(new_req, make_generator)
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, new_block_ids in zip(cached.req_ids, cached.new_block_ids):
            row = self._row_of(req_id)
            if new_block_ids is None:
                continue
            for table, block_ids in zip(self.block_tables, new_block_ids):
                if block_ids:
                    table.append_to_row(row, block_ids)

    def add_request(self, new_req: NewRequestData, make_generator=None) -> None:
        """Add a request, or replace a resumed one's state (keeping its generator)."""
        old_state = self.states.get(new_req.req_id)
        generator = old_state.generator if old_state is not None else None
        if generator is None and make_generator is not None:
            generator = make_generator(new_req.sampling_params)
        row = self.req_id_to_row.get(new_req.req_id)
        if row is None:
            row = self._take_row()
            self.req_id_to_row[new_req.req_id] = row
        state = RequestState(new_req.req_id, list(new_req.prompt_token_ids),
                             new_req.sampling_params, list(new_req.output_token_ids), generator)
        self.states[new_req.req_id] = state
        token_ids = state.prompt_token_ids + state.output_token_ids
        if len(token_ids) > self.max_model_len:
            raise InputPreparationError(
                f"request {new_req.req_id} has {len(token_ids)} tokens > max_model_len {self.max_model_len}")
        self.token_ids[row, :len(token_ids)] = token_ids
        self.num_tokens[row] = len(token_ids)
        if len(new_req.block_ids) != len(self.block_tables):
            raise InputPreparationError(
                f"request {new_req.req_id} has block ids for {len(new_req.block_ids)} groups, "
                f"the model has {len(self.block_tables)}")
        for table, block_ids in zip(self.block_tables, new_req.block_ids):
            table.set_row(row, block_ids)

    def remove_request(self, req_id: str) -> None:
        row = self.req_id_to_row.pop(req_id, None)
        self.states.pop(req_id, None)
        if row is not None:
            self.num_tokens[row] = 0
            for table in self.block_tables:
                table.num_blocks[row] = 0
            self._free_rows.append(row)

    def append_sampled_token(self, req_id: str, token_id: int) -> None:
        row = self.req_id_to_row[req_id]
        position = int(self.num_tokens[row])
        # A token past the context is never fed back: the scheduler finishes the request.
        if position < self.max_model_len:
            self.token_ids[row, position] = token_id
        self.num_tokens[row] = position + 1
        self.states[req_id].output_token_ids.append(token_id)

    # ---- building one step's inputs ------------------------------------

    def prepare(self, scheduler_output: SchedulerOutput,
                skip_req_ids: set[str] | frozenset = frozenset(),
                draft_token_ids: dict[str, list[int]] | None = None) -> PreparedBatch:
        """Flatten the scheduled tokens of every request (but `skip_req_ids`) into one batch;
        `draft_token_ids` replaces the scheduler's drafts (placeholders filled in)."""
        one_decode = self._one_decode_request(scheduler_output, skip_req_ids, draft_token_ids)
        if one_decode is not None:
            return self._prepare_one_decode(*one_decode)
        req_ids, num_computed = self._scheduled_requests(scheduler_output)
        if skip_req_ids:
            kept = [i for i, rid in enumerate(req_ids) if rid not in skip_req_ids]
            req_ids, num_computed = [req_ids[i] for i in kept], [num_computed[i] for i in kept]
        rows = np.array([self._row_of(rid) for rid in req_ids], dtype=np.int64)
        scheduled = scheduler_output.num_scheduled_tokens
        num_sched = np.array([scheduled[rid] for rid in req_ids], dtype=np.int64)
        starts = np.array(num_computed, dtype=np.int64)
        after_drafts = scheduler_output.after_unverified_drafts_req_ids
        if after_drafts:
            # Scheduled before the previous step's accepted drafts were known: start
            # after the last sampled token (its input).
            moved = np.array([rid in after_drafts for rid in req_ids], dtype=bool)
            starts[moved] = self.num_tokens[rows[moved]] - 1
        ends = starts + num_sched
        all_drafts = scheduler_output.scheduled_spec_decode_tokens if draft_token_ids is None else draft_token_ids
        drafts = {rid: all_drafts[rid] for rid in req_ids if rid in all_drafts} if all_drafts else {}
        known = self.num_tokens[rows]
        num_drafts = np.zeros(len(req_ids), dtype=np.int64)
        if drafts:
            num_drafts[:] = [len(drafts.get(rid, ())) for rid in req_ids]
            self._write_drafts(drafts)
            known = known + num_drafts
        if (ends > known).any():
            bad = int(np.argmax(ends > known))
            raise InputPreparationError(
                f"request {req_ids[bad]} is scheduled up to token {int(ends[bad])}, "
                f"but the runner knows only {int(known[bad])} of its tokens")
        sample_mask = ends == known
        prepared = self._flatten(req_ids, rows, starts, num_sched, sample_mask, num_drafts)
        prepared.draft_token_ids = drafts
        return prepared

    @staticmethod
    def _one_decode_request(scheduler_output: SchedulerOutput, skip_req_ids,
                            draft_token_ids: dict[str, list[int]] | None) -> tuple[str, int] | None:
        """(request id, computed tokens) when the step is one running request's one token with
        no drafts (a single stream's decode step), else None."""
        cached = scheduler_output.scheduled_cached_reqs
        if (scheduler_output.scheduled_new_reqs or len(cached.req_ids) != 1
                or scheduler_output.total_num_scheduled_tokens != 1 or scheduler_output.scheduled_spec_decode_tokens
                or draft_token_ids or scheduler_output.after_unverified_drafts_req_ids):
            return None
        req_id = cached.req_ids[0]
        return None if req_id in skip_req_ids else (req_id, cached.num_computed_tokens[0])

    def _prepare_one_decode(self, req_id: str, start: int) -> PreparedBatch:
        """`prepare` of one request's one token at position `start`, from plain ints: the
        same batch as `_flatten` builds, without its two dozen array operations (at batch
        one they are most of the step's input preparation)."""
        row = self._row_of(req_id)
        known = int(self.num_tokens[row])
        if start >= known:
            raise InputPreparationError(f"request {req_id} is scheduled up to token {start + 1}, "
                                        f"but the runner knows only {known} of its tokens")
        sampled = start + 1 == known
        positions = np.array([start], dtype=np.int64)
        slot_mappings, block_tables = [], []
        for table in self.block_tables:
            block_index = start // table.block_size
            if table.ring_size is not None:
                block_index %= table.ring_size
            slot = int(table.table[row, block_index]) * table.block_size + start % table.block_size
            slot_mappings.append(np.array([slot], dtype=np.int64))
            block_tables.append(table.table[row:row + 1, :max(int(table.num_blocks[row]), 1)].copy())
        return PreparedBatch(
            req_ids=[req_id], rows=np.array([row], dtype=np.int64), num_scheduled_tokens=np.ones(1, dtype=np.int64),
            num_computed_tokens=positions, input_ids=self.token_ids[row, start:start + 1].copy(), positions=positions,
            query_start_loc=np.array([0, 1], dtype=np.int64), seq_lens=positions + 1, slot_mappings=slot_mappings,
            block_tables=block_tables, sample_mask=np.array([sampled]),
            logits_indices=np.zeros(int(sampled), dtype=np.int64), num_draft_tokens=np.zeros(1, dtype=np.int64),
            req_index=np.zeros(1, dtype=np.int64))

    def prepare_tokens(self, req_ids: list[str], starts: np.ndarray, token_ids: list[np.ndarray]) -> PreparedBatch:
        """A batch of given tokens: request i's `token_ids[i]` at positions from `starts[i]`,
        on its block tables (a draft model's pass over tokens the scheduler did not
        schedule as such). Each request's last token is a logits row."""
        rows = np.array([self._row_of(rid) for rid in req_ids], dtype=np.int64)
        num_tokens = np.array([len(tokens) for tokens in token_ids], dtype=np.int64)
        return self._flatten(list(req_ids), rows, np.asarray(starts, dtype=np.int64), num_tokens,
                             np.ones(len(req_ids), dtype=bool), None, np.concatenate(token_ids).astype(np.int64))

    def _flatten(self, req_ids: list[str], rows: np.ndarray, starts: np.ndarray, num_tokens: np.ndarray,
                 sample_mask: np.ndarray, num_drafts: np.ndarray | None,
                 input_ids: np.ndarray | None = None) -> PreparedBatch:
        """The flat batch of request i's tokens starts[i]:starts[i] + num_tokens[i] (input ids
        read from its row unless given); logits rows: the last 1 + num_drafts[i] tokens of the
        sampled requests."""
        cu_num_tokens = np.cumsum(num_tokens)
        total = int(cu_num_tokens[-1]) if len(cu_num_tokens) else 0
        query_start_loc = np.zeros(len(rows) + 1, dtype=np.int64)
        query_start_loc[1:] = cu_num_tokens
        if total == len(rows):  # one token per request (decode): no per-token expansion
            req_index, rows_per_token, positions = np.arange(total), rows, starts
        else:
            req_index = np.repeat(np.arange(len(rows)), num_tokens)
            rows_per_token = rows[req_index]
            positions = starts[req_index] + (np.arange(total) - query_start_loc[req_index])
        if num_drafts is None or not num_drafts.any():
            logits_indices = cu_num_tokens[sample_mask] - 1
        else:
            logits_indices = _last_slots(cu_num_tokens[sample_mask], 1 + num_drafts[sample_mask])
        return PreparedBatch(
            req_ids=req_ids, rows=rows, num_scheduled_tokens=num_tokens, num_computed_tokens=starts,
            input_ids=self.token_ids[rows_per_token, positions] if input_ids is None else input_ids,
            positions=positions,
            query_start_loc=query_start_loc, seq_lens=starts + num_tokens,
            slot_mappings=[t.slot_mapping(rows_per_token, positions) for t in self.block_tables],
            block_tables=[t.rows(rows) for t in self.block_tables],
            sample_mask=sample_mask, logits_indices=logits_indices, num_draft_tokens=num_drafts,
            req_index=req_index,
        )

    def _write_drafts(self, drafts: dict[str, list[int]]) -> None:
        """Put draft tokens after each request's known tokens (without counting them as
        known): the forward pass reads them there, accepted ones are appended later."""
        for req_id, draft in drafts.items():
            row = self._row_of(req_id)
            start = int(self.num_tokens[row])
            if start + len(draft) > self.max_model_len:
                raise InputPreparationError(
                    f"request {req_id}: {len(draft)} draft tokens after {start} overflow max_model_len")
            self.token_ids[row, start:start + len(draft)] = draft

    @staticmethod
    def _scheduled_requests(scheduler_output: SchedulerOutput) -> tuple[list[str], list[int]]:
        req_ids = [r.req_id for r in scheduler_output.scheduled_new_reqs]
        num_computed = [r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        req_ids.extend(cached.req_ids)
        num_computed.extend(cached.num_computed_tokens)
        return req_ids, num_computed

    def _row_of(self, req_id: str) -> int:
        row = self.req_id_to_row.get(req_id)
        if row is None:
            raise InputPreparationError(f"request {req_id} is scheduled but unknown to the runner")
        return row

    def _take_row(self) -> int:
        if not self._free_rows:
            self._grow(2 * self.num_rows)
        return self._free_rows.pop()

    def _grow(self, max_num_rows: int) -> None:
        old = self.num_rows
        self.token_ids = np.pad(self.token_ids, ((0, max_num_rows - old), (0, 0)))
        self.num_tokens = np.pad(self.num_tokens, (0, max_num_rows - old))
        for table in self.block_tables:
            table.grow_rows(max_num_rows)
        self._free_rows.extend(range(max_num_rows - 1, old - 1, -1))


def _last_slots(ends: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The last counts[i] token slots before ends[i], request after request."""
    offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    return np.repeat(ends - counts, counts) + offsets
