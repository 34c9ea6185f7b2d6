"""Seeded random traces: arrivals, aborts, pauses, preemption-forcing KV sizes,
and async steps whose outputs arrive one step late. After every operation:

- no block is handed out (or sits in the free queue) while an unprocessed
  step that referenced it exists;
- every deferred free is exactly the immediate path's blocks in its order,
  and is later freed as-is, oldest first;
- ref counts equal the holders (request tables + parked lists);
- with a recurrent-state group: every state slot a step reads or writes is
  held until that step is processed, and a slot one request writes is read or
  written by no other request of the same or an unprocessed step;
and at the end, once every request ended and the fences drained, the pool
is whole and the outputs match the oracle.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.kv_blocks import state_step_slots
from kvserve.kv_cache.interface import FullAttentionSpec, SlidingWindowSpec, StateSpec
from kvserve.request import RequestStatus
from kvserve.spec_decode.config import SpeculativeConfig
from kvserve.testing import FakeModelRunner, StepDriver, create_requests, create_scheduler

from oracle import assert_pool_whole, expected_result

EOS = 7

_ADD = st.tuples(st.just("add"), st.integers(1, 48), st.integers(1, 24), st.integers(0, 2),
                 st.integers(0, 3), st.booleans())
_OPS = st.one_of(
    st.just(("step",)),
    _ADD,
    st.just(("schedule",)),
    st.just(("process",)),
    st.tuples(st.just("abort"), st.integers(0, 10_000)),
    st.tuples(st.just("pause"), st.sampled_from(["abort", "wait", "keep"])),
    st.just(("resume",)),
)


@dataclass
class Trace:
    num_blocks: int
    block_size: int
    hash_block_size: int | None
    budget: int
    max_num_seqs: int
    async_steps: bool
    policy: str
    ops: list = field(default_factory=list)
    # A second, sliding-window group (its out-of-window blocks are released
    # while the request runs, which only unprocessed *window* reads constrain).
    hybrid: bool = False
    # Prompt-lookup drafts of up to this many tokens (0: no speculation), over
    # outputs that mostly repeat, so drafts are partly accepted and rolled back.
    num_spec_tokens: int = 0
    # Drafts from a (fake) draft model in the runner, scheduled ahead under async.
    draft_model: bool = False
    # A third, recurrent-state group (with `hybrid`; never with speculation, which the
    # runner refuses for state layers).
    state: bool = False
    # > 0: the state group draws its slots from a pool of its own of this many blocks.
    num_state_blocks: int = 0


@st.composite
def traces(draw) -> Trace:
    block_size = draw(st.sampled_from([4, 8, 16]))
    hybrid, state = draw(st.booleans()), draw(st.booleans())
    return Trace(
        # Small pools: a handful of requests at once forces preemption.
        num_blocks=draw(st.integers(5, 96 // block_size + 8)),
        block_size=block_size,
        hash_block_size=draw(st.sampled_from([None, block_size // 2])),
        budget=draw(st.integers(8, 80)),
        max_num_seqs=draw(st.integers(2, 6)),
        async_steps=draw(st.booleans()),
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        ops=draw(st.lists(_ADD, min_size=2, max_size=8)) + draw(st.lists(_OPS, min_size=10, max_size=80)),
        hybrid=hybrid,
        num_spec_tokens=0 if hybrid and state else draw(st.sampled_from([0, 0, 1, 3, 5])),
        draft_model=draw(st.booleans()),
        state=state,
        num_state_blocks=draw(st.sampled_from([0, 0, 8, 24])) if hybrid and state else 0,
    )


class FenceChecker:
    """Watches the KV cache under a scheduler and checks the fence rules."""

    def __init__(self, scheduler, driver: StepDriver) -> None:
        self.scheduler = scheduler
        self.driver = driver
        self.kv = scheduler.kv_cache_manager
        self.pool = self.kv.block_pool
        # The pool the state slots come from (the main pool unless the layout splits).
        self.state_pool = self.pool.state_pool or self.pool
        self.handed_out: list[int] = []
        self.state_handed_out: list[int] = []
        self.free_calls: list[list[int]] = []
        self.parked_lists: set[int] = set()
        # Step sequence number -> the whole group-0 tables of the requests it schedules.
        self.tables_by_step: dict[int, set[int]] = {}
        # Step sequence number -> {request id: (state slots it reads or writes, slots it writes)}.
        self.state_slots_by_step: dict[int, dict[str, tuple[set[int], set[int]]]] = {}
        self._wrap()

    def _wrap(self) -> None:
        pool, kv = self.pool, self.kv
        get_new_blocks, free_blocks = pool.get_new_blocks, pool.free_blocks
        pop_blocks_for_free, take_copies = kv.pop_blocks_for_free, kv.take_kv_cache_block_copies

        def get_new_blocks_spy(num_blocks):
            blocks = get_new_blocks(num_blocks)
            self.handed_out.extend(b.block_id for b in blocks)
            return blocks

        def free_blocks_spy(ordered_blocks):
            ordered_blocks = list(ordered_blocks)
            self.free_calls.append([b.block_id for b in ordered_blocks])
            return free_blocks(ordered_blocks)

        def pop_spy(request):
            tables = [list(m.req_to_blocks.get(request.request_id, []))
                      for m in kv.coordinator.single_type_managers]
            # The immediate path frees each group's table (nulls skipped) tail first.
            expected = [b for table in tables for b in reversed(table) if not b.is_null]
            blocks = pop_blocks_for_free(request)
            assert [b.block_id for b in blocks] == [b.block_id for b in expected]
            self.parked_lists.add(id(blocks))
            return blocks

        def take_copies_spy():
            copies, retained = take_copies()
            self.parked_lists.add(id(retained))
            return copies, retained

        pool.get_new_blocks, pool.free_blocks = get_new_blocks_spy, free_blocks_spy
        if pool.state_pool is not None:
            get_new_slots = pool.state_pool.get_new_blocks

            def get_new_slots_spy(num_blocks):
                blocks = get_new_slots(num_blocks)
                self.state_handed_out.extend(b.block_id for b in blocks)
                return blocks

            pool.state_pool.get_new_blocks = get_new_slots_spy
        kv.pop_blocks_for_free, kv.take_kv_cache_block_copies = pop_spy, take_copies_spy

    def referenced_by_unprocessed_steps(self, exclude_last: bool = False) -> set[int]:
        steps = list(self.driver.in_flight)[:-1] if exclude_last else self.driver.in_flight
        return {block_id for out, _ in steps for block_id in self.step_block_ids(out)}

    def step_block_ids(self, out) -> set[int]:
        """Blocks of the full-attention group (0) and CoW endpoints the step touches."""
        ids = set(self.tables_by_step[out.step_seq])
        for copy in out.kv_cache_block_copies:
            ids.update((copy.src_block_id, copy.dst_block_id))
        ids.discard(0)
        return ids

    def run_op(self, op) -> None:
        before = [(fence, [b.block_id for b in blocks]) for fence, blocks in self.scheduler.deferred_frees]
        self.handed_out.clear()
        self.state_handed_out.clear()
        self.free_calls.clear()
        op()
        self._check_drained_as_is(before)

    def after_schedule(self, out) -> None:
        # Remember the whole tables of every request this step reads or writes.
        self.tables_by_step[out.step_seq] = {b for req_id in out.num_scheduled_tokens
                                             for b in self.kv.get_block_ids(req_id)[0]}
        if self.scheduler.defer_block_free:
            fenced = self.referenced_by_unprocessed_steps(exclude_last=True)
            assert not fenced & set(self.handed_out), "handed out a block an unprocessed step references"
        self._check_state_slots(out)
        if self.scheduler.defer_block_free:
            earlier = list(self.driver.in_flight)[:-1]
            in_use = {slot for o, _ in earlier for used, _ in self.state_slots_by_step.get(o.step_seq, {}).values()
                      for slot in used}
            handed = self.state_handed_out if self.state_pool is not self.pool else self.handed_out
            assert not in_use & set(handed), "handed out a state slot an unprocessed step uses"

    def _check_state_slots(self, out) -> None:
        """Record the state slots the step uses; no slot is shared with another
        request (of this or an unprocessed step) unless no one writes it."""
        groups = [(g, spec) for g, spec in enumerate(self.kv.kv_cache_config.kv_cache_groups)
                  if isinstance(spec.kv_cache_spec, StateSpec)]
        if not groups:
            return
        starts = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens))
        step_slots = {}
        for req_id, num_tokens in out.num_scheduled_tokens.items():
            used, written = set(), set()
            for g, group in groups:
                table = self.kv.get_block_ids(req_id)[g]
                read, writes = state_step_slots(group.kv_cache_spec.block_size, starts[req_id], num_tokens, table)
                slots = {slot for _, slot in writes} | ({read} if read is not None else set())
                assert 0 not in slots, f"request {req_id} uses the null block as a state slot"
                used |= slots
                written |= {slot for _, slot in writes}
            step_slots[req_id] = (used, written)
        self.state_slots_by_step[out.step_seq] = step_slots
        live = [self.state_slots_by_step.get(o.step_seq, {}) for o, _ in self.driver.in_flight]
        for req_id, (_, written) in step_slots.items():
            for slots in live:
                for other_id, (used, _) in slots.items():
                    assert other_id == req_id or not written & used, (
                        f"request {req_id} writes state slots {written & used} that {other_id} uses in flight")

    def _holders(self, pool) -> dict[int, int]:
        """Block id -> holders of `pool`'s blocks: table entries and parked frees."""
        holders: dict[int, int] = {}
        tables = [blocks for manager in self.kv.coordinator.single_type_managers
                  for blocks in manager.req_to_blocks.values()]
        for blocks in tables + [blocks for _, blocks in self.scheduler.deferred_frees]:
            for block in blocks:
                if not block.is_null and pool.owns(block):
                    holders[block.block_id] = holders.get(block.block_id, 0) + 1
        return holders

    def state_slots_in_flight(self) -> set[int]:
        return {slot for out, _ in self.driver.in_flight
                for used, _ in self.state_slots_by_step.get(out.step_seq, {}).values() for slot in used}

    def _check_drained_as_is(self, before) -> None:
        after = [(fence, [b.block_id for b in blocks]) for fence, blocks in self.scheduler.deferred_frees]
        num_kept = next(k for k in range(len(before), -1, -1) if after[:k] == before[len(before) - k:])
        drained = before[:len(before) - num_kept]
        calls = iter(self.free_calls)
        for _, block_ids in drained:  # each parked list freed as-is, oldest first
            assert any(call == block_ids for call in calls), "a deferred list was not freed as-is, in order"

    def check(self) -> None:
        scheduler = self.scheduler
        assert 0 <= scheduler.processed_step_seq <= scheduler.sched_step_seq
        num_unprocessed = sum(1 for out, _ in self.driver.in_flight if out.num_scheduled_tokens)
        assert scheduler.sched_step_seq - scheduler.processed_step_seq == num_unprocessed
        assert len(scheduler.running) <= scheduler.max_num_running_reqs
        for _, blocks in scheduler.deferred_frees:
            assert id(blocks) in self.parked_lists, "parked a list that is not the immediate path's"
        for pool in self.pool.pools:
            pool.check_invariants(expected_ref_cnts=self._holders(pool))
        if scheduler.defer_block_free:
            for block_id in self.referenced_by_unprocessed_steps():
                assert self.pool.blocks[block_id].ref_cnt > 0, f"block {block_id} freed while a step references it"
            for block_id in self.state_slots_in_flight():
                assert self.state_pool.blocks[block_id].ref_cnt > 0, f"state slot {block_id} freed while a step uses it"
        if not scheduler.defer_block_free:
            assert not scheduler.deferred_frees
        for request in scheduler.requests.values():
            pending = request.num_output_placeholders
            max_tokens = request.sampling_params.max_tokens
            assert request.num_output_tokens + pending <= max_tokens
            assert request.num_tokens + pending <= scheduler.max_model_len + 1


def _specs(trace: Trace):
    if not trace.hybrid:
        return None
    spec = dict(block_size=trace.block_size, num_kv_heads=1, head_size=1, dtype="float32")
    specs = [FullAttentionSpec(**spec), SlidingWindowSpec(**spec, sliding_window=2 * trace.block_size)]
    if trace.state:
        specs.append(StateSpec(block_size=trace.block_size, shapes=((2,), (3, 2)), dtype="float32"))
    return specs


def _spec_config(trace: Trace) -> SpeculativeConfig | None:
    if not trace.num_spec_tokens:
        return None
    if trace.draft_model:
        return SpeculativeConfig(method="draft_model", model="fake", num_speculative_tokens=trace.num_spec_tokens,
                                 disable_by_batch_size=4, backoff_steps=3)
    return SpeculativeConfig(num_speculative_tokens=trace.num_spec_tokens, prompt_lookup_min=1,
                             prompt_lookup_max=3, disable_by_batch_size=4, backoff_steps=3)


def _run_trace(trace: Trace) -> StepDriver:
    scheduler = create_scheduler(
        num_blocks=trace.num_blocks, block_size=trace.block_size,
        hash_block_size=None if trace.hybrid else trace.hash_block_size,
        max_num_batched_tokens=trace.budget, max_num_seqs=trace.max_num_seqs, max_model_len=96,
        async_scheduling=trace.async_steps, policy=trace.policy, kv_cache_specs=_specs(trace),
        speculative_config=_spec_config(trace), num_state_blocks=trace.num_state_blocks)
    runner = FakeModelRunner(eos_token_id=EOS, eos_after=5 if not trace.num_spec_tokens else 9,
                             period=3 if trace.num_spec_tokens else None, block_size=trace.block_size,
                             draft_lookahead=trace.num_spec_tokens if trace.draft_model else 0)
    driver = StepDriver(scheduler, runner, async_steps=trace.async_steps)
    checker = FenceChecker(scheduler, driver)
    added, aborted = [], set()
    max_in_flight = 2 if trace.async_steps else 1

    def schedule():
        if len(driver.in_flight) < max_in_flight:
            checker.after_schedule(driver.schedule_step())

    def process():
        if driver.in_flight:
            driver.process_step()

    def add(prompt_len, max_tokens, family, priority, stop_on_eos):
        prompt = [family * 100 + i for i in range(prompt_len)]
        request = create_requests(1, max_tokens=max_tokens, prompt_token_ids=prompt, priorities=[priority],
                                  ignore_eos=not stop_on_eos, eos_token_id=EOS, id_offset=len(added))[0]
        added.append(request)
        driver.add_requests([request])

    def abort(index):
        if added:
            request = added[index % len(added)]
            if scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED):
                aborted.add(request.request_id)

    def pause(mode):
        aborted.update(r.request_id for r in scheduler.pause(mode))

    def step():
        if len(driver.in_flight) < max_in_flight and scheduler.has_unfinished_requests():
            schedule()
            if not driver.in_flight[-1][0].is_empty and len(driver.in_flight) < max_in_flight:
                return
        process()

    actions = {"add": add, "abort": abort, "pause": pause, "resume": scheduler.resume,
               "step": step, "schedule": schedule, "process": process}
    for name, *args in trace.ops:
        checker.run_op(lambda: actions[name](*args))
        checker.check()

    scheduler.resume()
    for _ in range(5_000):
        if driver.is_done():
            break
        checker.run_op(step)
        checker.check()
    assert driver.is_done()
    assert_pool_whole(scheduler)
    assert scheduler.reset_prefix_cache()
    for request in added:
        result = driver.results[request.request_id]
        expected = expected_result(runner, request, scheduler.max_model_len)
        if request.request_id in aborted:
            assert result.finish_reason in ("abort", None) or result.token_ids == expected.token_ids
            assert result.token_ids == expected.token_ids[:len(result.token_ids)]
        elif request.status == RequestStatus.FINISHED_IGNORED:
            assert result.finish_reason == "length" and not result.token_ids
        else:
            assert (result.token_ids, result.finish_reason, result.stop_reason) == (
                expected.token_ids, expected.finish_reason, expected.stop_reason), request.request_id
    return driver


@settings(max_examples=120, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(traces())
def test_random_traces_keep_fences_and_pool_whole(trace):
    _run_trace(trace)


@pytest.mark.parametrize("num_state_blocks", [0, 14], ids=["one_pool", "state_pool"])
@pytest.mark.parametrize("async_steps", [False, True])
def test_a_preemption_heavy_trace_with_a_state_group(async_steps, num_state_blocks):
    """Full + sliding + state groups in a pool that forces preemptions, with prefix hits
    on shared prompt families and an abort: state slots stay fenced and unshared; also
    with the state group in a short pool of its own (#29)."""
    ops = [("add", 20, 20, 0, 0, False), ("add", 22, 20, 0, 1, False), ("add", 12, 24, 1, 2, True),
           ("step",), ("step",), ("add", 21, 20, 0, 0, False)] + [("step",)] * 30 + [("abort", 1)] + [("step",)] * 10
    driver = _run_trace(Trace(num_blocks=36 if not num_state_blocks else 24, block_size=4, hash_block_size=None,
                              budget=24, max_num_seqs=4, async_steps=async_steps, policy="fcfs", ops=ops,
                              hybrid=True, state=True, num_state_blocks=num_state_blocks))
    scheduler = driver.scheduler
    assert scheduler.num_preemptions > 0
    state_manager = scheduler.kv_cache_manager.coordinator.single_type_managers[2]
    assert state_manager.num_hit_blocks > 0


def test_a_preemption_heavy_async_trace():
    """A fixed trace that forces preemptions with async steps in flight."""
    ops = [("add", 30, 20, 0, 0, False), ("add", 30, 20, 1, 1, False), ("add", 12, 24, 0, 2, True),
           ("add", 20, 20, 2, 0, False)] + [("step",)] * 30 + [("abort", 1)] + [("step",)] * 10
    _run_trace(Trace(num_blocks=9, block_size=8, hash_block_size=4, budget=24, max_num_seqs=4,
                     async_steps=True, policy="fcfs", ops=ops))


@pytest.mark.parametrize("async_steps", [False, True])
def test_a_speculative_trace_accepts_and_rolls_back(async_steps):
    """Drafts of up to 4 tokens (as long as the acceptance so far makes pay) over mostly
    periodic outputs, with preemption and an abort: some drafts are accepted, some
    rejected, and the fences and pool hold."""
    ops = [("add", 20, 40, 0, 0, False), ("add", 14, 40, 1, 1, False), ("add", 9, 30, 2, 2, True),
           ("add", 25, 40, 3, 0, False)] + [("step",)] * 40 + [("abort", 2)] + [("step",)] * 20
    driver = _run_trace(Trace(num_blocks=14, block_size=4, hash_block_size=2, budget=32, max_num_seqs=4,
                              async_steps=async_steps, policy="fcfs", ops=ops, num_spec_tokens=4))
    drafts = [d for out in driver.scheduler_outputs for d in out.scheduled_spec_decode_tokens.values()]
    assert drafts and max(map(len, drafts)) <= 4 and len(set(map(len, drafts))) > 1
    stats = driver.scheduler.make_stats().spec_decoding_stats
    assert stats.num_drafts == len(drafts)
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert driver.scheduler.num_preemptions > 0


@pytest.mark.parametrize("async_steps", [False, True])
def test_a_draft_model_trace_schedules_drafting_requests_ahead(async_steps):
    """Placeholder drafts the (fake) draft model fills in; under async scheduling a
    drafting request's next step is scheduled while its verifying step is in flight."""
    ops = [("add", 20, 40, 0, 0, False), ("add", 14, 40, 1, 1, False), ("add", 9, 30, 2, 2, True),
           ("add", 25, 40, 3, 0, False)] + [("step",)] * 40 + [("abort", 2)] + [("step",)] * 20
    driver = _run_trace(Trace(num_blocks=20, block_size=4, hash_block_size=2, budget=32, max_num_seqs=4,
                              async_steps=async_steps, policy="fcfs", ops=ops, num_spec_tokens=3,
                              draft_model=True))
    drafts = [d for out in driver.scheduler_outputs for d in out.scheduled_spec_decode_tokens.values()]
    assert drafts and all(token == -1 for draft in drafts for token in draft)
    stats = driver.scheduler.make_stats().spec_decoding_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    ahead = [out for out in driver.scheduler_outputs
             if set(out.after_unverified_drafts_req_ids) & set(out.scheduled_spec_decode_tokens)]
    assert bool(ahead) == async_steps


@pytest.mark.slow
@settings(max_examples=1500, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(traces())
def test_random_traces_keep_fences_and_pool_whole_long(trace):
    _run_trace(trace)
