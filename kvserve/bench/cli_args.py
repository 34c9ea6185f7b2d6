"""The flags of each `kvserve bench` sub-command (`COMMANDS`: name -> (adds its flags, help)).

`kvserve.bench.cli` adds them to the parser and runs the benchmark they name.
"""
from __future__ import annotations

import argparse


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("output")
    group.add_argument("--output-json", default=None, metavar="PATH",
                       help="where to write the JSON result (default bench_results/<benchmark>.json)")
    group.add_argument("--output-png", default=None, metavar="PATH",
                       help="where to write the plot (default: next to the JSON)")
    group.add_argument("--no-plot", action="store_true", help="do not write a PNG")
    group.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show tracebacks and debug logging")


def _add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    from kvserve.engine.arg_utils import add_engine_arguments
    add_engine_arguments(parser)


def _add_workload_arguments(parser: argparse.ArgumentParser, default_workloads: str) -> None:
    group = parser.add_argument_group("workload")
    group.add_argument("--workloads", default=default_workloads,
                       help=f"comma-separated: fixed, mixed, single, ragged, prefill (default {default_workloads})")
    group.add_argument("--num-prompts", type=int, default=None,
                       help="requests per workload (default: fixed 32, mixed 64, single 1, ragged 16)")
    group.add_argument("--prefill-len", type=int, default=512, help="prompt tokens of the prefill workload")
    group.add_argument("--prompt-len", type=int, default=64, help="prompt tokens, fixed/single workloads")
    group.add_argument("--output-len", type=int, default=128, help="new tokens, fixed/single workloads")
    group.add_argument("--max-prompt-len", type=int, default=1024, help="clip of the mixed prompt lengths")
    group.add_argument("--max-output-len", type=int, default=512, help="clip of the mixed output lengths")
    group.add_argument("--workload-seed", type=int, default=0, help="seed of the generated workloads")
    group.add_argument("--no-warmup", action="store_true", help="time the very first request too")


def _add_roofline_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, metavar="PATH",
                        help="model whose shapes to measure (default: the default model)")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated torch dtypes")
    parser.add_argument("--batch-sizes", default="1,256", help="comma-separated token counts per matmul")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats (median)")
    parser.add_argument("--bandwidth-mib", type=int, default=512, help="buffer read for the bandwidth figure")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--tiny", action="store_true", help="a tiny made-up model shape (CI smoke test)")
    parser.add_argument("--kernels", default="", help="also time each weight shape through these matmul kernels, "
                                                      "comma-separated: torch, onednn, f32-panels")


def _add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="server URL on loopback")
    parser.add_argument("--roofline-json", default=None, metavar="PATH",
                        help="a `kvserve bench roofline` result whose read bandwidth the bound uses "
                             "(default: measured by this run)")
    parser.add_argument("--served-model", default=None, help="model name to send (default: first of /v1/models)")
    parser.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=128, help="words per prompt (about 1 token each)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=None,
                        help="most requests in flight (default 8 when no --request-rate)")
    parser.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals, requests/s")
    parser.add_argument("--no-ignore-eos", action="store_true", help="let the model stop at EOS")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    parser.add_argument("--trace-out", default=None, metavar="JSONL",
                        help="write the run as a trace for `kvserve plan --trace` (send times, token counts)")


def _add_served_model_file_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, metavar="PATH",
                        help="the model file the server runs: each rate gets its memory-bandwidth bound")


def _add_serve_only_arguments(parser: argparse.ArgumentParser) -> None:
    _add_serve_arguments(parser)
    _add_served_model_file_argument(parser)


def _add_serve_compare_arguments(parser: argparse.ArgumentParser) -> None:
    _add_serve_arguments(parser)
    parser.set_defaults(num_prompts=32, endpoint="chat")
    parser.add_argument("--model", default=None, metavar="PATH", help="GGUF both servers load (default model)")
    parser.add_argument("--rounds", type=int, default=1, help="rounds, alternating which server goes first")
    parser.add_argument("--kvserve-args", default="", help="extra `kvserve serve` flags, one quoted string")
    parser.add_argument("--llama-server", default=None, metavar="PATH",
                        help="llama-server binary (default: llama-server on PATH, else the one "
                             "scripts/build_llama_server.sh cached, else llama_cpp.server)")
    parser.add_argument("--context-per-slot", type=int, default=2048, help="llama.cpp context per sequence slot")


def _add_roofline_json_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--roofline-json", default=None, metavar="PATH",
                        help="a `kvserve bench roofline` result: adds the ceilings and how close each run comes")


def _add_throughput_arguments(parser: argparse.ArgumentParser) -> None:
    _add_workload_arguments(parser, "fixed,mixed")
    _add_roofline_json_argument(parser)
    _add_engine_arguments(parser)


def _add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    _add_workload_arguments(parser, "fixed,mixed")
    parser.add_argument("--references", default="transformers,transformers-cb,llama.cpp,vllm-scheduler",
                        help="comma-separated references to run when available (transformers: length-sorted "
                             "static batches; transformers-cb: its continuous batching)")
    parser.add_argument("--hf-batch-size", type=int, default=32,
                        help="the references' concurrency: transformers' batch (static and continuous) and "
                             "llama.cpp's number of sequence slots")
    parser.add_argument("--llama-cpp-weights", choices=("dtype", "stored"), default="stored",
                        help="llama.cpp on the file as stored (e.g. Q4_1, default) or on the GGUF re-stored "
                             "at kvserve's dtype (equal precision)")
    parser.add_argument("--no-generate-rss", action="store_true",
                        help="skip measuring the peak RSS of `kvserve generate` on the model (defaults)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every engine this many times, alternating their order; report the median")
    _add_roofline_json_argument(parser)
    _add_engine_arguments(parser)


def _add_prefix_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--prefix-len", type=int, default=1000,
                        help="shared prefix tokens (default 1000: not a multiple of the block size)")
    parser.add_argument("--question-len", type=int, default=24)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--partial-hash-block-size", type=int, default=None,
                        help="hash unit of the partial-block run (default block size / 4)")
    parser.add_argument("--workload-seed", type=int, default=0)
    _add_engine_arguments(parser)


def _add_profile_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-size", type=int, default=32, help="requests decoding together")
    parser.add_argument("--context-len", type=int, default=256, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=16, help="decode steps timed and profiled")
    parser.add_argument("--ab-fewer-barriers", type=int, default=0, metavar="ROUNDS",
                        help="then time ROUNDS alternating rounds of --steps steps each with the native call's "
                             "fewer barriers a layer (the default) and without (NativeDecoder.fewer_barriers)")
    parser.add_argument("--ab-moe-split", type=int, default=0, metavar="ROUNDS",
                        help="then time ROUNDS alternating rounds of --steps steps each with the MoE layers' chosen "
                             "experts split over the threads whole and by rows (NativeDecoder.moe_split)")
    _add_engine_arguments(parser)


def _add_startup_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="a .gguf file or zoo:SHAPE-TYPE (llama.cpp runs the same file)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds of both engines")
    parser.add_argument("--max-tokens", type=int, default=8, help="greedy tokens of the answer")
    parser.add_argument("--prompt", default="Hi", help="the prompt (kvserve applies the chat template)")
    parser.add_argument("--cold", action="store_true",
                        help="evict the model file (and kvserve's caches of it) from the page cache before each run")
    parser.add_argument("--n-ctx", type=int, default=None,
                        help="llama.cpp's context (default: the model's context, as kvserve's default KV pool)")


def _add_zoo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("names", nargs="*", metavar="SHAPE-TYPE",
                        help="zoo models to build, e.g. llama-1b-q4_k_m (none: list the zoo)")
    parser.add_argument("--all", action="store_true",
                        help="build every full-size shape in the standard types (tens of GB, hours on 2 cores)")


def _add_host_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-size", type=int, default=1, help="requests per round")
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=128, help="greedy new tokens per request")
    parser.add_argument("--rounds", type=int, default=5, help="rounds; modes alternate within each")
    parser.add_argument("--modes", default="auto",
                        help="comma-separated: auto (the engine's choice), async (always a step ahead), sync, "
                             "per-op (auto with the native decoder paused: every step on the per-op path)")
    parser.add_argument("--no-split", action="store_true", help="do not time the pieces of a step")
    _add_engine_arguments(parser)


def _add_scheduler_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-running", default="64,256,1024", help="comma-separated running request counts")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16)


def _add_kv_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-requests", type=int, default=10_000)


def _add_attention_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-sizes", default="1,32", help="comma-separated requests decoding together")
    parser.add_argument("--context-lens", default="64,256,512", help="comma-separated keys per request")
    parser.add_argument("--kv-dtypes", default="float32,bfloat16,float16", help="comma-separated KV-cache dtypes")
    parser.add_argument("--isas", default=None,
                        help="comma-separated kernel paths: avx512, avx2, portable (default: the widest here)")
    parser.add_argument("--num-heads", type=int, default=9, help="query heads (default: SmolLM2's 9)")
    parser.add_argument("--num-kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=30, help="separate KV caches, one call each per sweep")
    parser.add_argument("--repeats", type=int, default=20, help="sweeps timed; the median is reported")
    parser.add_argument("--threads", type=int, default=None, help="kernel threads (default: torch's)")


def _add_gguf_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--types", default="Q4_K,Q6_K", help="comma-separated GGUF block types")
    parser.add_argument("--out-features", type=int, default=2048)
    parser.add_argument("--in-features", type=int, default=8192)
    parser.add_argument("--batch-sizes", default="1", help="comma-separated activation rows per call")
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--isas", default=None,
                        help="comma-separated kernel paths: avx512, avx2, portable (default: the widest here)")
    parser.add_argument("--footprint-mb", type=int, default=256,
                        help="copies of the matrix cycled through, together this size (above the caches)")
    parser.add_argument("--repeats", type=int, default=10, help="sweeps timed; the median is reported")


def _add_structured_arguments(parser: argparse.ArgumentParser) -> None:
    _add_engine_arguments(parser)
    parser.add_argument("--batch", type=int, default=32, help="matchers / requests at once (default 32)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per request in the engine part")
    parser.add_argument("--skip-engine", action="store_true", help="only time the grammar back-ends")


# ---------------------------------------------------------------- runners

def _add_spec_arguments(parser: argparse.ArgumentParser) -> None:
    _add_engine_arguments(parser)
    group = parser.add_argument_group("speculative decoding")
    group.add_argument("--rounds", type=int, default=3, help="rounds, each running both engines (default 3)")
    group.add_argument("--max-tokens", type=int, default=128, help="new tokens per chat (default 128)")
    group.add_argument("--scenarios", default="grounded,unrelated,unrelated batch",
                       help="comma-separated: grounded, unrelated, unrelated batch")
    group.add_argument("--draft-layers", type=int, default=None, metavar="N",
                       help="speculate with method draft_model, the draft being the target GGUF cut to N "
                            "layers (the first N-2 and the last two), written to a temporary directory")
    group.add_argument("--control", action="store_true",
                       help="also run a second engine without speculation (an A/A control: the ratio the "
                            "measurement resolves, reported next to the speed-up)")


def _add_route_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", type=int, default=2, help="kvserve replicas to start (default 2)")
    parser.add_argument("--policies", default="cache_aware,power_of_two,round_robin,random",
                        help="comma-separated gateway policies, one run each")
    parser.add_argument("--num-users", type=int, default=12, help="concurrent chat users (default 12)")
    parser.add_argument("--num-system-prompts", type=int, default=4, help="shared system prompts (default 4)")
    parser.add_argument("--system-prompt-words", type=int, default=240, help="words per system prompt")
    parser.add_argument("--turns", type=int, default=2, help="chat turns per user (default 2)")
    parser.add_argument("--max-tokens", type=int, default=12, help="tokens generated per turn")
    parser.add_argument("--concurrency", type=int, default=4, help="most requests in flight")
    parser.add_argument("--replica-args", default="--max-model-len 1024 --kv-cache-memory 48MiB",
                        help="flags for every `kvserve serve` replica (one quoted string)")
    parser.add_argument("--replica-threads", type=int, default=1, help="torch threads per replica (0: torch's)")
    parser.add_argument("--kill-replica-after", type=int, default=None, metavar="N",
                        help="add a cache_aware run that SIGKILLs the last replica after N requests finished")
    parser.add_argument("--trace-out", default=None, metavar="JSONL",
                        help="each policy's run as a `kvserve plan --trace` trace, <stem>.<policy>.jsonl "
                             "(default: next to the JSON, <json stem>.trace.<policy>.jsonl)")
    parser.add_argument("--seed", type=int, default=0)


def _add_plan_check_arguments(parser: argparse.ArgumentParser) -> None:
    server = parser.add_argument_group("the server (one `kvserve serve` on loopback)")
    server.add_argument("--model", default=None, metavar="PATH", help="model to serve (default: the default model)")
    server.add_argument("--kv-cache-memory", default="64MiB", help="KV pool of the server (default 64MiB)")
    server.add_argument("--max-model-len", type=int, default=1024)
    server.add_argument("--block-size", type=int, default=16)
    server.add_argument("--max-num-seqs", type=int, default=64)
    server.add_argument("--max-num-batched-tokens", type=int, default=2048)
    server.add_argument("--server-args", default="", help="more `kvserve serve` flags (one quoted string)")
    server.add_argument("--server-threads", type=int, default=0, help="torch threads of the server (0: torch's)")
    server.add_argument("--roofline-json", default=None, metavar="PATH",
                        help="also predict with the roofline step cost of this `kvserve bench roofline` JSON")
    server.add_argument("--roofline-dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    server.add_argument("--tp", type=int, default=1,
                        help="check the plan's TP > 1 step cost: calibrate one rank, time all-reduces, then "
                             "calibrate and measure a -tp N server (default 1)")
    server.add_argument("--activation-bytes", type=int, default=4,
                        help="bytes per activation on the TP wire (4: float32 on CPU)")
    load = parser.add_argument_group("the trace")
    load.add_argument("--trace", default=None, metavar="JSONL", help="replay this recorded trace")
    load.add_argument("--trace-out", default=None, metavar="JSONL",
                      help="write the replayed trace here (default: next to the JSON, .trace.jsonl)")
    load.add_argument("--arrival-rate", type=float, default=1.0, help="requests per second (Poisson)")
    load.add_argument("--num-requests", type=int, default=40)
    load.add_argument("--prompt-len", type=int, default=192, help="median prompt tokens (log-normal)")
    load.add_argument("--output-len", type=int, default=24, help="median output tokens (log-normal)")
    load.add_argument("--len-sigma", type=float, default=0.5)
    load.add_argument("--shared-prefix-ratio", type=float, default=0.5)
    load.add_argument("--num-shared-prefixes", type=int, default=4)
    load.add_argument("--seed", type=int, default=0)


def _add_allreduce_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world-size", type=int, default=2, help="processes in the gloo group (default 2)")
    parser.add_argument("--repeats", type=int, default=30, help="all-reduces timed per message size")


def int_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def name_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]



COMMANDS = {
    "roofline": (_add_roofline_arguments, "matmul GFLOP/s and memory bandwidth, and the model's tokens/s ceilings"),
    "throughput": (_add_throughput_arguments, "offline throughput of kvserve.LLM on fixed and mixed workloads"),
    "serve": (_add_serve_only_arguments, "latency and throughput of an OpenAI-compatible server on loopback"),
    "serve-compare": (_add_serve_compare_arguments, "kvserve serve against llama.cpp's server, same client"),
    "prefix": (_add_prefix_arguments, "TTFT and prefill tokens with prefix caching off, on, and partial-block"),
    "compare": (_add_compare_arguments, "kvserve against transformers (and llama.cpp, vLLM when importable)"),
    "profile": (_add_profile_arguments, "where the time of one decode step goes"),
    "host": (_add_host_arguments, "host work per token of LLM.generate: wall time minus the native call's"),
    "scheduler": (_add_scheduler_arguments, "microseconds per scheduler step at many running requests"),
    "kv": (_add_kv_arguments, "KV-cache allocate/free and prefix-hit operations per second"),
    "attention": (_add_attention_arguments, "the paged attention kernel alone: us per layer, K/V GB/s, GFLOP/s"),
    "gguf": (_add_gguf_arguments, "the as-stored GGUF matmul kernels alone: weight GB/s against the read bound"),
    "structured": (_add_structured_arguments, "grammar back-ends (compile, mask per token) and constrained throughput"),
    "spec": (_add_spec_arguments, "speculative decoding on vs off: input-grounded and unrelated chats"),
    "route": (_add_route_arguments, "N replicas behind SGLang's Model Gateway: hit rate, TTFT, spread per policy"),
    "plan-check": (_add_plan_check_arguments, "`kvserve plan`'s calibrated prediction against a measured run"),
    "allreduce": (_add_allreduce_arguments, "gloo all-reduce latency and bandwidth between local processes"),
    "startup": (_add_startup_arguments, "start-up time and peak RSS of kvserve generate against llama.cpp, "
                                        "each a fresh process"),
    "zoo": (_add_zoo_arguments, "list or build the random-weight GGUF models that --model zoo:SHAPE-TYPE names"),
}
