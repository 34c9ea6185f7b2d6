"""Property test: random traces of admit / schedule / run a step / free / pop and
free later / CoW take and release, over one, two and three KV-cache groups.

Besides the pool's own invariants, the trace keeps an independent model of
what each block physically holds: a step first applies the CoW copies, then
writes the KV of every scheduled token into its table slot, and then every
scheduled request must find its own tokens in every slot its attention reads
(all earlier positions; the window for a sliding-window group). A wrong hit,
a copy from unwritten content, or a block handed out while still in use all
show up as a mismatch.

A state group's slot holds the state after some prefix of some sequence: a step
reads (before any write of the step) the slot that must hold exactly its own
computed prefix, and writes its boundary snapshots and running state; a slot
written by one request is never read or written by another in the same step. A
wrong snapshot hit, a snapshot overwritten after caching, or a state block reused
while held all show up as a mismatch.
"""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvserve.kv_cache.interface import CircularBufferSpec, SlidingWindowSpec, StateSpec

from helpers.kv_blocks import state_step_slots
from kv_helpers import circular_spec, full_spec, holder_counts, ids, make_manager, sliding_spec, state_spec

_BASES = [[random.Random(seed).randrange(1, 6) for _ in range(40)] for seed in range(3)]


class KVCacheTrace(RuleBasedStateMachine):
    specs = [full_spec(4)]
    hash_block_size = 4
    num_blocks = 24
    num_state_blocks = 0  # > 0: the state groups' own pool
    chunk_sizes = st.sampled_from([3, 8, 64])

    @initialize()
    def setup(self) -> None:
        self.manager = make_manager(self.specs, num_blocks=self.num_blocks, hash_block_size=self.hash_block_size,
                                    num_state_blocks=self.num_state_blocks)
        self.running: dict[str, object] = {}
        self.scheduled: dict[str, tuple[object, int, tuple[list[int], ...]]] = {}
        self.deferred: list[tuple[int, list]] = []   # (fence step, blocks in eviction order)
        self.retained: list[tuple[int, list]] = []
        self.content: dict[int, list] = {}
        self.state_content: dict[int, tuple] = {}  # state slot -> the prefix whose state it holds
        self.num_steps = 0
        self.next_id = 0

    # ---------------------------------------------------------------- helpers

    def _snapshot(self):
        pools = self.manager.block_pool.pools
        return [ids(p.free_block_queue.get_all_free_blocks()) for p in pools], [
            [b.ref_cnt for b in p.blocks] for p in pools], {
            i: list(m.req_to_blocks.get(rid, [])) for i, m in enumerate(self.manager.coordinator.single_type_managers)
            for rid in list(m.req_to_blocks)}

    def _schedule(self, request, num_new_tokens: int, hit_blocks=None, num_hit: int = 0) -> bool:
        before = self._snapshot()
        new_blocks = self.manager.allocate_slots(request, num_new_tokens, num_hit, hit_blocks)
        if new_blocks is None:
            # Sliding-window and state groups release blocks no step reads (and a state
            # group caches the processed snapshots first) even when the allocation then
            # fails (they count as free space); nothing else changes.
            if not any(isinstance(spec, (SlidingWindowSpec, StateSpec)) for spec in self._group_specs()):
                assert self._snapshot() == before, "a failed allocation changed state"
            return False
        request.num_computed_tokens += num_hit
        self.scheduled[request.request_id] = (request, num_new_tokens, self.manager.get_block_ids(request.request_id))
        return True

    # ---------------------------------------------------------------- rules

    @rule(base=st.integers(0, 2), prefix_len=st.integers(0, 40), suffix=st.lists(st.integers(1, 5), max_size=6),
          chunk=chunk_sizes)
    def admit(self, base, prefix_len, suffix, chunk) -> None:
        prompt = _BASES[base][:prefix_len] + suffix
        if not prompt:
            return
        request = self.manager.new_request(str(self.next_id), prompt)
        self.next_id += 1
        hit_blocks, num_hit = self.manager.get_computed_blocks(request)
        assert 0 <= num_hit <= request.num_tokens - 1
        if num_hit:
            assert num_hit % self.hash_block_size == 0
        if self._schedule(request, min(chunk, request.num_tokens - num_hit), hit_blocks, num_hit):
            self.running[request.request_id] = request

    @precondition(lambda self: self.running)
    @rule(data=st.data(), chunk=chunk_sizes)
    def schedule_running(self, data, chunk) -> None:
        request = self.running[data.draw(st.sampled_from(sorted(self.running)))]
        if request.request_id in self.scheduled:
            return
        remaining = request.num_tokens - request.num_computed_tokens
        self._schedule(request, min(chunk, remaining) if remaining else 1)

    @rule(output_token=st.integers(1, 5))
    def run_step(self, output_token) -> None:
        copies, retained = self.manager.take_kv_cache_block_copies()
        self.num_steps += 1
        if retained:
            self.retained.append((self.num_steps, retained))
        for copy in copies:
            source = self.content.get(copy.src_block_id, [])
            assert len(source) >= copy.num_tokens and None not in source[:copy.num_tokens], "copy of unwritten KV"
            dst = self.content.setdefault(copy.dst_block_id, [])
            dst[:copy.num_tokens] = source[:copy.num_tokens]
        self._run_state_layers()
        for request, num_tokens, tables in self.scheduled.values():
            self._write(request, num_tokens, tables)
        for request, num_tokens, tables in self.scheduled.values():
            self._check_reads(request, num_tokens, tables)
        for request, num_tokens, _ in self.scheduled.values():
            request.num_computed_tokens += num_tokens
            if request.num_computed_tokens >= request.num_tokens:
                request.append_output_token_ids(output_token)
        self.scheduled.clear()

    def _group_specs(self):
        return [group.kv_cache_spec for group in self.manager.kv_cache_config.kv_cache_groups]

    def _run_state_layers(self) -> None:
        """Every state read of the step, then its writes (as a layer does)."""
        for group, spec in enumerate(self._group_specs()):
            if not isinstance(spec, StateSpec):
                continue
            writes, touched = [], {}
            for request, num_tokens, tables in self.scheduled.values():
                start, tokens = request.num_computed_tokens, request.all_token_ids
                read, request_writes = state_step_slots(spec.block_size, start, num_tokens, tables[group])
                if read is not None:
                    assert read != 0, f"request {request.request_id} reads its state from the null block"
                    assert self.state_content.get(read) == tuple(tokens[:start]), (
                        f"request {request.request_id} reads a wrong state from slot {read}")
                for length, slot in request_writes:
                    assert slot != 0, "a running state's slot is the null block"
                    writes.append((slot, tuple(tokens[:length])))
                for slot in {read, *(slot for _, slot in request_writes)} - {None}:
                    touched.setdefault(slot, set()).add(request.request_id)
            written = {slot for slot, _ in writes}
            assert all(len(touched[slot]) == 1 for slot in written), "two requests share a slot one writes"
            for slot, prefix in writes:
                self.state_content[slot] = prefix

    def _write(self, request, num_tokens, tables) -> None:
        start = request.num_computed_tokens
        for spec, table in zip(self._group_specs(), tables):
            if isinstance(spec, (CircularBufferSpec, StateSpec)):
                continue
            for pos in range(start, start + num_tokens):
                block_id = table[pos // spec.block_size]
                assert block_id != 0, "a scheduled token's slot is the null block"
                slots = self.content.setdefault(block_id, [])
                slots.extend([None] * (spec.block_size - len(slots)))
                slots[pos % spec.block_size] = request.all_token_ids[pos]

    def _check_reads(self, request, num_tokens, tables) -> None:
        start, end = request.num_computed_tokens, request.num_computed_tokens + num_tokens
        for spec, table in zip(self._group_specs(), tables):
            if isinstance(spec, (CircularBufferSpec, StateSpec)):
                continue
            first = max(0, start - spec.sliding_window + 1) if isinstance(spec, SlidingWindowSpec) else 0
            for pos in range(first, end):
                block_id = table[pos // spec.block_size]
                slots = self.content.get(block_id, [])
                held = slots[pos % spec.block_size] if pos % spec.block_size < len(slots) else None
                assert block_id != 0 and held == request.all_token_ids[pos], (
                    f"request {request.request_id} reads position {pos} from block {block_id}: {held!r}")

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def free_now(self, data) -> None:
        idle = sorted(rid for rid in self.running if rid not in self.scheduled)
        if idle:
            self.manager.free(self.running.pop(data.draw(st.sampled_from(idle))))

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def pop_and_free_later(self, data) -> None:
        request = self.running.pop(data.draw(st.sampled_from(sorted(self.running))))
        expected = [block for table in self.manager.get_blocks(request.request_id).blocks
                    for block in reversed([b for b in table if not b.is_null])]
        popped = self.manager.pop_blocks_for_free(request)
        assert popped == expected
        # Its scheduled tokens still run this step: free after the step is done.
        self.deferred.append((self.num_steps + 1, popped))

    @rule()
    def release_fenced(self) -> None:
        for queue in (self.deferred, self.retained):
            while queue and queue[0][0] <= self.num_steps:
                self.manager.block_pool.free_blocks(queue.pop(0)[1])

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def cache_computed(self, data) -> None:
        request = self.running[data.draw(st.sampled_from(sorted(self.running)))]
        self.manager.cache_blocks(request, request.num_computed_tokens)

    @rule()
    def reset_prefix_cache(self) -> None:
        pools = self.manager.block_pool.pools
        idle = all(pool.get_num_free_blocks() == pool.num_gpu_blocks - 1 for pool in pools)
        assert self.manager.reset_prefix_cache() == idle
        if idle:
            assert not any(pool.cached_block_hash_to_block for pool in pools)

    # ---------------------------------------------------------------- invariants

    @invariant()
    def bookkeeping_is_consistent(self) -> None:
        extra = [block for _, blocks in self.deferred + self.retained for block in blocks]
        for pool in self.manager.block_pool.pools:
            holders = holder_counts(self.manager, extra, pool)
            pool.check_invariants(holders)
            assert pool.get_num_free_blocks() + len(holders) == pool.num_gpu_blocks - 1

    def teardown(self) -> None:
        if not hasattr(self, "manager"):
            return
        self.scheduled.clear()
        for request in list(self.running.values()):
            self.manager.free(request)
        _, retained = self.manager.take_kv_cache_block_copies()
        pool = self.manager.block_pool
        for _, blocks in self.deferred + self.retained:
            pool.free_blocks(blocks)
        pool.free_blocks(retained)
        for each in pool.pools:
            each.check_invariants({})
            assert each.get_num_free_blocks() == each.num_gpu_blocks - 1
        assert self.manager.usage == 0.0
        assert self.manager.reset_prefix_cache()
        assert all(block.block_hash is None for each in pool.pools for block in each.blocks)


class OneGroupCoW(KVCacheTrace):
    hash_block_size = 2


class FullAndSlidingWindow(KVCacheTrace):
    specs = [full_spec(4), sliding_spec(4, window=8)]
    num_blocks = 40


class TwoFullGroupsCoW(KVCacheTrace):
    specs = [full_spec(4), full_spec(8)]
    hash_block_size = 2
    num_blocks = 40


class FullAndCircular(KVCacheTrace):
    specs = [full_spec(4), circular_spec(4, window=8)]
    num_blocks = 32


class FullSlidingAndState(KVCacheTrace):
    specs = [full_spec(4), sliding_spec(4, window=8), state_spec(4)]
    num_blocks = 48


class FullSlidingAndSplitState(KVCacheTrace):
    """The state group in a pool of its own (#29), short enough to run out: state slot ids
    reuse the attention ids, frees of mixed lists reach the right pool."""
    specs = [full_spec(4), sliding_spec(4, window=8), state_spec(4)]
    num_blocks = 32
    num_state_blocks = 14


class StateOnly(KVCacheTrace):
    specs = [state_spec(4)]
    num_blocks = 24


_SETTINGS = settings(max_examples=40, stateful_step_count=40, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@pytest.mark.parametrize("machine", [KVCacheTrace, OneGroupCoW, FullAndSlidingWindow, TwoFullGroupsCoW,
                                     FullAndCircular, FullSlidingAndState, FullSlidingAndSplitState, StateOnly],
                         ids=lambda m: m.__name__)
def test_random_traces_keep_invariants(machine):
    machine.TestCase.settings = _SETTINGS
    machine.TestCase().runTest()
