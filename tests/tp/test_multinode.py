"""Tensor parallelism across two "nodes" on loopback: separate process trees.

Node 1 is `kvserve serve --headless` in its own process (and session); node 0
is an EngineCore in this process, or `kvserve serve` in another. Compared with
the same engine at TP=1 with the same number of KV blocks (as many preemptions),
with prefix hits (partial-block CoW copies) and preemption in play, both
engines' tokens must be greedy under transformers: TP=2 adds the ranks' partial
o_proj/down_proj sums in another float order, so a near-tie may break either
way. A node lost while idle (killed, or stopped as a partition would leave it)
turns node 0's /health to 503 within the heartbeat bound.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
import torch
import transformers
from helpers.greedy_check import assert_greedy_continuations

from tp_helpers import greedy, make_engine, random_prompts, run_requests, save_tiny_chat_model, save_tiny_model
from helpers.server_process import CLI_SERVE, ServerProcess, free_port
from kvserve.config import ConfigError
from kvserve.engine.core import EngineCoreRequest
from kvserve.errors import EngineDeadError
from kvserve.worker.multinode import NodeJoinError

KV_BYTES_TP1 = 48 * 1024
ENGINE_SETTINGS = dict(block_size=4, hash_block_size=2, max_num_seqs=6, max_num_batched_tokens=48)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return save_tiny_model("llama_gqa", tmp_path_factory.mktemp("tiny-llama"))


def _two_free_ports() -> int:
    """A port P with P and P+1 both free on 127.0.0.1."""
    for _ in range(50):
        port = free_port()
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two consecutive free ports")


class HeadlessNode:
    """`kvserve serve --headless` for node `node_rank`, in its own session (a separate process tree)."""

    def __init__(self, model_path: str, port: int, *, node_rank: int = 1, tp: int = 2, nnodes: int = 2,
                 extra: tuple[str, ...] = (), join_timeout_s: float = 60.0) -> None:
        env = {**os.environ, "KVSERVE_NODE_JOIN_TIMEOUT_S": str(join_timeout_s), "OMP_NUM_THREADS": "1"}
        command = [sys.executable, "-m", "kvserve.cli", "serve", "--model", model_path, "--device", "cpu",
                   "-tp", str(tp), "--nnodes", str(nnodes), "--node-rank", str(node_rank),
                   "--master-addr", "127.0.0.1", "--master-port", str(port), "--headless",
                   "--kv-cache-memory", str(KV_BYTES_TP1 // 2), "--block-size", "4", *extra]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        env=env, start_new_session=True)

    def wait(self, timeout_s: float = 60.0) -> tuple[int, str]:
        try:
            output, _ = self.process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            output, _ = self.process.communicate()
            raise AssertionError(f"the headless node did not exit within {timeout_s} s:\n{output[-3000:]}")
        return self.process.returncode, output

    def rank_pids(self) -> list[int]:
        children = subprocess.run(["pgrep", "-P", str(self.process.pid)], capture_output=True, text=True)
        return [int(pid) for pid in children.stdout.split()]

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)


def _node0_engine(model_path: str, port: int, **overrides):
    settings = dict(ENGINE_SETTINGS, kv_cache_memory=KV_BYTES_TP1 // 2, nnodes=2, node_rank=0,
                    master_addr="127.0.0.1", master_port=port)
    settings.update(overrides)
    return make_engine(model_path, 2, **settings)


def _workload() -> list[list[int]]:
    shared = list(range(3, 22))
    first = random_prompts(6, 4, 26, seed=1, shared_prefix=shared)
    return first + [prompt[:len(prompt) - 3] + [5, 6] for prompt in first[:4]]


def test_two_nodes_give_greedy_tokens_like_one_rank(model_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_NODE_JOIN_TIMEOUT_S", "120")
    prompts = _workload()
    with make_engine(model_path, 1, kv_cache_memory=KV_BYTES_TP1, **ENGINE_SETTINGS) as single:
        expected = run_requests(single, prompts, greedy(12))
        single_stats = single.get_stats()
    port = _two_free_ports()
    node1 = HeadlessNode(model_path, port)
    try:
        with _node0_engine(model_path, port) as core:
            assert core.kv_cache_config.num_blocks == single.kv_cache_config.num_blocks
            got = run_requests(core, prompts, greedy(12))
            stats = core.get_stats()
        code, output = node1.wait()
    finally:
        node1.kill()
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        model_path, dtype=torch.float32, attn_implementation="eager").eval()
    for tokens in (expected, got):
        assert_greedy_continuations(reference, prompts, [tokens[str(i)] for i in range(len(prompts))], 12)
    assert stats.num_preemptions > 0 and stats.num_preemptions == single_stats.num_preemptions
    assert code == 0, output[-3000:]


def test_a_node_that_never_arrives_stops_the_start(model_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_NODE_JOIN_TIMEOUT_S", "4")
    started = time.monotonic()
    with pytest.raises(NodeJoinError, match=r"node 1 \(ranks 1-1\) did not join within 4 s"):
        _node0_engine(model_path, _two_free_ports())
    assert time.monotonic() - started < 60


def test_a_killed_remote_rank_stops_the_engine_naming_node_and_rank(model_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_NODE_JOIN_TIMEOUT_S", "120")
    port = _two_free_ports()
    node1 = HeadlessNode(model_path, port)
    try:
        core = _node0_engine(model_path, port)
        try:
            run_requests(core, _workload()[:2], greedy(4))
            for pid in node1.rank_pids():
                os.kill(pid, signal.SIGKILL)
            core.add_request(EngineCoreRequest("late", [5, 6, 7, 8], greedy(50)))
            # Found at submit, at collect or by the idle watch, depending on timing: always this error.
            with pytest.raises(EngineDeadError, match="rank 1 on node 1"):
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    core.step()
        finally:
            core.shutdown()
        code, output = node1.wait()
    finally:
        node1.kill()
    assert code != 0, output[-3000:]
    assert "rank 1 on node 1" in output


@pytest.mark.parametrize("difference, reason", [
    ("model", "num_kv_heads 1 here vs 2 on node 0"),
    ("tp_size", "tensor_parallel_size 4 here vs 2 on node 0"),
])
def test_mismatched_nodes_fail_at_start_with_the_reason(model_path, tmp_path, monkeypatch, difference, reason):
    monkeypatch.setenv("KVSERVE_NODE_JOIN_TIMEOUT_S", "60")
    port = _two_free_ports()
    if difference == "model":
        node1 = HeadlessNode(save_tiny_model("llama_mqa", tmp_path / "other-model"), port)
    else:
        node1 = HeadlessNode(model_path, port, tp=4)
    try:
        started = time.monotonic()
        with pytest.raises(NodeJoinError, match=reason):
            _node0_engine(model_path, port)
        assert time.monotonic() - started < 60
        code, output = node1.wait()
    finally:
        node1.kill()
    assert code != 0 and reason in output


def test_a_second_node_with_the_same_rank_is_refused_and_the_first_keeps_serving(model_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_NODE_JOIN_TIMEOUT_S", "120")
    port = _two_free_ports()
    node1 = HeadlessNode(model_path, port)
    duplicate = None
    try:
        with _node0_engine(model_path, port) as core:
            duplicate = HeadlessNode(model_path, port)
            code, output = duplicate.wait(timeout_s=60)
            assert code != 0 and "rank 1 of node 1 has already joined" in output
            assert "two nodes started with the same --node-rank" in output
            assert len(run_requests(core, _workload()[:2], greedy(4))["0"]) == 4
        code, output = node1.wait()
        assert code == 0, output[-3000:]
    finally:
        node1.kill()
        if duplicate is not None:
            duplicate.kill()


def test_headless_node_rank_out_of_range_is_a_one_line_error(model_path):
    completed = subprocess.run([sys.executable, "-m", "kvserve.cli", "serve", "--model", model_path,
                                "--device", "cpu", "-tp", "2", "--nnodes", "2", "--node-rank", "2", "--headless"],
                               capture_output=True, text=True, timeout=120)
    assert completed.returncode != 0
    assert "node_rank must be in [0, 1] for nnodes 2, got 2" in completed.stderr
    assert "Traceback" not in completed.stderr


def test_bad_layouts_and_ports_are_refused_before_any_rank_starts(model_path):
    with pytest.raises(ConfigError, match="node_rank must be in"):
        _node0_engine(model_path, 29500, node_rank=2)
    with pytest.raises(ConfigError, match="multiple of nnodes"):
        make_engine(model_path, 2, nnodes=3, **ENGINE_SETTINGS)
    with pytest.raises(ConfigError, match="--headless"):
        _node0_engine(model_path, 29500, node_rank=1)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        with pytest.raises(ConfigError, match="choose another --master-port"):
            _node0_engine(model_path, busy.getsockname()[1])
    code = subprocess.run([sys.executable, "-m", "kvserve.cli", "serve", "--model", model_path, "--device", "cpu",
                           "-tp", "2", "--nnodes", "2", "--node-rank", "0", "--headless"],
                          capture_output=True, text=True, timeout=120)
    assert code.returncode != 0 and "--headless is for nodes 1..K-1" in code.stderr


# The test's heartbeat bound T: a lost node is found at most T after its last answer
# (kvserve/worker/tp_executor.py). 3 s rather than less: a live rank must answer each
# heartbeat within T/2 = 1.5 s, which a loaded 2-core machine still does.
HEARTBEAT_S = 3.0
# /health is polled every 0.05 s and its answer takes scheduling time on a loaded machine.
HEALTH_POLL_SLACK_S = 1.0


@pytest.fixture(scope="module")
def chat_model_path(tmp_path_factory):
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


def _serve_node0(model_path: str, port: int, *extra: str) -> ServerProcess:
    return ServerProcess("--model", model_path, "--device", "cpu", "-tp", "2", "--nnodes", "2", "--node-rank", "0",
                         "--master-addr", "127.0.0.1", "--master-port", str(port), "--block-size", "4",
                         "--heartbeat-timeout", str(HEARTBEAT_S), "--served-model-name", "m", *extra,
                         command=CLI_SERVE, startup_timeout_s=240)


def _seconds_until_503(base_url: str, timeout_s: float) -> tuple[float, dict]:
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        response = httpx.get(base_url + "/health", timeout=5)
        if response.status_code == 503:
            return time.monotonic() - started, response.json()
        assert response.status_code == 200, response.text
        time.sleep(0.05)
    raise AssertionError(f"/health still answers 200 {timeout_s:.0f} s after node 1 was lost")


def _complete(base_url: str) -> httpx.Response:
    return httpx.post(base_url + "/v1/completions", json={"model": "m", "prompt": "Hello", "max_tokens": 3},
                      timeout=60)


def test_health_turns_503_within_the_heartbeat_bound_when_node1_is_killed_while_idle(chat_model_path):
    port = _two_free_ports()
    node1 = HeadlessNode(chat_model_path, port, join_timeout_s=240)
    server = None
    try:
        server = _serve_node0(chat_model_path, port)
        assert _complete(server.base_url).status_code == 200
        time.sleep(HEARTBEAT_S)  # idle through several heartbeats: a live node is not lost
        assert httpx.get(server.base_url + "/health").status_code == 200
        os.killpg(node1.process.pid, signal.SIGKILL)
        elapsed_s, body = _seconds_until_503(server.base_url, timeout_s=60)
        assert elapsed_s <= HEARTBEAT_S + HEALTH_POLL_SLACK_S, (elapsed_s, server.log_text())
        assert body["error"]["code"] == "engine_unavailable" and "rank 1 on node 1" in body["error"]["message"]
        server.process.wait(30)  # --exit-on-lost-node is the default
        assert server.process.returncode == 1, server.log_text()
        assert "exiting in" in server.log_text() and "Traceback" not in server.log_text(), server.log_text()
    finally:
        if server is not None:
            server.stop()
        node1.kill()


def test_a_stopped_node_is_lost_by_heartbeat_within_the_bound(model_path, monkeypatch):
    """SIGSTOP: the connection stays open and silent, as under a network partition."""
    monkeypatch.setenv("KVSERVE_NODE_JOIN_TIMEOUT_S", "120")
    port = _two_free_ports()
    node1 = HeadlessNode(model_path, port)
    try:
        with _node0_engine(model_path, port, heartbeat_timeout_s=HEARTBEAT_S) as core:
            run_requests(core, _workload()[:2], greedy(4))
            time.sleep(HEARTBEAT_S)  # idle through several heartbeats: a live node is not lost
            core.check_health()
            os.killpg(node1.process.pid, signal.SIGSTOP)
            stopped_at = time.monotonic()
            with pytest.raises(EngineDeadError, match="lost tensor-parallel rank 1 on node 1: no answer to a heartbeat"):
                while time.monotonic() - stopped_at < 60:
                    core.check_health()
                    time.sleep(0.05)
            assert time.monotonic() - stopped_at <= HEARTBEAT_S + HEALTH_POLL_SLACK_S
            os.killpg(node1.process.pid, signal.SIGCONT)
        node1.wait()  # node 0 told it to leave; it exits once it runs again
    finally:
        node1.kill()
