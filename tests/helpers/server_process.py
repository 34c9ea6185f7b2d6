"""A kvserve server as a subprocess on 127.0.0.1, for tests that talk to it over HTTP."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Iterator

import httpx

LAUNCH_MODULE = ("-m", "kvserve.server.launch")
CLI_SERVE = ("-m", "kvserve.cli", "serve")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """`python <command> --host 127.0.0.1 --port <free> <flags>`, ready (GET /health = 200)
    when the constructor returns, running until `stop()`. Its output goes to a log file."""

    def __init__(self, *flags: str, command: tuple[str, ...] = LAUNCH_MODULE,
                 startup_timeout_s: float = 300.0) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="kvserve-server-", suffix=".log", delete=False)
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        self.process = subprocess.Popen(
            [sys.executable, *command, "--host", "127.0.0.1", "--port", str(self.port),
             "--uvicorn-log-level", "warning", *flags],
            stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self._wait_ready(startup_timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log_text()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout_s:.0f} s:\n{self.log_text()}")

    def log_text(self) -> str:
        """The last 5000 characters the server wrote."""
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()[-5000:]

    def remove_log(self) -> None:
        self.log.close()
        os.unlink(self.log.name)

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, as an operator would; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
                raise AssertionError("the server did not stop within "
                                     f"{timeout_s:.0f} s of SIGTERM:\n{self.log_text()}")
        return self.process.returncode


@contextlib.contextmanager
def running_server(*flags: str, **kwargs) -> Iterator[ServerProcess]:
    """A `ServerProcess` for the `with` block (a module fixture's body), stopped and its log removed after."""
    process = ServerProcess(*flags, **kwargs)
    try:
        yield process
    finally:
        process.stop()
        process.remove_log()
