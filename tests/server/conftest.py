"""Fixtures for the server tests: a fake-engine server in a thread, helpers."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
import uvicorn
from helpers.server_process import free_port

from kvserve.engine.model_path import default_model_path
from kvserve.engine.tokenizer import load_tokenizer


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


def metric_values(base_url: str) -> dict[str, float]:
    """The /metrics page, parsed by prometheus_client, as {sample: value}.

    The key is the sample name, followed by its labels other than the
    `model_name` / `engine` every metric carries: `vllm:request_success_total{finished_reason="abort"}`.
    """
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    values = {}
    text = httpx.get(base_url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            extra = sorted((k, v) for k, v in sample.labels.items() if k not in ("model_name", "engine"))
            key = sample.name + ("{" + ",".join(f'{k}="{v}"' for k, v in extra) + "}" if extra else "")
            values[key] = sample.value
    return values


def wait_for_idle(base_url: str, idle_kv_usage: float, timeout_s: float = 30.0) -> dict[str, float]:
    """Poll /metrics until nothing runs or waits and KV usage is back to idle."""
    deadline = time.monotonic() + timeout_s
    while True:
        values = metric_values(base_url)
        idle = (values["vllm:num_requests_running"] == 0 and values["vllm:num_requests_waiting"] == 0
                and values["kvserve_num_requests_in_flight"] == 0
                and values["vllm:kv_cache_usage_perc"] <= idle_kv_usage + 1e-9)
        if idle or time.monotonic() > deadline:
            return values
        time.sleep(0.2)
