"""`kvserve serve` flags: parsed by the real CLI parser, no model loaded."""
from __future__ import annotations

import argparse

import pytest

from kvserve.cli import build_parser
from kvserve.engine.arg_utils import engine_kwargs_from_args
from kvserve.server.launch import add_serve_arguments, served_name


def test_serve_defaults_bind_loopback():
    args = build_parser("serve").parse_args(["serve"])
    assert args.host == "127.0.0.1" and args.port == 8000
    assert args.max_concurrent_requests is None and args.max_body_size == 4 * 1024 * 1024
    assert served_name(args, "/models/SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert served_name(args, "/models/llama-dir/") == "llama-dir"


def test_serve_flags_reach_server_and_engine(monkeypatch):
    monkeypatch.delenv("KVSERVE_API_KEY", raising=False)
    args = build_parser("serve").parse_args([
        "serve", "--model", "/m.gguf", "--host", "0.0.0.0", "--port", "9001", "--api-key", "k",
        "--served-model-name", "mine", "--max-model-len", "512", "--max-concurrent-requests", "32",
        "--max-waiting-requests", "8", "--max-body-size", "1MiB", "--no-prefix-caching"])
    assert (args.host, args.port, args.api_key, args.served_model_name) == ("0.0.0.0", 9001, "k", "mine")
    assert (args.max_concurrent_requests, args.max_waiting_requests) == (32, 8)
    assert args.max_body_size == 2**20
    kwargs = engine_kwargs_from_args(args)
    assert kwargs["model"] == "/m.gguf" and kwargs["max_model_len"] == 512
    assert kwargs["enable_prefix_caching"] is False


def test_api_key_from_environment(monkeypatch):
    monkeypatch.setenv("KVSERVE_API_KEY", "from-env")
    parser = add_serve_arguments(argparse.ArgumentParser())
    assert parser.parse_args([]).api_key == "from-env"


def test_lost_node_flags():
    parser = build_parser("serve")
    defaults = parser.parse_args(["serve"])
    assert defaults.exit_on_lost_node is True and "heartbeat_timeout_s" not in engine_kwargs_from_args(defaults)
    args = parser.parse_args(["serve", "--heartbeat-timeout", "2.5", "--no-exit-on-lost-node"])
    assert args.exit_on_lost_node is False and engine_kwargs_from_args(args)["heartbeat_timeout_s"] == 2.5
    from kvserve.config import ConfigError, ParallelConfig
    assert ParallelConfig().heartbeat_timeout_s == 10.0
    with pytest.raises(ConfigError, match="heartbeat_timeout_s must be > 0"):
        ParallelConfig(heartbeat_timeout_s=0)
