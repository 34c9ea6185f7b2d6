"""Local processes for the routing benchmark: kvserve replicas and the SGLang gateway.

Everything binds 127.0.0.1 on a free port. Each process writes its output to
a log file (shown in the error when it fails to start) and is stopped with
SIGTERM, then SIGKILL after a grace period, so a benchmark never leaves a
process behind.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable

logger = logging.getLogger(__name__)

GATEWAY_POLICIES = ("cache_aware", "power_of_two", "round_robin", "random")


class GatewayNotInstalledError(RuntimeError):
    """sglang-router is not importable; `pip install 'kvserve[router]'` installs it."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def gateway_available() -> bool:
    return importlib.util.find_spec("sglang_router") is not None


@dataclass
class LocalProcess:
    """One child process with its log file and loopback URL."""

    name: str
    argv: list[str]
    port: int
    env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen | None = None
    log_path: str = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "LocalProcess":
        log = tempfile.NamedTemporaryFile("w", prefix=f"kvserve-{self.name}-", suffix=".log", delete=False)
        self.log_path = log.name
        self.process = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                        env={**os.environ, **self.env}, start_new_session=True)
        log.close()
        return self

    def is_alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, num_chars: int = 3000) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-num_chars:]
        except OSError:
            return ""

    def wait_until(self, ready: Callable[[], bool], timeout_s: float) -> None:
        """Poll `ready` until true; raise with the log tail if the process dies or time runs out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.is_alive():
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                if ready():
                    return
            except Exception:  # noqa: BLE001 - not up yet
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"{self.name} not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL the whole process group, as a crashed host would look."""
        if self.is_alive():
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def stop(self, grace_s: float = 20.0) -> None:
        if self.process is None:
            return
        if self.is_alive():
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                logger.warning("%s ignored SIGTERM for %.0f s; killing it", self.name, grace_s)
                self.kill()
        try:
            os.unlink(self.log_path)
        except OSError:
            pass


def _get_json(url: str, timeout_s: float = 2.0):
    import httpx
    response = httpx.get(url, timeout=timeout_s, trust_env=False)
    response.raise_for_status()
    return response.json()


def start_replica(index: int, served_model_name: str, engine_flags: list[str], *,
                  threads: int | None, timeout_s: float = 600.0) -> LocalProcess:
    """`kvserve serve` on a free loopback port; returns once /health answers 200."""
    port = free_port()
    argv = [sys.executable, "-m", "kvserve.server.launch", "--host", "127.0.0.1", "--port", str(port),
            "--served-model-name", served_model_name, "--uvicorn-log-level", "warning", *engine_flags]
    env = {"TOKENIZERS_PARALLELISM": "false"}
    if threads:
        env.update({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)})
    replica = LocalProcess(f"replica{index}", argv, port, env).start()
    replica.wait_until(lambda: _get_json(replica.url + "/health").get("status") == "ok", timeout_s)
    return replica


def start_gateway(worker_urls: list[str], policy: str, *, timeout_s: float = 60.0,
                  extra_flags: tuple[str, ...] = ()) -> LocalProcess:
    """SGLang's Model Gateway over `worker_urls`; returns once it lists every worker healthy."""
    if not gateway_available():
        raise GatewayNotInstalledError("the SGLang Model Gateway is not installed: "
                                       "pip install 'kvserve[router]' (or sglang-router)")
    if policy not in GATEWAY_POLICIES:
        raise ValueError(f"unknown gateway policy {policy!r}; choose from {', '.join(GATEWAY_POLICIES)}")
    port, metrics_port = free_port(), free_port()
    argv = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", *worker_urls, "--policy", policy, "--log-level", "warn",
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
            # Fast failure detection and retries that outlast it, so a killed replica is routed around.
            "--health-check-interval-secs", "1", "--health-failure-threshold", "2",
            "--retry-initial-backoff-ms", "250", "--retry-max-backoff-ms", "2000", *extra_flags]
    gateway = LocalProcess(f"gateway-{policy}", argv, port).start()

    def all_workers_healthy() -> bool:
        workers = _get_json(gateway.url + "/workers").get("workers") or []
        return len(workers) == len(worker_urls) and all(w.get("is_healthy") for w in workers)

    gateway.wait_until(all_workers_healthy, timeout_s)
    return gateway
