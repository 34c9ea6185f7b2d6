"""Start-up and peak memory of a one-shot answer: `kvserve generate` against llama.cpp, each a
fresh process, as a user starts them.

One round runs each engine once (the order alternates between rounds, so neither always runs
on the page cache the other warmed): a short prompt, greedy, `max_tokens` tokens, then exit.
Per run: the wall time from spawn to exit, the time to the first byte of the answer on stdout
(both engines stream), the CPU seconds it used (user + system: less moved by other load
than the wall time, but it counts every thread), and the process's peak RSS (`ru_maxrss` from `wait4` on the child;
Linux carries the spawning parent's peak across exec, so the figure is the child's own only
above this process's peak, which the result reports too). The summary is the median of the
per-round ratios kvserve / llama.cpp, and each engine's median.

llama.cpp runs through its Python binding (llama-cpp-python, the same build `bench compare`
uses): a Python interpreter that imports the binding, loads the file (mmap, as llama.cpp
does), decodes the same prompt with a context as long as kvserve's and prints each token.
No llama.cpp command-line binary is built here, so its figures include the interpreter's
start (about 20 ms) and the binding's import.

`cold` drops the model file (and kvserve's repacked and tokenizer caches of it) from the page
cache before every run with posix_fadvise(DONTNEED): the first start after the file was
copied in, without flushing the rest of the machine's cache.
"""
from __future__ import annotations

import os
import select
import statistics
import subprocess
import sys
import time
from typing import Any

PROMPT = "Hi"

# The llama.cpp run: load, tokenize the prompt (BOS added as llama.cpp does), decode greedily,
# print each token's text as it comes.
_LLAMA_CPP_SCRIPT = r"""
import sys
import llama_cpp as lib
path, prompt, max_tokens, n_ctx = sys.argv[1], sys.argv[2].encode(), int(sys.argv[3]), int(sys.argv[4])
quiet = lib.llama_log_callback(lambda level, text, data: None)  # held: llama.cpp calls it later
lib.llama_log_set(quiet, None)
lib.llama_backend_init()
model = lib.llama_model_load_from_file(path.encode(), lib.llama_model_default_params())
vocab = lib.llama_model_get_vocab(model)
params = lib.llama_context_default_params()
params.n_ctx = n_ctx
params.no_perf = True
ctx = lib.llama_init_from_model(model, params)
tokens = (lib.llama_token * (len(prompt) + 8))()
count = lib.llama_tokenize(vocab, prompt, len(prompt), tokens, len(tokens), True, False)
sampler = lib.llama_sampler_init_greedy()
batch = lib.llama_batch_get_one(tokens, count)
piece = (lib.ctypes.c_char * 256)()
for _ in range(max_tokens):
    if lib.llama_decode(ctx, batch):
        sys.exit("llama_decode failed")
    token = lib.llama_sampler_sample(sampler, ctx, -1)
    if lib.llama_vocab_is_eog(vocab, token):
        break
    size = lib.llama_token_to_piece(vocab, token, piece, len(piece), 0, False)
    sys.stdout.buffer.write(piece.raw[:max(size, 0)])
    sys.stdout.flush()
    next_token = (lib.llama_token * 1)(token)
    batch = lib.llama_batch_get_one(next_token, 1)
sys.stdout.write("\n")
"""


def kvserve_command(model_path: str, max_tokens: int, prompt: str = PROMPT) -> list[str]:
    """`kvserve generate --model F PROMPT --max-tokens N` (greedy), as a user types it."""
    return [sys.executable, "-m", "kvserve", "generate", "--model", model_path, prompt,
            "--max-tokens", str(max_tokens), "--temperature", "0"]


def llama_cpp_command(model_path: str, max_tokens: int, n_ctx: int, prompt: str = PROMPT) -> list[str]:
    return [sys.executable, "-c", _LLAMA_CPP_SCRIPT, model_path, prompt, str(max_tokens), str(n_ctx)]


def time_process(argv: list[str], env: dict[str, str] | None = None, timeout_s: float = 600.0) -> dict[str, Any]:
    """Run `argv` to its end: wall seconds from spawn to exit, seconds to its first stdout byte
    (None when it printed nothing), its peak RSS in MiB, its exit code and stderr's tail."""
    started = time.perf_counter()
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    first_output_s, output, errors = None, b"", b""
    streams = {process.stdout.fileno(): "out", process.stderr.fileno(): "err"}
    deadline = started + timeout_s
    while streams:
        ready, _, _ = select.select(list(streams), [], [], max(0.0, deadline - time.perf_counter()))
        if not ready:
            process.kill()
            break
        for fd in ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                del streams[fd]
            elif streams[fd] == "out":
                if first_output_s is None:
                    first_output_s = time.perf_counter() - started
                output += chunk
            else:
                errors += chunk
    _, status, usage = os.wait4(process.pid, 0)
    wall_s = time.perf_counter() - started
    process.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
    process.stdout.close()
    process.stderr.close()
    return {"wall_s": wall_s, "first_output_s": first_output_s, "peak_rss_mib": usage.ru_maxrss / 1024.0,
            "cpu_s": usage.ru_utime + usage.ru_stime,
            "returncode": process.returncode, "output": output.decode("utf-8", "replace")[-200:],
            "stderr_tail": errors.decode("utf-8", "replace")[-300:]}


def evict_from_page_cache(paths: list[str]) -> list[str]:
    """posix_fadvise(DONTNEED) over each file (pages another process maps stay); the files done."""
    done = []
    for path in paths:
        try:
            descriptor = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
            done.append(path)
        except (OSError, AttributeError):
            pass
        finally:
            os.close(descriptor)
    return done


def kvserve_cache_files(model_path: str) -> list[str]:
    """kvserve's own cached files of the model: its repacked weights and its tokenizer."""
    from kvserve.paths import cache_root
    stem = os.path.basename(model_path).removesuffix(".gguf")
    files = []
    repacked = os.path.join(cache_root(), "repacked")
    if os.path.isdir(repacked):
        files += [os.path.join(repacked, name) for name in os.listdir(repacked) if name.startswith(stem + ".")]
    tokenizers = os.path.join(cache_root(), "tokenizers")
    from kvserve.model.tokenizer_files import _gguf_cache_key
    saved = os.path.join(tokenizers, _gguf_cache_key(os.path.abspath(model_path)))
    if os.path.isdir(saved):
        files += [os.path.join(saved, name) for name in os.listdir(saved)]
    return files


def _median(values: list[float | None]) -> float | None:
    present = [value for value in values if value is not None]
    return statistics.median(present) if present else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def run(model_path: str, rounds: int = 5, max_tokens: int = 8, prompt: str = PROMPT, cold: bool = False,
        n_ctx: int | None = None) -> dict[str, Any]:
    """Alternating rounds of both engines; per-round ratios and their medians (see the module
    docstring). `n_ctx`: llama.cpp's context (default: the model's context, kvserve's default)."""
    import resource

    from kvserve.model.config import ModelConfig
    if not model_path.endswith(".gguf"):
        raise ValueError("bench startup compares against llama.cpp, which needs a .gguf file")
    n_ctx = n_ctx or ModelConfig.from_path(model_path).max_model_len
    commands = {"kvserve": kvserve_command(model_path, max_tokens, prompt),
                "llama.cpp": llama_cpp_command(model_path, max_tokens, n_ctx, prompt)}
    evicted = {"kvserve": [model_path, *kvserve_cache_files(model_path)], "llama.cpp": [model_path]}
    # The engines' defaults: none of this process's kernel switches (its cache root stays).
    env = {key: value for key, value in os.environ.items()
           if not key.startswith("KVSERVE_") or key == "KVSERVE_CACHE_DIR"}
    runs: list[dict[str, Any]] = []
    for round_index in range(rounds):
        order = ["kvserve", "llama.cpp"] if round_index % 2 == 0 else ["llama.cpp", "kvserve"]
        figures = {}
        for engine in order:
            if cold:
                evict_from_page_cache(evicted[engine])
            figures[engine] = time_process(commands[engine], env=env)
            if figures[engine]["returncode"] != 0:
                raise RuntimeError(f"{engine} failed (exit {figures[engine]['returncode']}): "
                                   f"{figures[engine]['stderr_tail'].strip()}")
        runs.append({"round": round_index, "order": order, **figures})
    return summarize(runs, model_path=model_path, max_tokens=max_tokens, prompt=prompt, cold=cold, n_ctx=n_ctx,
                     commands={"kvserve": "kvserve " + " ".join(commands["kvserve"][3:]),
                               "llama.cpp": f"python -c <kvserve.bench.startup's llama-cpp-python script> "
                                            f"{' '.join(commands['llama.cpp'][3:])}"},
                     parent_peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0)


METRICS = ("wall_s", "first_output_s", "cpu_s", "peak_rss_mib")


def summarize(runs: list[dict[str, Any]], **facts: Any) -> dict[str, Any]:
    """Each engine's median per metric, and the median of the per-round ratios kvserve / llama.cpp."""
    medians = {engine: {metric: _median([run[engine][metric] for run in runs]) for metric in METRICS}
               for engine in ("kvserve", "llama.cpp")}
    ratios = {metric: _median([_ratio(run["kvserve"][metric], run["llama.cpp"][metric]) for run in runs])
              for metric in METRICS}
    model_bytes = os.path.getsize(facts["model_path"]) if os.path.isfile(facts.get("model_path", "")) else None
    return {**facts, "rounds": len(runs), "model_file_mib": model_bytes / 2**20 if model_bytes else None,
            "median": medians, "ratio_kvserve_over_llama_cpp": ratios, "runs": runs}


def format_result(result: dict[str, Any]) -> str:
    from kvserve.bench.report import format_table
    rows = []
    for metric, label in (("wall_s", "wall s (spawn to exit)"), ("first_output_s", "first answer byte s"),
                          ("cpu_s", "CPU s (user + system)"), ("peak_rss_mib", "peak RSS MiB")):
        kv, llama = result["median"]["kvserve"][metric], result["median"]["llama.cpp"][metric]
        rows.append([label, kv, llama, result["ratio_kvserve_over_llama_cpp"][metric]])
    state = "cold (files evicted from the page cache before each run)" if result["cold"] else "warm"
    table = format_table(["median of " + str(result["rounds"]) + " rounds", "kvserve", "llama.cpp",
                          "kvserve / llama.cpp (median of per-round ratios)"], rows)
    return (f"{table}\n\n{state}; {result['max_tokens']} tokens for {result['prompt']!r}; "
            f"model file {result['model_file_mib']:.0f} MiB; RSS figures are the children's own above "
            f"this process's peak, {result['parent_peak_rss_mib']:.0f} MiB")
