"""`kvserve serve --headless` on nodes 1..K-1 of a multi-node tensor-parallel group: start
this node's ranks, each of which joins node 0 (`multinode`) and then serves the engine's
calls like a local rank (`tp_worker`), and wait for them."""
from __future__ import annotations

import logging
import os
import signal
from multiprocessing.connection import wait
from typing import Any

from kvserve.errors import ConfigError
from kvserve.worker.multinode import JoinHello, NodeJoinError, NodeLayout, cluster_identity, connect_to_node0, join_timeout_s
from kvserve.worker.tp_executor import COLLECTIVE_TIMEOUT_S, check_model_splits, threads_per_rank, worker_init
from kvserve.worker.tp_worker import worker_main

logger = logging.getLogger(__name__)


def remote_worker_main(engine_config: Any, init: Any, layout: NodeLayout) -> None:
    """Entry point of a rank process on a headless node: join node 0, then serve its calls."""
    logging.basicConfig(level=os.environ.get("KVSERVE_WORKER_LOG_LEVEL", "WARNING"),
                        format=f"%(asctime)s tp-rank{init.rank} %(levelname)s %(name)s: %(message)s")
    hello = JoinHello(layout.node_rank, init.rank, cluster_identity(engine_config))
    try:
        conn = connect_to_node0(layout, hello, join_timeout_s())
    except NodeJoinError as exc:
        logger.error("%s", exc)
        raise SystemExit(3) from None
    worker_main(engine_config, init, conn)


def run_headless(engine_config: Any) -> int:
    """`kvserve serve --headless` on node r > 0: run this node's ranks until they exit."""
    import torch.multiprocessing as torch_mp

    layout = NodeLayout.from_parallel_config(engine_config.parallel_config)
    if layout.node_rank == 0:
        raise ConfigError("--headless is for nodes 1..K-1; node 0 runs the engine (drop --headless)")
    check_model_splits(engine_config.model_config, layout.tp_size)
    context = torch_mp.get_context("spawn")
    processes = []
    for local_rank, rank in enumerate(layout.ranks_on(layout.node_rank)):
        init = worker_init(engine_config, rank, local_rank, layout.torch_init_method,
                           threads_per_rank(layout.ranks_per_node), COLLECTIVE_TIMEOUT_S)
        process = context.Process(target=remote_worker_main, args=(engine_config, init, layout),
                                  name=f"kvserve-tp-rank{rank}", daemon=True)
        process.start()
        processes.append((rank, process))
    logger.info("%s: %d ranks started, joining %s:%d", layout.describe_node(layout.node_rank),
                len(processes), *layout.control_address)
    return _wait_for_ranks(layout, processes)


def _wait_for_ranks(layout: NodeLayout, processes: list) -> int:
    """Until every rank exits; when one fails, stop the others. Returns the node's exit code."""
    stopping = []

    def on_signal(signum, _frame) -> None:
        stopping.append(signum)
        for _, process in processes:
            if process.is_alive():
                process.terminate()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    exit_code = 0
    alive = dict(processes)
    while alive:
        ready = wait([p.sentinel for p in alive.values()], timeout=1.0)
        for rank, process in list(alive.items()):
            if process.sentinel not in ready and process.is_alive():
                continue
            process.join()
            del alive[rank]
            if process.exitcode != 0 and not stopping and exit_code == 0:
                exit_code = 1
                logger.error("tensor-parallel rank %d on node %d exited with code %s; stopping this node",
                             rank, layout.node_rank, process.exitcode)
                for other in alive.values():
                    other.terminate()
    return exit_code
