"""The recurrent-state group kind in the KV manager: constant footprint, snapshots
cached once processed, hits at the longest boundary every group serves, and
releases that never touch a block a step in flight reads (no model involved)."""
from kv_helpers import admit, complete_step, full_spec, make_manager, make_request, sliding_spec, state_spec

from kvserve.kv_cache.single_type_manager import StateManager

BLOCK = 4


def _state(manager) -> StateManager:
    (state,) = [m for m in manager.coordinator.single_type_managers if isinstance(m, StateManager)]
    return state


def _held(manager, request_id: str) -> list[int]:
    return [b.block_id for b in _state(manager).req_to_blocks[request_id] if not b.is_null]


def _decode(manager, request, num_steps: int) -> int:
    """Run `num_steps` one-token steps (synchronously); the most state blocks held."""
    most = 0
    for step in range(num_steps):
        assert manager.allocate_slots(request, 1) is not None
        most = max(most, len(_held(manager, request.request_id)))
        complete_step(request, 1, output_token=100 + step)
    return most


def test_state_footprint_is_constant_in_the_sequence_length():
    for caching in (True, False):
        manager = make_manager([full_spec(), state_spec()], num_blocks=64, enable_caching=caching)
        request = make_request(manager, "r", list(range(10)))
        admit(manager, request)
        complete_step(request, 10, output_token=99)
        # The running state's block, plus (during a step crossing a boundary) the next one.
        assert _decode(manager, request, 60) <= 2
        table = _state(manager).req_to_blocks["r"]
        assert len(table) == 18 and sum(not b.is_null for b in table) <= 2


def test_without_caching_a_prompt_holds_only_its_running_state():
    manager = make_manager([full_spec(), state_spec()], num_blocks=32, enable_caching=False)
    request = make_request(manager, "r", list(range(22)))
    admit(manager, request)
    table = _state(manager).req_to_blocks["r"]
    assert [b.is_null for b in table] == [True] * 5 + [False]


def test_snapshots_are_cached_once_processed_and_hit_at_a_boundary():
    manager = make_manager([full_spec(), state_spec()], num_blocks=64)
    prompt = list(range(18))
    first = make_request(manager, "a", prompt)
    admit(manager, first)
    # Scheduled, not processed: no snapshot may be hit yet (the step has not written them).
    second = make_request(manager, "b", prompt + [7, 8])
    assert manager.get_computed_blocks(second)[1] == 0
    complete_step(first, 18, output_token=50)
    manager.free(first)  # freeing registers the processed snapshots, then returns the blocks
    blocks, num_hit = manager.get_computed_blocks(second)
    assert num_hit == 16  # the longest boundary <= 19 tokens (the last token is always computed)
    state_hit = blocks.blocks[1]
    assert [b.is_null for b in state_hit] == [True, True, True, False]
    num_hit, _ = admit(manager, second)
    assert num_hit == 16 and _state(manager).num_hit_blocks == 1
    # The hit snapshot is read in place; the running state goes to a block of its own.
    table = _state(manager).req_to_blocks["b"]
    assert table[3] is state_hit[3] and not table[4].is_null and table[4] is not table[3]


def test_hybrid_hit_is_the_longest_boundary_every_group_serves():
    """Full attention could serve 16 tokens; the state group only the snapshot at 8
    (the others were evicted): the agreed hit is 8, with every group's blocks."""
    manager = make_manager([full_spec(), sliding_spec(window=6), state_spec()], num_blocks=64)
    prompt = list(range(18))
    first = make_request(manager, "a", prompt)
    admit(manager, first)
    complete_step(first, 18, output_token=50)
    manager.free(first)
    state = _state(manager)
    for num_tokens in (12, 16):
        manager.block_pool._evict(state._lookup(first.block_hashes, num_tokens))
    second = make_request(manager, "b", prompt + [1])
    blocks, num_hit = manager.get_computed_blocks(second)
    assert num_hit == 8
    full_hit, sliding_hit, state_hit = blocks.blocks
    assert len(full_hit) == 2 and not any(b.is_null for b in full_hit)
    assert len(sliding_hit) == 2
    assert [b.is_null for b in state_hit] == [True, False]
