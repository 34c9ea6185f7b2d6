"""Tensor parallelism across nodes: where each rank runs and how node 0 reaches it.

Layout (vLLM's flags): `-tp N --nnodes K`; node r runs ranks r*N/K .. (r+1)*N/K - 1.
Node 0 runs the engine, the API server and its own ranks; the other nodes run
`--headless`: only their ranks, no engine.

Two channels join the nodes, both to node 0's `--master-addr`:
- torch.distributed's TCP rendezvous on `--master-port` (rank 0, on node 0,
  hosts the store); the collectives then run rank to rank (gloo or NCCL);
- the engine's calls on `--master-port + 1`: each remote rank connects, says
  who it is (`JoinHello`), and is accepted or refused (`JoinVerdict`). The
  accepted connection then carries the same `WorkerCall`/`WorkerReply`
  messages as a local rank's pipe, so the executor treats both alike.

Node 0 refuses a rank whose node rank, rank, TP size, node count or model
differs from its own, so a misconfigured node fails at start with the reason
on both sides; it keeps listening once the group is complete, so a node
started twice with the same `--node-rank` is refused at once rather than
left waiting for a rendezvous that never comes. A node that has not joined within the join timeout
(`KVSERVE_NODE_JOIN_TIMEOUT_S`, default 120 s) stops the start-up with an
error naming it. A remote rank that dies closes its connection: the engine
sees the end of the stream and stops with an error naming node and rank.
"""
from __future__ import annotations

import logging
import os
import select
import socket
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Client, Connection, answer_challenge, deliver_challenge
from typing import Any, Callable

logger = logging.getLogger(__name__)

DEFAULT_JOIN_TIMEOUT_S = 120.0
_CONNECT_RETRY_S = 0.5


class NodeJoinError(RuntimeError):
    """A node could not join the tensor-parallel group (refused, absent, or unreachable)."""


def join_timeout_s() -> float:
    """Seconds node 0 waits for the other nodes, and they wait for node 0."""
    return float(os.environ.get("KVSERVE_NODE_JOIN_TIMEOUT_S", DEFAULT_JOIN_TIMEOUT_S))


def cluster_key() -> bytes:
    """The shared secret every connection to node 0 proves it knows (HMAC challenge)."""
    return os.environ.get("KVSERVE_CLUSTER_KEY", "kvserve-tp").encode()


@dataclass(frozen=True)
class NodeLayout:
    """Which ranks run on which node, and where node 0 listens."""

    tp_size: int
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int

    @classmethod
    def from_parallel_config(cls, parallel_config: Any) -> "NodeLayout":
        return cls(parallel_config.tensor_parallel_size, parallel_config.nnodes, parallel_config.node_rank,
                   parallel_config.master_addr, parallel_config.master_port)

    @property
    def ranks_per_node(self) -> int:
        return self.tp_size // self.nnodes

    def ranks_on(self, node_rank: int) -> range:
        return range(node_rank * self.ranks_per_node, (node_rank + 1) * self.ranks_per_node)

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    @property
    def torch_init_method(self) -> str:
        return f"tcp://{self.master_addr}:{self.master_port}"

    @property
    def control_address(self) -> tuple[str, int]:
        return self.master_addr, self.master_port + 1

    def describe_node(self, node_rank: int) -> str:
        ranks = self.ranks_on(node_rank)
        return f"node {node_rank} (ranks {ranks.start}-{ranks.stop - 1})"


def cluster_identity(engine_config: Any) -> dict[str, Any]:
    """What every node must agree on: the model's shape and dtype, the TP layout, the KV block size."""
    model = engine_config.model_config
    parallel = engine_config.parallel_config
    return {
        "architecture": model.architecture, "num_layers": model.num_layers, "hidden_size": model.hidden_size,
        "num_heads": model.num_heads, "num_kv_heads": model.num_kv_heads, "vocab_size": model.vocab_size,
        "dtype": model.dtype, "tensor_parallel_size": parallel.tensor_parallel_size, "nnodes": parallel.nnodes,
        "block_size": engine_config.cache_config.block_size, "max_model_len": engine_config.max_model_len,
    }


@dataclass
class JoinHello:
    """A remote rank's first message to node 0."""

    node_rank: int
    rank: int
    identity: dict[str, Any]
    hostname: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)


@dataclass
class JoinVerdict:
    """Node 0's answer to a `JoinHello`: accepted, or refused with the reason."""

    accepted: bool
    reason: str = ""


def check_port_free(host: str, port: int, purpose: str) -> None:
    """Raise ConfigError when `port` on `host` cannot be bound (something already listens)."""
    from kvserve.config import ConfigError

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise ConfigError(f"cannot use {host}:{port} for {purpose}: {exc.strerror or exc} "
                              "(choose another --master-port)") from None


def _mismatch(expected: dict[str, Any], given: dict[str, Any]) -> str | None:
    different = [f"{key} {given.get(key)!r} here vs {value!r} on node 0"
                 for key, value in expected.items() if given.get(key) != value]
    return "; ".join(different) or None


class RemoteRankListener:
    """Node 0's side of the control channel: accepts and vets the other nodes' ranks."""

    def __init__(self, layout: NodeLayout, identity: dict[str, Any]) -> None:
        self.layout = layout
        self.identity = identity
        check_port_free(layout.master_addr, layout.master_port, "the torch.distributed rendezvous")
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._socket.bind(layout.control_address)
        except OSError as exc:
            self._socket.close()
            from kvserve.config import ConfigError
            host, port = layout.control_address
            raise ConfigError(f"cannot use {host}:{port} for the engine's calls to the other nodes: "
                              f"{exc.strerror or exc} (choose another --master-port)") from None
        self._socket.listen(layout.tp_size)
        self.expected_ranks = [r for node in range(1, layout.nnodes) for r in layout.ranks_on(node)]
        self._closed = threading.Event()
        self._refuser: threading.Thread | None = None

    def close(self) -> None:
        self._closed.set()
        if self._refuser is not None and self._refuser is not threading.current_thread():
            self._refuser.join(timeout=2.0)
        self._socket.close()

    def accept_all(self, timeout_s: float, check_local: Callable[[], None]) -> dict[int, Connection]:
        """Connections of every remote rank, by rank; raises NodeJoinError on a refusal or timeout.

        `check_local` runs between waits and raises if a local rank has died meanwhile.
        """
        joined: dict[int, Connection] = {}
        deadline = time.monotonic() + timeout_s
        try:
            while len(joined) < len(self.expected_ranks):
                check_local()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise NodeJoinError(self._timeout_message(joined, timeout_s))
                readable, _, _ = select.select([self._socket], [], [], min(remaining, 0.5))
                if readable:
                    self._accept_one(joined)
        except BaseException:
            for conn in joined.values():
                conn.close()
            self._socket.close()
            raise
        self._start_refusing_late_joiners(joined)
        return joined

    def _start_refusing_late_joiners(self, joined: dict[int, Connection]) -> None:
        """Keep listening once the group is complete, so that a node started twice with the same
        --node-rank is told why at once instead of waiting out its join timeout."""
        complete = dict(joined)

        def refuse() -> None:
            while not self._closed.is_set():
                try:
                    readable, _, _ = select.select([self._socket], [], [], 0.5)
                    if readable and not self._closed.is_set():
                        self._accept_one(complete)
                except NodeJoinError as exc:
                    logger.error("%s", exc)
                except (OSError, ValueError):  # the socket was closed under us
                    return

        self._refuser = threading.Thread(target=refuse, name="kvserve-late-join-refuser", daemon=True)
        self._refuser.start()

    def _accept_one(self, joined: dict[int, Connection]) -> None:
        sock, peer = self._socket.accept()
        conn = Connection(sock.detach())
        try:
            deliver_challenge(conn, cluster_key())
            answer_challenge(conn, cluster_key())
            hello = conn.recv()
        except Exception as exc:  # noqa: BLE001 - a stranger or a wrong key: ignore it, keep waiting
            logger.warning("refused a connection from %s: %s", peer, exc)
            conn.close()
            return
        reason = self._refusal(hello, joined)
        conn.send(JoinVerdict(reason is None, reason or ""))
        if reason is not None:
            conn.close()
            raise NodeJoinError(f"refused {getattr(hello, 'hostname', peer)} "
                                f"(node {getattr(hello, 'node_rank', '?')}, rank {getattr(hello, 'rank', '?')}): "
                                f"{reason}")
        logger.info("tensor-parallel rank %d joined from node %d (%s, pid %d)",
                    hello.rank, hello.node_rank, hello.hostname, hello.pid)
        joined[hello.rank] = conn

    def _refusal(self, hello: Any, joined: dict[int, Connection]) -> str | None:
        if not isinstance(hello, JoinHello):
            return "the first message was not a join request"
        mismatch = _mismatch(self.identity, hello.identity)
        if mismatch:
            return f"configuration differs from node 0: {mismatch}"
        if not 1 <= hello.node_rank < self.layout.nnodes:
            return f"node rank {hello.node_rank} is not one of 1..{self.layout.nnodes - 1}"
        if hello.rank not in self.layout.ranks_on(hello.node_rank):
            return f"rank {hello.rank} does not belong to node {hello.node_rank}"
        if hello.rank in joined:
            return (f"rank {hello.rank} of node {hello.node_rank} has already joined "
                    "(two nodes started with the same --node-rank?)")
        return None

    def _timeout_message(self, joined: dict[int, Connection], timeout_s: float) -> str:
        missing_nodes = sorted({self.layout.node_of(r) for r in self.expected_ranks if r not in joined})
        names = ", ".join(self.layout.describe_node(n) for n in missing_nodes)
        return (f"{names} did not join within {timeout_s:.0f} s (start them with --headless and the same "
                f"--master-addr/--master-port; KVSERVE_NODE_JOIN_TIMEOUT_S sets the wait)")


def connect_to_node0(layout: NodeLayout, hello: JoinHello, timeout_s: float) -> Connection:
    """A remote rank's control connection, accepted by node 0 (retried until it listens)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            conn = Client(layout.control_address, authkey=cluster_key())
            break
        except (ConnectionRefusedError, ConnectionResetError, FileNotFoundError, socket.timeout):
            if time.monotonic() > deadline:
                host, port = layout.control_address
                raise NodeJoinError(f"node 0 did not answer at {host}:{port} within {timeout_s:.0f} s") from None
            time.sleep(_CONNECT_RETRY_S)
    conn.send(hello)
    verdict = conn.recv()
    if not verdict.accepted:
        conn.close()
        raise NodeJoinError(f"node 0 refused rank {hello.rank} of node {hello.node_rank}: {verdict.reason}")
    return conn
