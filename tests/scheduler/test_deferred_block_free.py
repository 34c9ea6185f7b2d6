"""The seed's scheduler-level deferred-free tests (fork patch 0023), ported:
only the imports and the helpers changed. The visible part of
`test_free_cow_retained_blocks_defers_until_copy_step_processed` is kept as
in the seed and its unseen remainder reconstructed; the preemption-cascade
test is written from its description (issue 3, reference §7.6)."""
from collections import deque
from types import SimpleNamespace

import pytest
from helpers.kv_blocks import eviction_order, make_pool_with_cached_blocks, make_two_group_kv_cache_manager

from kvserve.kv_cache.coordinator import KVCacheCoordinator
from kvserve.kv_cache.interface import FullAttentionSpec, SlidingWindowSpec, StateSpec
from kvserve.kv_cache.utils import KVCacheBlock
from kvserve.request import RequestStatus
from kvserve.scheduler.scheduler import Scheduler
from kvserve.testing import FakeModelRunner, StepDriver, assert_pool_whole, create_requests, create_scheduler

NUM_PROMPT_TOKENS = 40
BLOCK_SIZE = 16


def _create_deferring_scheduler(**kwargs) -> Scheduler:
    """A scheduler whose block frees wait on the fences of unprocessed steps."""
    scheduler = create_scheduler(block_size=BLOCK_SIZE, async_scheduling=True, **kwargs)
    scheduler.defer_block_free = True
    return scheduler


def test_pop_blocks_for_free_returns_eviction_order():
    """``pop_blocks_for_free`` must hand back blocks already in eviction
    order, so the deferred-free path can pass them to ``free_blocks``
    unchanged. Reversing the flat list instead would emit whole groups in
    the wrong order relative to the immediate-free path."""
    scheduler = _create_deferring_scheduler()
    coordinator = scheduler.kv_cache_manager.coordinator

    request = create_requests(
        num_requests=1,
        num_tokens=NUM_PROMPT_TOKENS,
        max_tokens=5,
    )[0]
    scheduler.add_request(request)
    scheduler.schedule()

    allocated = [
        list(manager.req_to_blocks[request.request_id])
        for manager in coordinator.single_type_managers
    ]
    expected = [block for group in allocated for block in reversed(group)]

    assert coordinator.pop_blocks_for_free(request.request_id) == expected


def test_cow_retained_blocks_span_groups_and_free_order_is_stable():
    """CoW retentions from multiple KV cache groups are concatenated into one
    flat list by ``take_kv_cache_block_copies``. Unlike per-request eviction,
    ``_free_cow_retained_blocks`` never reverses, so the deferred path frees
    that list in exactly the same order as the immediate path -- the
    group-flattening does not reintroduce the eviction-order divergence.
    """
    manager = make_two_group_kv_cache_manager(num_blocks=20)
    coordinator = manager.coordinator
    assert len(coordinator.single_type_managers) == 2

    # Queue a CoW (source, cow) pair on each of the two groups.
    blocks = manager.block_pool.get_new_blocks(4)
    coordinator.single_type_managers[0]._pending_cow_copies.append(
        (blocks[0], blocks[1])
    )
    coordinator.single_type_managers[1]._pending_cow_copies.append(
        (blocks[2], blocks[3])
    )

    _copies, retained = manager.take_kv_cache_block_copies()
    # Retentions from both groups are flattened into one list, group 0 first.
    assert [b.block_id for b in retained] == [b.block_id for b in blocks]
    # (Beyond the seed: the copies themselves, and the queue is drained.)
    assert [(c.group_id, c.src_block_id, c.dst_block_id) for c in _copies] == [
        (0, blocks[0].block_id, blocks[1].block_id),
        (1, blocks[2].block_id, blocks[3].block_id),
    ]
    assert manager.take_kv_cache_block_copies() == ([], [])

    # Drive the scheduler free helper on the same retained ordering, immediate
    # vs deferred, and confirm identical eviction order.
    retained_ids = [b.block_id for b in retained]

    imm_scheduler = _create_deferring_scheduler()
    imm_scheduler.defer_block_free = False
    imm_pool, imm_by_id = make_pool_with_cached_blocks(len(retained_ids))
    imm_scheduler.kv_cache_manager.block_pool = imm_pool
    imm_scheduler._free_cow_retained_blocks(
        [imm_by_id[i] for i in retained_ids], fence_seq=1
    )
    immediate_order = eviction_order(imm_pool)

    def_scheduler = _create_deferring_scheduler()
    def_pool, def_by_id = make_pool_with_cached_blocks(len(retained_ids))
    def_scheduler.kv_cache_manager.block_pool = def_pool
    # fence in the future -> deferred; then drain once the fence is processed.
    def_scheduler.processed_step_seq = 0
    def_scheduler._free_cow_retained_blocks(
        [def_by_id[i] for i in retained_ids], fence_seq=1
    )
    assert def_scheduler.deferred_frees
    def_scheduler.processed_step_seq = 1
    def_scheduler._drain_deferred_frees()
    deferred_order = eviction_order(def_pool)

    assert deferred_order == immediate_order
    # (Beyond the seed: both free the retained list as-is, so it is the eviction order.)
    assert immediate_order == retained_ids


def test_free_cow_retained_blocks_defers_until_copy_step_processed():
    """The endpoints a CoW copy keeps referenced stay out of the free queue
    until the step that performs the copy is processed; they are then freed
    as-is, exactly as the immediate path frees them."""
    freed: list[KVCacheBlock] = []
    blocks = [KVCacheBlock(block_id=i) for i in (7, 3, 9, 4)]
    mock = SimpleNamespace(
        defer_block_free=True,
        processed_step_seq=2,
        deferred_frees=deque(),
        kv_cache_manager=SimpleNamespace(
            block_pool=SimpleNamespace(free_blocks=lambda ordered: freed.extend(ordered))
        ),
    )
    free = Scheduler._free_cow_retained_blocks

    # Copy step still in flight: deferred with its fence, in the same order
    # the immediate path would free them (the drain no longer reverses).
    free(mock, list(blocks), fence_seq=3)
    assert not freed
    assert mock.deferred_frees == deque([(3, blocks)])

    # Draining before the fence is processed frees nothing.
    Scheduler._drain_deferred_frees(mock)
    assert not freed
    assert mock.deferred_frees == deque([(3, blocks)])

    # Copy step processed: freed immediately.
    mock.processed_step_seq = 3
    free(mock, list(blocks), fence_seq=3)
    assert freed == blocks
    freed.clear()

    # ...and the list parked earlier drains as-is.
    Scheduler._drain_deferred_frees(mock)
    assert freed == blocks
    assert not mock.deferred_frees
    freed.clear()

    # Deferral off: freed at once even with the fence far ahead.
    mock.defer_block_free = False
    free(mock, list(blocks), fence_seq=10)
    assert freed == blocks
    assert not mock.deferred_frees


def test_deferred_victim_stops_the_preemption_cascade():
    """When a running request needs a block and the only possible victim
    was scheduled by a step whose output is not processed yet, the victim's
    blocks could only be deferred: preempting it cannot make room now. So
    the cascade stops: nobody is preempted, the victim stays RUNNING, and
    the request that needed the block waits. Once the step is processed
    the victim is preempted (freed at once) and the first request runs."""
    # Room for exactly two one-block prompts; any decode then needs a preemption.
    scheduler = _create_deferring_scheduler(num_blocks=3)
    runner = FakeModelRunner()
    first, second = create_requests(num_requests=2, num_tokens=BLOCK_SIZE, max_tokens=4)
    scheduler.add_request(first)
    scheduler.add_request(second)

    out1 = scheduler.schedule()
    assert out1.num_scheduled_tokens == {first.request_id: BLOCK_SIZE, second.request_id: BLOCK_SIZE}
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 0
    runner_out1 = runner.execute(out1)

    # Step 1 is still in flight: the victim (`second`, admitted last) is fenced.
    out_blocked = scheduler.schedule()
    assert out_blocked.num_scheduled_tokens == {}
    assert out_blocked.preempted_req_ids == set()
    assert first.status == RequestStatus.RUNNING
    assert second.status == RequestStatus.RUNNING
    assert scheduler.num_preemptions == 0
    assert not scheduler.deferred_frees
    assert scheduler.running == [first, second]
    assert scheduler.kv_cache_manager.get_block_ids(second.request_id) != ([],)

    scheduler.update_from_output(out1, runner_out1)
    runner.execute(out_blocked)

    # Step 1 processed: the victim's blocks can be freed now, so it is preempted.
    out2 = scheduler.schedule()
    assert first.request_id in out2.num_scheduled_tokens
    assert first.status == RequestStatus.RUNNING
    assert second.status == RequestStatus.PREEMPTED
    assert out2.preempted_req_ids == {second.request_id}
    assert second.request_id not in out2.num_scheduled_tokens
    assert scheduler.kv_cache_manager.get_block_ids(second.request_id) == ([],)
    assert not scheduler.deferred_frees


def test_preemption_without_deferral_frees_an_in_flight_victim():
    """The contrast: with deferral off the same victim is preempted while its
    step is in flight; its in-flight token still arrives and is kept."""
    scheduler = _create_deferring_scheduler(num_blocks=3)
    scheduler.defer_block_free = False
    runner = FakeModelRunner()
    first, second = create_requests(num_requests=2, num_tokens=BLOCK_SIZE, max_tokens=4)
    scheduler.add_request(first)
    scheduler.add_request(second)
    out1 = scheduler.schedule()
    runner_out1 = runner.execute(out1)

    out2 = scheduler.schedule()
    assert out2.preempted_req_ids == {second.request_id}
    assert second.status == RequestStatus.PREEMPTED
    assert first.request_id in out2.num_scheduled_tokens
    runner_out2 = runner.execute(out2)

    scheduler.update_from_output(out1, runner_out1)
    assert len(second.output_token_ids) == 1  # the stale token, sampled before preemption
    assert second.num_computed_tokens == 0
    scheduler.update_from_output(out2, runner_out2)
    assert len(first.output_token_ids) == 2


def test_cow_copy_rides_with_its_step_and_its_endpoints_wait_for_the_fence():
    """A partial-block prefix hit (hash unit 4 < block 16) is served by a copy
    in the step that admits the request; the copy's two endpoints stay
    referenced until that step is processed, then return to the pool."""
    scheduler = _create_deferring_scheduler(hash_block_size=4, num_blocks=50)
    driver = StepDriver(scheduler, FakeModelRunner(), async_steps=True)
    driver.add_requests(create_requests(1, prompt_token_ids=list(range(40)), max_tokens=2))
    driver.run()
    prompt = list(range(24)) + [999] * 10  # shares 24 tokens: one block and a half
    consumer = create_requests(1, prompt_token_ids=prompt, max_tokens=3, id_offset=1)[0]
    driver.add_requests([consumer])

    out = driver.schedule_step()
    (copy,) = out.kv_cache_block_copies
    assert (copy.group_id, copy.num_tokens) == (0, 8)
    (new_req,) = out.scheduled_new_reqs
    assert new_req.num_computed_tokens == 24
    assert new_req.block_ids[0][1] == copy.dst_block_id  # the copy replaced the shared tail
    pool = scheduler.kv_cache_manager.block_pool
    ((fence, retained),) = scheduler.deferred_frees
    assert fence == out.step_seq > scheduler.processed_step_seq
    assert [b.block_id for b in retained] == [copy.src_block_id, copy.dst_block_id]
    assert pool.blocks[copy.src_block_id].ref_cnt == 1  # held only by the pending copy
    assert pool.blocks[copy.dst_block_id].ref_cnt == 2  # the request's and the copy's

    driver.process_step()
    assert not scheduler.deferred_frees
    assert pool.blocks[copy.src_block_id].ref_cnt == 0
    assert pool.blocks[copy.dst_block_id].ref_cnt == 1
    assert len(driver.run()[consumer.request_id].token_ids) == 3
    assert pool.get_num_free_blocks() == 49


# ---- two and three KV-cache groups: reversing per group and reversing the whole list differ ----

TWO_GROUP_SPECS = [
    FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype="float32"),
    SlidingWindowSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype="float32", sliding_window=64),
]
THREE_GROUP_SPECS = TWO_GROUP_SPECS + [StateSpec(block_size=BLOCK_SIZE, shapes=((2,), (3, 2)), dtype="float32")]


def _check_deferred_frees_match_immediate(specs, num_state_blocks: int = 0) -> None:
    """A request aborted while its step is in flight parks its blocks behind the
    step's fence in exactly the order an immediate free would give them to the
    pool: each group's blocks reversed, groups in order. Then, once the fence is
    processed, the pool's eviction order is the immediate path's (a twin run that
    frees at once)."""
    orders = []
    for defer in (True, False):
        scheduler = _create_deferring_scheduler(kv_cache_specs=specs, num_state_blocks=num_state_blocks)
        scheduler.defer_block_free = defer
        driver = StepDriver(scheduler, FakeModelRunner(), async_steps=True)
        request = create_requests(1, num_tokens=NUM_PROMPT_TOKENS, max_tokens=5)[0]
        driver.add_requests([request])
        out = driver.schedule_step()
        coordinator = scheduler.kv_cache_manager.coordinator
        allocated = [list(m.req_to_blocks[request.request_id]) for m in coordinator.single_type_managers]
        assert all(len(group) == 3 for group in allocated)
        per_group_reversed = [block for group in allocated for block in reversed(group)]
        assert per_group_reversed != list(reversed([b for group in allocated for b in group]))

        scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_ABORTED)
        if defer:
            ((fence, parked),) = scheduler.deferred_frees
            assert fence == out.step_seq
            assert parked == per_group_reversed, "parked blocks are not in per-group eviction order"
        driver.run()
        assert_pool_whole(scheduler)
        orders.append([eviction_order(pool) for pool in scheduler.kv_cache_manager.block_pool.pools])
    assert orders[0] == orders[1], "the deferred path's eviction order is not the immediate path's"


def _check_deferred_frees_match_immediate_on_two_groups() -> None:
    _check_deferred_frees_match_immediate(TWO_GROUP_SPECS)


def _check_deferred_frees_match_immediate_on_three_groups() -> None:
    """Full + sliding window + recurrent state: the state group's snapshots and
    running state are parked and freed with the others, in the same per-group order."""
    _check_deferred_frees_match_immediate(THREE_GROUP_SPECS)


def _check_deferred_frees_match_immediate_with_a_state_pool() -> None:
    """The same with the state group in a pool of its own (#29): the parked list mixes
    both pools' blocks; each pool gets its own in the immediate path's order."""
    _check_deferred_frees_match_immediate(THREE_GROUP_SPECS, num_state_blocks=8)


def test_two_group_deferred_frees_keep_the_per_group_eviction_order():
    _check_deferred_frees_match_immediate_on_two_groups()


def test_three_group_deferred_frees_keep_the_per_group_eviction_order():
    _check_deferred_frees_match_immediate_on_three_groups()


def test_three_group_deferred_frees_keep_the_order_with_a_state_pool():
    _check_deferred_frees_match_immediate_with_a_state_pool()


@pytest.mark.parametrize("check", [_check_deferred_frees_match_immediate_on_two_groups,
                                   _check_deferred_frees_match_immediate_on_three_groups,
                                   _check_deferred_frees_match_immediate_with_a_state_pool])
def test_a_whole_list_reversal_fails_the_multi_group_checks(monkeypatch, check):
    """The checks above can fail for the right reason: with one KV-cache group a
    whole-list reversal equals the per-group one, with two or three it does not."""
    def reverse_whole_list(self, request_id):
        blocks = [b for manager in self.single_type_managers for b in manager.pop_blocks_for_free(request_id)]
        return blocks[::-1]

    monkeypatch.setattr(KVCacheCoordinator, "pop_blocks_for_free", reverse_whole_list)
    with pytest.raises(AssertionError, match="not in per-group eviction order"):
        check()
