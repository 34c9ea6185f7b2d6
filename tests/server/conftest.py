"""Fixtures for the server tests: a fake-engine server in a thread, helpers."""
from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
import uvicorn

from kvserve.config import default_model_path
from kvserve.engine.tokenizer import load_tokenizer


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ThreadedServer:
    """uvicorn serving an app on 127.0.0.1 from a background thread."""

    def __init__(self, app) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.run(self.server.serve())

    def __enter__(self) -> "ThreadedServer":
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc_info) -> None:
        self.server.should_exit = True
        self.thread.join(20)
        assert not self.thread.is_alive(), "the server did not shut down"


@pytest.fixture(scope="session")
def tokenizer():
    """The default model's real tokenizer (no model weights needed)."""
    return load_tokenizer(default_model_path())


class ServerProcess:
    """`python -m kvserve.server.launch` as a subprocess on 127.0.0.1 and a free port."""

    def __init__(self, *flags: str, startup_timeout_s: float = 300.0) -> None:
        import os
        import subprocess
        import sys
        import tempfile

        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="kvserve-server-", suffix=".log", delete=False)
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kvserve.server.launch", "--host", "127.0.0.1",
             "--port", str(self.port), "--uvicorn-log-level", "warning", *flags],
            stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self._wait_ready(startup_timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        import httpx
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log_text()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout_s:.0f} s:\n{self.log_text()}")

    def log_text(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()[-5000:]

    def remove_log(self) -> None:
        import os
        self.log.close()
        os.unlink(self.log.name)

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, as an operator would; returns the exit code."""
        import signal
        import subprocess
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


def metric_values(base_url: str) -> dict[str, float]:
    """The /metrics page as {series (with labels): value}."""
    import httpx
    values = {}
    for line in httpx.get(base_url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            values[key] = float(value)
    return values


def wait_for_idle(base_url: str, idle_kv_usage: float, timeout_s: float = 30.0) -> dict[str, float]:
    """Poll /metrics until nothing runs or waits and KV usage is back to idle."""
    deadline = time.monotonic() + timeout_s
    while True:
        values = metric_values(base_url)
        idle = (values["kvserve_num_requests_running"] == 0 and values["kvserve_num_requests_waiting"] == 0
                and values["kvserve_num_requests_in_flight"] == 0
                and values["kvserve_kv_cache_usage_perc"] <= idle_kv_usage + 1e-9)
        if idle or time.monotonic() > deadline:
            return values
        time.sleep(0.2)
