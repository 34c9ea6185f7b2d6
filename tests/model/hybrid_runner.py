"""A hand-driven runner for hybrid (attention + recurrent state) DecoderModels: attention
blocks and state slots allocated by hand, no scheduler, the state group's `StateMetadata`
made here as the runner makes it (snapshots at block boundaries, a running slot per request).

Each request holds a running slot (read at the start of a step and rewritten at its end)
and a snapshot slot per block-size boundary its prompt crosses; a request may start from
another's snapshot (a prefix hit), reading it and writing only its own slots."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvserve.kv_cache.interface import FullAttentionSpec, StateSpec
from kvserve.model.attention import AttentionMetadata
from kvserve.model.attention.metadata import StateMetadata


@dataclass
class _HybridRequest:
    tokens: list[int]
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)  # attention blocks
    running_slot: int = -1
    start_slot: int = -1  # the slot its first step reads (-1: zeros)
    snapshots: dict[int, int] = field(default_factory=dict)  # boundary (tokens) -> slot


class HybridRunner:
    """Drives a model with "full" attention layers and state layers (one group each)."""

    def __init__(self, model, block_size: int = 4, num_blocks: int = 256) -> None:
        self.model = model
        self.block_size = block_size
        self.specs = model.kv_cache_specs(block_size)
        self.attention_layers = [n for n, s in self.specs.items() if isinstance(s, FullAttentionSpec)]
        self.state_layers = [n for n, s in self.specs.items() if isinstance(s, StateSpec)]
        assert len(self.attention_layers) + len(self.state_layers) == len(self.specs)
        self.kv_caches: dict[str, object] = {}
        for name in self.attention_layers:
            spec = self.specs[name]
            self.kv_caches[name] = torch.zeros(2, spec.num_kv_heads, num_blocks, block_size, spec.head_size)
        for name in self.state_layers:
            self.kv_caches[name] = tuple(torch.zeros(num_blocks, *shape) for shape in self.specs[name].shapes)
        self.next_block, self.next_slot, self.num_blocks = 1, 1, num_blocks
        self.requests: dict[str, _HybridRequest] = {}
        # Group 0: attention, group 1: states.
        model.layer_group_ids = [1 if n in self.state_layers else 0 for n in model.layer_names]

    def _take(self, kind: str) -> int:
        value = self.next_block if kind == "block" else self.next_slot
        if value >= self.num_blocks:
            raise RuntimeError("HybridRunner: out of blocks")
        if kind == "block":
            self.next_block += 1
        else:
            self.next_slot += 1
        return value

    def add(self, req_id: str, prompt: list[int], hit_from: str | None = None, hit_tokens: int = 0) -> None:
        """A request; with `hit_from`, its first `hit_tokens` (a block boundary) are a prefix hit
        on that request's attention blocks and state snapshot."""
        req = _HybridRequest(list(prompt))
        req.running_slot = self._take("slot")
        if hit_from is not None:
            source = self.requests[hit_from]
            req.blocks = source.blocks[:hit_tokens // self.block_size]
            req.start_slot = source.snapshots[hit_tokens]
            req.num_computed = hit_tokens
        self.requests[req_id] = req

    def step(self, schedule: dict[str, int]) -> dict[str, torch.Tensor]:
        """Run `schedule[req_id]` tokens of each request; logits of each one's last token."""
        input_ids, positions, query_lens, seq_lens = [], [], [], []
        read_slot, writes = [], []
        for i, (req_id, n) in enumerate(schedule.items()):
            req = self.requests[req_id]
            start = req.num_computed
            input_ids += req.tokens[start:start + n]
            positions += list(range(start, start + n))
            query_lens.append(n)
            seq_lens.append(start + n)
            while len(req.blocks) * self.block_size < start + n:
                req.blocks.append(self._take("block"))
            read_slot.append(req.start_slot)
            for boundary in range((start // self.block_size + 1) * self.block_size, start + n + 1, self.block_size):
                req.snapshots[boundary] = self._take("slot")
                writes.append((i, boundary - start, req.snapshots[boundary]))
            writes.append((i, n, req.running_slot))
            req.start_slot = req.running_slot
        width = max(len(self.requests[r].blocks) for r in schedule)
        table = torch.tensor([self.requests[r].blocks + [0] * (width - len(self.requests[r].blocks))
                              for r in schedule])
        attention = AttentionMetadata.build(self.specs[self.attention_layers[0]], query_lens, seq_lens, table)
        state = StateMetadata(
            query_start_loc=attention.query_start_loc, seq_lens=attention.seq_lens,
            read_slot=torch.tensor(read_slot), write_req=torch.tensor([w[0] for w in writes]),
            write_after=torch.tensor([w[1] for w in writes]), write_slot=torch.tensor([w[2] for w in writes]),
            max_query_len=max(query_lens), max_seq_len=max(seq_lens), spec=self.specs[self.state_layers[0]])
        rows = torch.tensor(query_lens).cumsum(0) - 1
        with torch.inference_mode():
            logits = self.model.forward_logits(torch.tensor(input_ids), torch.tensor(positions), [attention, state],
                                               self.kv_caches, rows)
        for req_id, n in schedule.items():
            self.requests[req_id].num_computed += n
        return {req_id: logits[i] for i, req_id in enumerate(schedule)}

    def append(self, req_id: str, token: int) -> None:
        self.requests[req_id].tokens.append(token)

