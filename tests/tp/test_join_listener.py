"""Node 0's join listener on its own (no model, no ranks): who is let in, who is refused and why."""
from __future__ import annotations

import threading

import pytest

from helpers.server_process import free_port
from kvserve.worker.multinode import JoinHello, NodeJoinError, NodeLayout, RemoteRankListener, connect_to_node0

IDENTITY = {"architecture": "LlamaForCausalLM", "tensor_parallel_size": 3, "nnodes": 3}


def _layout(tp: int, nnodes: int) -> NodeLayout:
    return NodeLayout(tp, nnodes, 0, "127.0.0.1", free_port())


def _join_in_background(layout: NodeLayout, hello: JoinHello) -> tuple[threading.Thread, list]:
    """connect_to_node0 in a thread; its result (a Connection or the exception) lands in the list."""
    outcome: list = []

    def join() -> None:
        try:
            outcome.append(connect_to_node0(layout, hello, timeout_s=10))
        except NodeJoinError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=join, daemon=True)
    thread.start()
    return thread, outcome


def _no_local_failure() -> None:
    return None


def test_two_nodes_claiming_the_same_rank_stop_the_join_naming_it():
    layout = _layout(3, 3)
    listener = RemoteRankListener(layout, IDENTITY)
    first, first_outcome = _join_in_background(layout, JoinHello(1, 1, IDENTITY))
    first.join(timeout=10)
    second, second_outcome = _join_in_background(layout, JoinHello(1, 1, IDENTITY))
    try:
        with pytest.raises(NodeJoinError, match="rank 1 of node 1 has already joined"):
            listener.accept_all(10, _no_local_failure)
    finally:
        listener.close()
    second.join(timeout=10)
    assert isinstance(second_outcome[0], NodeJoinError)
    assert "two nodes started with the same --node-rank" in str(second_outcome[0])


@pytest.mark.parametrize("hello, reason", [
    (JoinHello(3, 2, IDENTITY), "node rank 3 is not one of 1..2"),
    (JoinHello(1, 2, IDENTITY), "rank 2 does not belong to node 1"),
    (JoinHello(1, 1, {**IDENTITY, "tensor_parallel_size": 6}), "tensor_parallel_size 6 here vs 3 on node 0"),
    (JoinHello(1, 1, {**IDENTITY, "architecture": "Gemma2ForCausalLM"}), "architecture 'Gemma2ForCausalLM' here"),
])
def test_a_misconfigured_node_is_refused_with_the_reason_on_both_sides(hello, reason):
    layout = _layout(3, 3)
    listener = RemoteRankListener(layout, IDENTITY)
    thread, outcome = _join_in_background(layout, hello)
    try:
        with pytest.raises(NodeJoinError, match=reason):
            listener.accept_all(10, _no_local_failure)
    finally:
        listener.close()
    thread.join(timeout=10)
    assert reason in str(outcome[0])


def test_a_late_duplicate_is_refused_while_the_complete_group_keeps_its_connections():
    layout = _layout(2, 2)
    identity = {**IDENTITY, "tensor_parallel_size": 2, "nnodes": 2}
    listener = RemoteRankListener(layout, identity)
    thread, outcome = _join_in_background(layout, JoinHello(1, 1, identity))
    try:
        joined = listener.accept_all(10, _no_local_failure)
        thread.join(timeout=10)
        assert sorted(joined) == [1]
        with pytest.raises(NodeJoinError, match="rank 1 of node 1 has already joined"):
            connect_to_node0(layout, JoinHello(1, 1, identity), timeout_s=10)
        assert not joined[1].closed
    finally:
        listener.close()
        for conn in (*joined.values(), outcome[0]):
            conn.close()


def test_a_port_in_use_is_refused_before_anything_listens():
    layout = _layout(2, 2)
    first = RemoteRankListener(layout, IDENTITY)
    try:
        with pytest.raises(Exception, match="choose another --master-port"):
            RemoteRankListener(layout, IDENTITY)
    finally:
        first.close()
