"""`kvserve run-batch`: an OpenAI Batch API input file, run offline, into its output file.

Each input line is `{"custom_id", "method": "POST", "url", "body"}` with `url` one of
/v1/chat/completions, /v1/completions, /v1/responses, /v1/messages. The engine runs in
this process and every line goes through the server's own app in memory (no socket),
so a line gets exactly the answer `kvserve serve` would give it. Each line is answered
by one output line, written as soon as it is known:
`{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error": null}`,
or for a line that cannot be run (not JSON, no custom_id, another method or url, a
streamed body, a custom_id used twice) `{"id", "custom_id", "response": null,
"error": {"code", "message", "line"}}`. A rerun on the same files skips the lines the
output already answers (a cut-off last line is dropped first), so an interrupted run
is finished by running it again.
"""
from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid
from dataclasses import dataclass
from typing import Any, Iterator

BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")
DEFAULT_MAX_CONCURRENCY = 64


@dataclass
class BatchLine:
    """One line of the input file: a request to run, or the reason it cannot run."""

    number: int  # 1-based
    custom_id: str | None = None
    url: str | None = None
    body: dict | None = None
    problem: str | None = None

    @property
    def keys(self) -> tuple[str, ...]:
        """What an output line answering this line is recorded under."""
        line_key = f"line:{self.number}"
        return (line_key,) if self.problem else (f"custom_id:{self.custom_id}", line_key)


def parse_batch_lines(lines: Iterator[str]) -> list[BatchLine]:
    """Every non-blank input line, checked; a custom_id seen before makes a line a problem."""
    parsed: list[BatchLine] = []
    first_use: dict[str, int] = {}
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        line = _parse_line(number, text)
        if line.problem is None:
            if line.custom_id in first_use:
                line.problem = f"custom_id {line.custom_id!r} is already used by line {first_use[line.custom_id]}"
            else:
                first_use[line.custom_id] = number
        parsed.append(line)
    return parsed


def _parse_line(number: int, text: str) -> BatchLine:
    line = BatchLine(number)
    try:
        request = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        line.problem = f"not valid JSON: {exc}"
        return line
    if not isinstance(request, dict):
        line.problem = "a line must be a JSON object with custom_id, method, url and body"
        return line
    custom_id = request.get("custom_id")
    if isinstance(custom_id, str) and custom_id:
        line.custom_id = custom_id
    line.problem = _request_problem(request)
    if line.problem is None:
        line.url, line.body = request["url"], request["body"]
    return line


def _request_problem(request: dict) -> str | None:
    if not isinstance(request.get("custom_id"), str) or not request["custom_id"]:
        return "custom_id must be a non-empty string"
    if request.get("method") != "POST":
        return f"method must be 'POST', not {request.get('method')!r}"
    if request.get("url") not in BATCH_URLS:
        return f"url {request.get('url')!r} is not one of {', '.join(BATCH_URLS)}"
    if not isinstance(request.get("body"), dict):
        return "body must be a JSON object"
    if request["body"].get("stream"):
        return "body.stream is not supported in a batch"
    return None


def answered_keys(output_path: str) -> set[str]:
    """Keys of the lines an existing output file answers; a cut-off last line is removed."""
    if not os.path.exists(output_path):
        return set()
    with open(output_path, "rb+") as f:
        data = f.read()
        complete = data[:data.rfind(b"\n") + 1]
        if len(complete) != len(data):
            f.truncate(len(complete))
    keys = set()
    for raw in complete.splitlines():
        try:
            result = json.loads(raw)
        except json.JSONDecodeError:
            continue  # not ours: left alone
        if not isinstance(result, dict):
            continue
        error = result.get("error")
        if isinstance(error, dict) and isinstance(error.get("line"), int):
            keys.add(f"line:{error['line']}")
        elif isinstance(result.get("custom_id"), str):
            keys.add(f"custom_id:{result['custom_id']}")
    return keys


def pending_lines(input_file: str, output_file: str) -> tuple[list[BatchLine], int]:
    """(the input lines the output file does not answer yet, how many it answers)."""
    if os.path.abspath(input_file) == os.path.abspath(output_file):
        raise ValueError("the output file must not be the input file")
    with open(input_file, encoding="utf-8", errors="surrogateescape") as f:
        lines = parse_batch_lines(f)
    done = answered_keys(output_file)
    todo = [line for line in lines if not done.intersection(line.keys)]
    return todo, len(lines) - len(todo)


def _result_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"


def problem_result(line: BatchLine, message: str) -> dict:
    return {"id": _result_id(), "custom_id": line.custom_id, "response": None,
            "error": {"code": "invalid_request", "message": f"line {line.number}: {message}", "line": line.number}}


async def answer_line(client: Any, line: BatchLine) -> dict:
    """The output line for `line`, its request run through the app behind `client`."""
    if line.problem is not None:
        return problem_result(line, line.problem)
    try:
        response = await client.post(line.url, json=line.body)
    except Exception as exc:  # noqa: BLE001 - the line is still answered
        return problem_result(line, f"{type(exc).__name__}: {exc}")
    try:
        body = response.json()
    except ValueError:
        body = {"text": response.text}
    return {"id": _result_id(), "custom_id": line.custom_id, "error": None,
            "response": {"status_code": response.status_code, "request_id": f"req_{uuid.uuid4().hex}",
                         "body": body}}


async def run_lines(app: Any, lines: list[BatchLine], output_path: str, max_concurrency: int,
                    show_progress: bool = True) -> int:
    """Answer `lines` through `app`, appending one output line each as it is known; returns
    how many were answered."""
    import httpx
    from tqdm import tqdm

    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    pending = iter(lines)
    progress = tqdm(total=len(lines), unit="req", desc="run-batch", file=sys.stderr, disable=not show_progress)
    answered = 0
    with open(output_path, "a", encoding="utf-8") as out:
        async with httpx.AsyncClient(transport=transport, base_url="http://kvserve", timeout=None) as client:
            async def worker() -> None:
                nonlocal answered
                for line in pending:
                    result = await answer_line(client, line)
                    out.write(json.dumps(result) + "\n")
                    out.flush()
                    answered += 1
                    progress.update(1)

            await asyncio.gather(*(worker() for _ in range(max(1, min(max_concurrency, len(lines))))))
    progress.close()
    return answered


def run(args: Any) -> int:
    """`kvserve run-batch`: returns the exit code."""
    from kvserve.engine.arg_utils import engine_config_from_args
    from kvserve.engine.async_llm import AsyncLLM
    from kvserve.server.app import build_app
    from kvserve.server.launch import served_name

    todo, skipped = pending_lines(args.input_file, args.output_file)
    if skipped:
        sys.stderr.write(f"run-batch: {skipped} of {skipped + len(todo)} lines already answered "
                         f"in {args.output_file}\n")
    if not todo:
        return 0
    engine_config = engine_config_from_args(args)
    engine = AsyncLLM(engine_config)
    try:
        app = build_app(engine, served_name(args, engine_config.model_config.path), shutdown_engine=False,
                        tool_call_parser=args.tool_call_parser)
        asyncio.run(run_lines(app, todo, args.output_file, args.max_concurrency, not args.no_progress))
    finally:
        engine.shutdown()
    return 0


def add_batch_arguments(parser: Any) -> Any:
    """The flags of `kvserve run-batch` (the engine flags are added by the caller)."""
    parser.add_argument("-i", "--input-file", required=True, help="OpenAI batch input file (JSON lines)")
    parser.add_argument("-o", "--output-file", required=True,
                        help="results file (JSON lines); lines it already answers are skipped")
    parser.add_argument("--served-model-name", default=None,
                        help="model name the lines' bodies may give (default: the model file or folder name)")
    parser.add_argument("--max-concurrency", type=int, default=DEFAULT_MAX_CONCURRENCY,
                        help=f"lines in flight at once (default {DEFAULT_MAX_CONCURRENCY})")
    parser.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json", "mistral"],
                        help="format of tool calls in the model's output (default: from the chat template)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser
