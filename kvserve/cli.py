"""The `kvserve` command: generate, chat, serve, run-batch, bench, plan, env.

Argument parsing only; the work happens in the engine, server and bench
packages, imported when their command runs so that `kvserve generate` starts
quickly. Errors print one line and exit non-zero (a traceback with --debug).
"""
from __future__ import annotations

import argparse
import atexit
import gc
import json
import logging
import os
import signal
import sys
import threading
import warnings
from typing import Any, Sequence

from kvserve.engine.arg_utils import add_engine_arguments, engine_kwargs_from_args

COMMANDS = ("generate", "chat", "serve", "run-batch", "bench", "plan", "env")
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class _OneLineErrorParser(argparse.ArgumentParser):
    """argparse that reports a usage error in one line (plus where to get help)."""

    help_command: str | None = None

    def error(self, message: str) -> None:  # type: ignore[override]
        help_command = self.help_command or self.prog
        sys.stderr.write(f"{self.prog}: error: {message} (see `{help_command} --help`)\n")
        sys.exit(EXIT_USAGE)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole CLI parser; `serve` and `bench` import their modules only when
    `command` names them."""
    parser = _OneLineErrorParser(
        prog="kvserve", description="LLM inference with a paged KV cache: generate, chat, serve, bench.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logging")
    parser.add_argument("--version", action="version", version=_version())
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_OneLineErrorParser)
    _add_generate_parser(subparsers)
    _add_chat_parser(subparsers)
    _add_serve_parser(subparsers, load=command == "serve")
    _add_run_batch_parser(subparsers, load=command == "run-batch")
    _add_bench_parser(subparsers, load=command == "bench")
    _add_plan_parser(subparsers, load=command == "plan")
    _add_env_parser(subparsers)
    return parser


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show tracebacks and debug logging")


def _add_sampling_arguments(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=max_tokens,
                       help=f"most tokens to generate (default {max_tokens})")
    group.add_argument("--temperature", type=float, default=0.7,
                       help="0 is greedy (default 0.7)")
    group.add_argument("--top-p", type=float, default=0.9, help="nucleus sampling mass (default 0.9)")
    group.add_argument("--system", default=None, metavar="TEXT",
                       help="system message (default: the chat template's own)")
    group.add_argument("--no-chat-template", action="store_true",
                       help="send the prompt as plain text, without the model's chat template")


def _add_generate_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "generate", help="answer one prompt, streamed to the terminal",
        description="Answer PROMPT (words are joined with spaces) with the model, streaming the answer. "
                    "The chat template is applied when the model has one.")
    parser.add_argument("prompt", nargs="+", metavar="PROMPT")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object (text, tokens, finish reason, timings) instead of streaming")
    _add_sampling_arguments(parser, max_tokens=256)
    add_engine_arguments(parser)
    _add_common(parser)


def _add_chat_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "chat", help="interactive chat in the terminal",
        description="Chat with the model. The conversation is kept between turns; "
                    "/reset starts over, /exit or Ctrl-D leaves.")
    parser.add_argument("--stats", action="store_true",
                        help="after each answer, show time to first token and cached prompt tokens")
    _add_sampling_arguments(parser, max_tokens=512)
    add_engine_arguments(parser)
    _add_common(parser)


def _add_serve_parser(subparsers: Any, load: bool) -> None:
    parser = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server",
                                   description="Serve the model over an OpenAI-compatible HTTP API.")
    _add_common(parser)
    if load:
        from kvserve.server.launch import add_serve_arguments
        add_serve_arguments(parser)


def _add_run_batch_parser(subparsers: Any, load: bool) -> None:
    parser = subparsers.add_parser(
        "run-batch", help="run an OpenAI batch file offline", add_help=load,
        description="Run every request of an OpenAI Batch API input file (JSON lines: custom_id, method, url, "
                    "body) through the server's handlers, without a server, and write one result line per "
                    "request. Rerunning skips the requests the output file already answers.")
    if load:
        from kvserve.server.batch import add_batch_arguments
        add_batch_arguments(parser)
        add_engine_arguments(parser)
        _add_common(parser)


def _add_bench_parser(subparsers: Any, load: bool) -> None:
    if load:
        from kvserve.bench.cli import add_bench_parser
        bench_parser = add_bench_parser(subparsers)
        if isinstance(bench_parser, argparse.ArgumentParser):
            _add_common(bench_parser)
    else:
        subparsers.add_parser("bench", help="benchmarks: throughput, serve, prefix, scheduler, ...",
                              add_help=False)


def _add_plan_parser(subparsers: Any, load: bool) -> None:
    parser = subparsers.add_parser("plan", help="capacity plan: replicas, TP size, KV memory for a load and SLO",
                                   description="Replay a synthetic load through the real scheduler with a "
                                               "step-cost model; print replicas, TP size, KV memory, "
                                               "predicted hit rate and latencies.", add_help=load)
    if load:
        from kvserve.planner.cli import add_plan_arguments
        add_plan_arguments(parser)
        _add_common(parser)


def _add_env_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("env", help="the CPU features, kernel paths, compiler and versions found here",
                                   description="Print what this machine offers the native kernels (CPU features "
                                               "by CPUID and as the OS enabled them), the path each kernel takes, "
                                               "the compiler and flags, the kernel cache, Python and torch.")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    _add_common(parser)


def run_env(args: argparse.Namespace) -> int:
    from kvserve.native.report import collect_env, format_env
    from kvserve import __version__
    report = {"kvserve": __version__, **collect_env()}
    print(json.dumps(report, indent=2) if args.json else format_env(report))
    return 0


def _version() -> str:
    from kvserve import __version__
    return f"kvserve {__version__}"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `kvserve` console script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    debug = "--debug" in argv
    # The KV pool's start-up line: on a terminal, and always for the server (whose log it is);
    # a piped `generate` keeps stderr for errors and the max-tokens note.
    _quiet_libraries(debug, show_kv_size=command not in ("generate", "chat") or sys.stderr.isatty())
    try:
        parser = build_parser(command if command in COMMANDS else None)
    except ImportError as exc:
        if debug:
            raise
        return _fail(f"`kvserve {command}` is not available yet ({exc})")
    if command in COMMANDS:
        parser.help_command = f"kvserve {command}"
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    # Python's final collection walks every object torch and the model created (0.3 s or more
    # of the exit); objects frozen at exit are skipped by it, and freed with their modules.
    atexit.unregister(gc.freeze)
    atexit.register(gc.freeze)
    try:
        return _run_command(args)
    except KeyboardInterrupt:
        sys.stderr.write("\n")
        return EXIT_INTERRUPTED
    except Exception as exc:  # noqa: BLE001 - the CLI turns every error into one line
        if args.debug:
            raise
        return _fail(_describe(exc))


def _run_command(args: argparse.Namespace) -> int:
    if args.command in ("generate", "chat", "serve", "run-batch"):
        _resolve_zoo_model(args)
    if args.command == "generate":
        return run_generate(args)
    if args.command == "chat":
        return run_chat(args)
    if args.command == "serve":
        from kvserve.server.launch import run
        return int(run(args) or 0)
    if args.command == "run-batch":
        from kvserve.server.batch import run as run_batch
        return run_batch(args)
    if args.command == "plan":
        from kvserve.planner.cli import run_plan
        return run_plan(args)
    if args.command == "env":
        return run_env(args)
    from kvserve.bench.cli import run as run_bench
    return int(run_bench(args) or 0)


def _resolve_zoo_model(args: argparse.Namespace) -> None:
    """`--model zoo:SHAPE-TYPE` (as the bench commands take it): the zoo file's path, built
    first when it is not cached; the server keeps the zoo name as the model's name."""
    model = getattr(args, "model", None)
    if not (isinstance(model, str) and model.startswith("zoo:")):
        return
    from kvserve.bench import zoo
    path = zoo.zoo_path(zoo.parse_zoo_name(model))  # an unknown shape or type: one-line ZooError
    if not os.path.isfile(path):
        sys.stderr.write(f"building {model} (once; cached in {zoo.zoo_dir()})...\n")
    args.model = zoo.resolve_zoo_model(model)
    if hasattr(args, "served_model_name") and not args.served_model_name:
        args.served_model_name = model


def _describe(exc: BaseException) -> str:
    if isinstance(exc, (ValueError, OSError, RuntimeError)) and str(exc):
        return str(exc).strip().splitlines()[0]
    return f"{type(exc).__name__}: {exc}".strip().splitlines()[0]


def _fail(message: str) -> int:
    sys.stderr.write(f"kvserve: error: {message}\n")
    return EXIT_ERROR


def _quiet_libraries(debug: bool, show_kv_size: bool = True) -> None:
    """No warnings or library logging on the terminal unless --debug."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if debug:
        logging.basicConfig(level=logging.DEBUG, format="%(levelname)s %(name)s: %(message)s")
        return
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("PYTHONWARNINGS", "ignore")  # also for worker processes (TP)
    warnings.simplefilter("ignore")
    logging.basicConfig(level=logging.ERROR, format="kvserve: %(message)s")
    if show_kv_size:
        logging.getLogger("kvserve.kv_cache_size").setLevel(logging.INFO)


# ---------------------------------------------------------------- generate / chat

def run_generate(args: argparse.Namespace) -> int:
    """`kvserve generate`: stream one answer to stdout (or print JSON)."""
    prompt = " ".join(args.prompt).strip()
    if not prompt:
        raise ValueError("the prompt is empty")
    params = _sampling_params(args)
    status = _Status()
    status.show("loading model...")
    llm = _make_llm(args)
    try:
        request = _build_request(llm, args, [{"role": "user", "content": prompt}])
        if args.json:
            status.clear()
            output = llm.generate([request], params, use_tqdm=False)[0]
            print(json.dumps(_output_as_dict(output), ensure_ascii=False))
        else:
            status.show("thinking...")
            output = _stream_to_stdout(llm, request, params, status)
            if len(output.outputs[0].token_ids) >= params.max_tokens:
                _dim_note(f"[stopped at --max-tokens {params.max_tokens}]")
    finally:
        status.clear()
        llm.shutdown()
    return 0


def run_chat(args: argparse.Namespace) -> int:
    """`kvserve chat`: a conversation in the terminal."""
    params = _sampling_params(args)
    status = _Status()
    status.show("loading model...")
    llm = _make_llm(args)
    status.clear()
    try:
        if args.no_chat_template or not getattr(llm.get_tokenizer(), "chat_template", None):
            raise ValueError("chat needs a model with a chat template (try `kvserve generate`)")
        _chat_loop(llm, args, params)
    finally:
        llm.shutdown()
    return 0


def _chat_loop(llm: Any, args: argparse.Namespace, params: Any) -> None:
    _enable_line_editing()
    first_messages = [{"role": "system", "content": args.system}] if args.system else []
    history = list(first_messages)
    sys.stderr.write(f"Chatting with {os.path.basename(str(llm.model_config.path))}. "
                     "/reset starts over, /exit or Ctrl-D leaves.\n")
    while True:
        try:
            line = input(">>> ").strip()
        except (EOFError, KeyboardInterrupt):
            sys.stdout.write("\n")
            return
        if not line:
            continue
        if line in ("/exit", "/quit"):
            return
        if line == "/reset":
            history = list(first_messages)
            print("(conversation cleared)")
            continue
        if line.startswith("/"):
            print("(commands: /reset, /exit)")
            continue
        history.append({"role": "user", "content": line})
        request = _build_request(llm, args, history)
        try:
            output = _stream_to_stdout(llm, request, params, _Status())
        except KeyboardInterrupt:
            sys.stdout.write("(interrupted)\n")
            history.pop()
            continue
        history.append({"role": "assistant", "content": output.outputs[0].text})
        if args.stats:
            sys.stderr.write(_stats_line(output) + "\n")


def _stream_to_stdout(llm: Any, request: dict, params: Any, status: "_Status") -> Any:
    """Print the answer as it arrives. Ctrl-C stops it between engine steps
    (so the engine stays consistent) and then raises KeyboardInterrupt."""
    last = None
    with _DeferredInterrupt() as interrupt:
        stream = llm.stream(request, params)
        try:
            for last in stream:
                new_text = last.outputs[0].new_text
                if new_text:
                    status.clear()
                    sys.stdout.write(new_text)
                    sys.stdout.flush()
                if interrupt.requested:
                    break
        finally:
            stream.close()
    status.clear()
    sys.stdout.write("\n")
    sys.stdout.flush()
    if interrupt.requested:
        raise KeyboardInterrupt
    return last


class _DeferredInterrupt:
    """Within the block, SIGINT only sets `requested` (checked between steps)."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None

    def __enter__(self) -> "_DeferredInterrupt":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def _on_sigint(self, signum: int, frame: Any) -> None:
        if self.requested:  # a second Ctrl-C: do not wait for the step
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc_info: Any) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


# One prompt or conversation at a time: the KV pool's default is sized for one sequence of
# the model's context (within the free memory; see ModelRunner.available_kv_memory_bytes).
INTERACTIVE_MAX_NUM_SEQS = 1


def _make_llm(args: argparse.Namespace) -> Any:
    """The engine for generate/chat. The cyclic garbage collector is off while it starts:
    importing torch and building the model create objects by the hundred thousand, none of
    them garbage, and each collection pass on the way walks them all again."""
    kwargs = engine_kwargs_from_args(args)
    kwargs.setdefault("max_num_seqs", INTERACTIVE_MAX_NUM_SEQS)
    gc.disable()
    try:
        from kvserve.engine.llm import LLM
        return LLM(**kwargs)
    finally:
        gc.enable()


def _sampling_params(args: argparse.Namespace) -> Any:
    from kvserve.sampling_params import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          seed=args.seed)


def _build_request(llm: Any, args: argparse.Namespace, messages: list[dict]) -> dict:
    """Prompt text and token ids: through the chat template when the model has one."""
    tokenizer = llm.get_tokenizer()
    if args.no_chat_template or not getattr(tokenizer, "chat_template", None):
        text = "\n".join(message["content"] for message in messages)
        return {"prompt": text, "prompt_token_ids": list(tokenizer.encode(text))}
    if args.system and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": args.system}, *messages]
    from kvserve.engine.tokenizer import chat_prompt
    text, token_ids = chat_prompt(tokenizer, messages)
    return {"prompt": text, "prompt_token_ids": token_ids}


def _output_as_dict(output: Any) -> dict:
    completion = output.outputs[0]
    metrics = output.metrics
    return {
        "text": completion.text,
        "finish_reason": completion.finish_reason,
        "num_prompt_tokens": len(output.prompt_token_ids),
        "num_cached_tokens": output.num_cached_tokens,
        "num_generated_tokens": len(completion.token_ids),
        "token_ids": completion.token_ids,
        "ttft_s": metrics.ttft_s if metrics else None,
        "total_s": metrics.total_s if metrics else None,
    }


def _stats_line(output: Any) -> str:
    metrics = output.metrics
    num_generated = len(output.outputs[0].token_ids)
    ttft_ms = (metrics.ttft_s or 0.0) * 1000
    decode_s = (metrics.total_s or 0.0) - (metrics.ttft_s or 0.0)
    rate = (num_generated - 1) / decode_s if decode_s > 0 and num_generated > 1 else 0.0
    return (f"[ttft {ttft_ms:.0f} ms | prompt {len(output.prompt_token_ids)} tokens, "
            f"{output.num_cached_tokens} cached | {num_generated} tokens, {rate:.1f} tok/s]")


def _dim_note(text: str) -> None:
    """One line on stderr, dimmed where stderr is a terminal."""
    sys.stderr.write(f"\033[2m{text}\033[0m\n" if sys.stderr.isatty() else f"{text}\n")
    sys.stderr.flush()


class _Status:
    """A transient status note on stderr, only when stderr is a terminal."""

    def __init__(self) -> None:
        self._shown = False
        self._enabled = sys.stderr.isatty()

    def show(self, text: str) -> None:
        if self._enabled:
            sys.stderr.write(f"\r\033[K\033[2m{text}\033[0m")
            sys.stderr.flush()
            self._shown = True

    def clear(self) -> None:
        if self._shown:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()
            self._shown = False


def _enable_line_editing() -> None:
    try:
        import readline  # noqa: F401 - importing it gives input() history and editing
    except ImportError:
        pass


if __name__ == "__main__":
    sys.exit(main())
