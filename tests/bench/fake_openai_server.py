"""A tiny OpenAI-compatible SSE server with known timings, for testing the serving benchmark.

It streams `num_tokens` chunks per request: the first after `first_token_delay_s`,
then one every `inter_token_delay_s`. It records what it sent and how many
streams were open at once, so tests compare the client's measurements with
the server's own account. Run as a script (`python fake_openai_server.py --port
P`), it is a server child process that can kill itself with SIGSEGV on a given
request of a given start, as a crashing reference engine would.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


@dataclass
class FakeServerLog:
    """What the fake server saw and sent."""

    bodies: list[dict] = field(default_factory=list)
    arrival_times: list[float] = field(default_factory=list)
    tokens_sent: int = 0
    open_streams: int = 0
    max_open_streams: int = 0


def build_app(log: FakeServerLog, *, num_tokens: int, first_token_delay_s: float, inter_token_delay_s: float,
              fail_request_numbers: frozenset[int] = frozenset(), send_usage: bool = True,
              crash_on_request: int | None = None) -> FastAPI:
    app = FastAPI()
    lock = threading.Lock()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    async def stream(body: dict, chat: bool):
        with lock:
            log.open_streams += 1
            log.max_open_streams = max(log.max_open_streams, log.open_streams)
        try:
            await asyncio.sleep(first_token_delay_s)
            for i in range(num_tokens):
                if i:
                    await asyncio.sleep(inter_token_delay_s)
                choice = ({"index": 0, "delta": {"content": f" t{i}"}} if chat
                          else {"index": 0, "text": f" t{i}"})
                with lock:
                    log.tokens_sent += 1
                yield f"data: {json.dumps({'choices': [choice]})}\n\n"
            if send_usage:
                usage = {"prompt_tokens": len(str(body.get('prompt', body.get('messages'))).split()),
                         "completion_tokens": num_tokens}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            with lock:
                log.open_streams -= 1

    async def handle(request: Request, chat: bool):
        body = await request.json()
        with lock:
            number = len(log.bodies)
            log.bodies.append(body)
            log.arrival_times.append(time.perf_counter())
        if crash_on_request is not None and number + 1 == crash_on_request:
            os.kill(os.getpid(), signal.SIGSEGV)
        if number in fail_request_numbers:
            return JSONResponse({"error": {"message": "injected failure", "type": "server_error"}}, status_code=500)
        return StreamingResponse(stream(body, chat), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


class FakeServer:
    """Runs the fake app with uvicorn in a background thread on a free loopback port."""

    def __init__(self, **app_options) -> None:
        self.log = FakeServerLog()
        self._app = build_app(self.log, **app_options)
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.bind(("127.0.0.1", 0))
        self.port = self._socket.getsockname()[1]
        config = uvicorn.Config(self._app, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "FakeServer":
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fake server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._socket.close()


def _count_start(count_file: str) -> int:
    """This start's number (1-based), kept in `count_file` across the processes of a test."""
    try:
        with open(count_file) as f:
            previous = int(f.read() or 0)
    except FileNotFoundError:
        previous = 0
    with open(count_file, "w") as f:
        f.write(str(previous + 1))
    return previous + 1


def main() -> None:
    parser = argparse.ArgumentParser(description="a fake OpenAI streaming server")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--num-tokens", type=int, default=4)
    parser.add_argument("--count-file", help="counts this server's starts")
    parser.add_argument("--crash-in-start", type=int, help="on this start (needs --count-file) ...")
    parser.add_argument("--crash-on-request", type=int, default=1, help="... die by SIGSEGV on this request")
    args = parser.parse_args()
    crash = args.count_file is not None and _count_start(args.count_file) == args.crash_in_start
    app = build_app(FakeServerLog(), num_tokens=args.num_tokens, first_token_delay_s=0.001,
                    inter_token_delay_s=0.001, crash_on_request=args.crash_on_request if crash else None)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
