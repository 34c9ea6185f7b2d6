"""A hand-driven runner for hybrid models (full attention + Gated DeltaNet state layers):
block tables and state slots allocated by hand, no scheduler, no KV manager.

Each request has a running state slot, read at the start of every step after its first
(-1, zeros, on its first) and written after its last token; a prompt crossing a multiple of
the block size also writes the state after that token into a fresh snapshot slot, as the
state group's prefix caching asks. A request added `from_snapshot` of another starts at one
of that request's boundaries: it shares its attention blocks up to there and copies the
snapshot into its own running slot (never writing into the snapshot)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvserve.kv_cache.interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, StateSpec
from kvserve.model.attention import AttentionMetadata, StateMetadata
from kvserve.worker.kv_tensors import kv_cache_shape

@dataclass
class _Request:
    tokens: list[int]
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)
    slot: int = -1  # running state slot (-1: none yet)
    snapshots: dict[int, int] = field(default_factory=dict)  # token count -> slot


class HybridRunner:
    """Runs steps of a hybrid `DecoderModel` (see the module docstring)."""

    def __init__(self, model, block_size: int = 4, num_blocks: int = 256) -> None:
        self.model, self.block_size = model, block_size
        specs = model.kv_cache_specs(block_size)
        attention = [n for n, s in specs.items() if isinstance(s, FullAttentionSpec)]
        states = [n for n, s in specs.items() if isinstance(s, StateSpec)]
        assert len(attention) + len(states) == len(specs)
        groups = [KVCacheGroupSpec(attention, specs[attention[0]]), KVCacheGroupSpec(states, specs[states[0]])]
        model.bind_kv_cache_config(KVCacheConfig(num_blocks, [], groups))
        self.kv_caches = {n: torch.zeros(kv_cache_shape(specs[n], num_blocks)) for n in attention}
        self.kv_caches.update({n: tuple(torch.zeros(num_blocks, *shape) for shape in specs[n].shapes)
                               for n in states})
        self.attention_spec, self.state_spec = specs[attention[0]], specs[states[0]]
        self.num_blocks, self.next_block, self.next_slot = num_blocks, 1, 0
        self.requests: dict[str, _Request] = {}

    def _new(self, kind: str) -> int:
        attr = "next_block" if kind == "block" else "next_slot"
        value = getattr(self, attr)
        assert value < self.num_blocks, f"out of {kind}s"
        setattr(self, attr, value + 1)
        return value

    def add(self, req_id: str, prompt: list[int], from_snapshot: tuple[str, int] | None = None) -> None:
        """A new request; `from_snapshot` (other request, token count at one of its boundaries):
        start there, as a prefix-cache hit does."""
        req = _Request(list(prompt))
        if from_snapshot is not None:
            other_id, count = from_snapshot
            other = self.requests[other_id]
            assert count % self.block_size == 0 and prompt[:count] == other.tokens[:count]
            req.blocks = other.blocks[:count // self.block_size]
            req.num_computed, req.slot = count, self._new("slot")
            for name, (conv, delta) in self._state_caches():
                conv[req.slot], delta[req.slot] = conv[other.snapshots[count]], delta[other.snapshots[count]]
        self.requests[req_id] = req

    def drop_state(self, req_id: str) -> None:
        """Forget a request's computed tokens and state (a preemption): it recomputes from zeros."""
        req = self.requests[req_id]
        req.num_computed, req.slot, req.snapshots = 0, -1, {}

    def _state_caches(self):
        return ((n, c) for n, c in self.kv_caches.items() if isinstance(c, tuple))

    def step(self, schedule: dict[str, int]) -> dict[str, torch.Tensor]:
        """Run `schedule[req_id]` tokens of each request; the logits after each one's last token."""
        input_ids, positions, query_lens, seq_lens, tables = [], [], [], [], []
        read, write_req, write_after, write_slot = [], [], [], []
        for r, (req_id, n) in enumerate(schedule.items()):
            req = self.requests[req_id]
            start = req.num_computed
            input_ids += req.tokens[start:start + n]
            positions += range(start, start + n)
            query_lens.append(n)
            seq_lens.append(start + n)
            while len(req.blocks) * self.block_size < start + n:
                req.blocks.append(self._new("block"))
            tables.append(req.blocks)
            read.append(req.slot if start > 0 else -1)
            if req.slot < 0:
                req.slot = self._new("slot")
            for boundary in range(start // self.block_size + 1, (start + n) // self.block_size + 1):
                count = boundary * self.block_size
                req.snapshots[count] = self._new("slot")
                write_req.append(r), write_after.append(count - start), write_slot.append(req.snapshots[count])
            write_req.append(r), write_after.append(n), write_slot.append(req.slot)
        width = max(map(len, tables))
        block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        attention = AttentionMetadata.build(self.attention_spec, query_lens, seq_lens, block_table, "cpu")
        as_long = lambda values: torch.tensor(values, dtype=torch.int64)  # noqa: E731
        state = StateMetadata(query_start_loc=as_long([0, *torch.tensor(query_lens).cumsum(0).tolist()]),
                              seq_lens=as_long(seq_lens), read_slot=as_long(read), write_req=as_long(write_req),
                              write_after=as_long(write_after), write_slot=as_long(write_slot),
                              max_query_len=max(query_lens), max_seq_len=max(seq_lens), spec=self.state_spec)
        rows = torch.tensor(query_lens).cumsum(0) - 1
        with torch.inference_mode():
            logits = self.model.forward_logits(torch.tensor(input_ids), torch.tensor(positions), [attention, state],
                                               self.kv_caches, rows)
        for req_id, n in schedule.items():
            self.requests[req_id].num_computed += n
        return {req_id: logits[i] for i, req_id in enumerate(schedule)}

    def run_greedy(self, prompts: dict[str, list[int]], max_new_tokens: int, chunk: int,
                   ) -> tuple[dict[str, list[int]], dict[str, list[torch.Tensor]]]:
        """Continuous batching by hand: each step gives every prefilling request up to `chunk`
        prompt tokens and every decoding one a token; greedy. (tokens, logits) per request."""
        for req_id, prompt in prompts.items():
            if req_id not in self.requests:
                self.add(req_id, prompt)
        tokens = {r: [] for r in prompts}
        logits = {r: [] for r in prompts}
        while any(len(t) < max_new_tokens for t in tokens.values()):
            schedule = {r: min(chunk, len(self.requests[r].tokens) - self.requests[r].num_computed)
                        for r in prompts if len(tokens[r]) < max_new_tokens}
            out = self.step(schedule)
            for req_id in schedule:
                req = self.requests[req_id]
                if req.num_computed == len(req.tokens):
                    tokens[req_id].append(int(out[req_id].argmax()))
                    logits[req_id].append(out[req_id])
                    req.tokens.append(tokens[req_id][-1])
        return tokens, logits
