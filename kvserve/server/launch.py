"""`kvserve serve`: argument parsing and the uvicorn server around the app.

uvicorn owns SIGINT/SIGTERM: it stops accepting connections, lets open ones
finish (up to `--shutdown-timeout` seconds, then cancels them, which aborts
their requests), and the app's lifespan then stops the engine loop.

When the engine dies (a lost node or rank, a failed executor), /health and
every request answer 503 saying what died; with `--exit-on-lost-node` (the
default) the server then shuts down the same way and exits with code 1, so
that a supervisor restarts it and a load balancer stops sending it traffic.
"""
from __future__ import annotations

import argparse
import logging
import os
import threading
from typing import Any

logger = logging.getLogger(__name__)

# After the engine died, the server answers 503 (naming the cause) this long before it
# exits, so that a health checker polling it sees why rather than a refused connection.
DEAD_ENGINE_EXIT_DELAY_S = 2.0


def _byte_size(text: str) -> int:
    try:
        from kvserve.config import parse_memory_size
        return int(parse_memory_size(text))
    except ImportError:
        return int(text)


def add_serve_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Server flags, plus the engine flags unless the caller already added them."""
    if "--model" not in parser._option_string_actions:  # noqa: SLF001 - argparse has no public query
        from kvserve.engine.arg_utils import add_engine_arguments
        add_engine_arguments(parser)
    from kvserve.server.tools import PARSERS
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1",
                       help="address to bind (default 127.0.0.1: local only)")
    group.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    group.add_argument("--api-key", default=os.environ.get("KVSERVE_API_KEY"),
                       help="require 'Authorization: Bearer KEY' on /v1 routes "
                            "(default: $KVSERVE_API_KEY, else no key)")
    group.add_argument("--served-model-name", default=None,
                       help="model name clients pass (default: the model file or folder name)")
    group.add_argument("--max-concurrent-requests", type=int, default=None,
                       help="requests in flight before new ones get 503 (default: no cap)")
    group.add_argument("--max-waiting-requests", type=int, default=None,
                       help="requests waiting beyond --max-num-seqs before 503 (default: no cap)")
    group.add_argument("--max-body-size", type=_byte_size, default=4 * 1024 * 1024,
                       help="largest request body accepted, e.g. 4MiB (default 4MiB)")
    group.add_argument("--shutdown-timeout", type=float, default=10.0,
                       help="seconds open requests may run after SIGINT/SIGTERM (default 10)")
    group.add_argument("--tool-call-parser", default=None, choices=list(PARSERS),
                       help="format of tool calls in the model's output (default: harmony when the tokenizer has its "
                            "tokens, else from the chat template)")
    group.add_argument("--uvicorn-log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug"])
    group.add_argument("--exit-on-lost-node", action=argparse.BooleanOptionalAction, default=True,
                       help="exit (code 1) once the engine is dead, e.g. a node or rank is lost, after "
                            f"answering 503 for {DEAD_ENGINE_EXIT_DELAY_S:g} s (default on; "
                            "--no-exit-on-lost-node keeps answering 503)")
    group.add_argument("--headless", action="store_true",
                       help="multi-node TP, nodes 1..K-1: run only this node's ranks (no engine, no server)")
    return parser


def served_name(args: Any, model_path: str) -> str:
    if getattr(args, "served_model_name", None):
        return args.served_model_name
    return os.path.basename(str(model_path).rstrip("/")) or "kvserve-model"


def build_from_args(args: Any):
    """(app, engine) for parsed arguments; the engine loads the model here."""
    from kvserve.engine.arg_utils import engine_config_from_args
    from kvserve.engine.async_llm import AsyncLLM
    from kvserve.server.app import build_app

    engine_config = engine_config_from_args(args)
    engine = AsyncLLM(engine_config, max_concurrent_requests=args.max_concurrent_requests,
                      max_waiting_requests=args.max_waiting_requests)
    model_path = engine_config.model_config.path
    app = build_app(engine, served_name(args, model_path), api_key=args.api_key,
                    max_body_bytes=args.max_body_size, model_root=str(model_path),
                    tool_call_parser=getattr(args, "tool_call_parser", None))
    return app, engine


def run(args: Any) -> int:
    """Serve until SIGINT/SIGTERM; returns the process exit code."""
    import uvicorn

    if getattr(args, "headless", False):
        from kvserve.engine.arg_utils import engine_config_from_args
        from kvserve.worker.headless import run_headless
        return run_headless(engine_config_from_args(args))
    app, engine = build_from_args(args)
    config = uvicorn.Config(app, host=args.host, port=args.port,
                            log_level=args.uvicorn_log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout)
    return serve_until_stopped(uvicorn.Server(config), engine, exit_on_engine_death=args.exit_on_lost_node)


def serve_until_stopped(server: Any, engine: Any, *, exit_on_engine_death: bool = True,
                        exit_delay_s: float = DEAD_ENGINE_EXIT_DELAY_S) -> int:
    """Run the uvicorn `server` over `engine` (an AsyncLLM) until SIGINT/SIGTERM (returns 0) or,
    with `exit_on_engine_death`, until `exit_delay_s` after the engine died (returns 1)."""
    stopped = threading.Event()
    engine_died = threading.Event()

    def stop_when_the_engine_dies() -> None:
        while not stopped.is_set():
            if engine.wait_until_dead(0.2):
                engine_died.set()
                logger.error("the engine is dead (%s); exiting in %g s (--no-exit-on-lost-node keeps the "
                             "server up, answering 503)", engine.dead_error, exit_delay_s)
                stopped.wait(exit_delay_s)
                server.should_exit = True
                return

    if exit_on_engine_death:
        threading.Thread(target=stop_when_the_engine_dies, name="kvserve-engine-watch", daemon=True).start()
    try:
        server.run()
    finally:
        stopped.set()
        engine.shutdown()
    return 1 if engine_died.is_set() else 0


def main(argv: list[str] | None = None) -> int:
    """`python -m kvserve.server.launch [flags]`: the server without the CLI."""
    parser = argparse.ArgumentParser(prog="kvserve serve", description="OpenAI-compatible server")
    add_serve_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
