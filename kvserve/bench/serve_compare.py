"""kvserve's server against llama.cpp's, both driven by the `kvserve bench serve` client.

Each round starts one server at a time as a child process on a free loopback
port (so the servers never compete for the cores or memory), waits for
`/v1/models`, sends one warm-up request, runs the serving benchmark, and stops
it; rounds alternate which server goes first. Figures per server are the
medians over rounds; the ratios are medians of per-round ratios.

llama.cpp's server is `llama-server` when one is given, on PATH, or built by
scripts/build_llama_server.sh (cached as <cache root>/llama-server), run with
`--parallel <concurrency>`; otherwise llama-cpp-python's `python -m
llama_cpp.server`, which serves one request at a time (said in the result).
Every server gets the same thread count (torch's).

A reference server that dies (e.g. killed by SIGSEGV in llama.cpp's AMX
kernels) while starting or during a round is recorded in
`reference_failures` (engine, phase, round, signal or exit code) and printed,
and runs no more rounds; its figures and the ratios cover the rounds it
finished. kvserve's own failure stops the comparison.
"""
from __future__ import annotations

import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from typing import Any

from kvserve.bench import serve
from kvserve.bench.engine_process import describe_exit, failure_record, format_failures
from kvserve.bench.report import format_table

_READY_TIMEOUT_S = 900.0
# A server whose requests failed is given this long to finish dying before it counts as alive.
_EXIT_WAIT_S = 5.0


class ServerExitedError(RuntimeError):
    """A server child process ended on its own; `exit_code` is negative for a signal."""

    def __init__(self, message: str, exit_code: int | None) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class ServerCommand:
    """How to start one server: argv with `{port}` in it, and a note for the reader."""

    name: str
    argv: list[str]
    note: str = ""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def kvserve_command(model: str, extra_args: list[str]) -> ServerCommand:
    return ServerCommand("kvserve", [sys.executable, "-m", "kvserve.cli", "serve", "--model", model,
                                     "--host", "127.0.0.1", "--port", "{port}", *extra_args], "kvserve serve")


def find_llama_server(explicit: str | None = None) -> str | None:
    """The llama-server binary to run: `explicit` (which must be an executable file), else
    llama-server on PATH, else the one scripts/build_llama_server.sh caches; None if none."""
    if explicit:
        if not (os.path.isfile(explicit) and os.access(explicit, os.X_OK)):
            raise ValueError(f"--llama-server {explicit}: not an executable file")
        return explicit
    from kvserve.bench.llama_build import find_tool
    return find_tool("llama-server")


def llama_cpp_command(model: str, concurrency: int, threads: int, context_per_slot: int,
                      llama_server: str | None) -> ServerCommand | None:
    """llama-server (the binary `llama_server`, else `find_llama_server`'s) with `--parallel`,
    else llama-cpp-python's server; None when neither exists."""
    binary = llama_server or find_llama_server()
    if binary:
        return ServerCommand("llama.cpp", [binary, "-m", model, "--host", "127.0.0.1", "--port", "{port}",
                                           "--parallel", str(concurrency), "-t", str(threads),
                                           "-c", str(context_per_slot * concurrency), "--no-webui"],
                             f"llama-server --parallel {concurrency}")
    try:
        import llama_cpp.server  # noqa: F401
    except ImportError:
        return None
    return ServerCommand("llama.cpp", [sys.executable, "-m", "llama_cpp.server", "--model", model,
                                       "--host", "127.0.0.1", "--port", "{port}", "--n_threads", str(threads),
                                       "--n_threads_batch", str(threads), "--n_ctx", str(context_per_slot)],
                         "llama-cpp-python server (one request at a time)")


class RunningServer:
    """A server child process, ready once `/v1/models` answers; stopped on exit."""

    def __init__(self, command: ServerCommand) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = command
        self.log = tempfile.TemporaryFile()
        argv = [part.replace("{port}", str(self.port)) for part in command.argv]
        self.process = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self) -> None:
        import httpx

        deadline = time.monotonic() + _READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise self.exited("starting")
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=2.0, trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.command.name} server not ready after {_READY_TIMEOUT_S:.0f} s: {self.tail()}")

    def exited(self, doing: str) -> ServerExitedError:
        code = self.process.returncode
        return ServerExitedError(f"{self.command.name} server died while {doing} ({describe_exit(code)}): "
                                 f"{self.tail()}", code)

    def check_alive_after(self, result: dict[str, Any], doing: str) -> None:
        """Raise ServerExitedError when the server died during a run (its requests then failed)."""
        if result.get("failed"):
            try:
                self.process.wait(_EXIT_WAIT_S)
            except subprocess.TimeoutExpired:
                pass
        if self.process.poll() is not None:
            raise self.exited(doing)

    def tail(self) -> str:
        self.log.seek(0)
        return self.log.read().decode("utf-8", "replace")[-800:]

    def __enter__(self) -> "RunningServer":
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()

    def __exit__(self, *exc_info) -> None:
        self.stop()


def _one_round(command: ServerCommand, config: serve.ServeBenchConfig) -> dict[str, Any]:
    with RunningServer(command) as server:
        server.check_alive_after(serve.run(replace(config, base_url=server.url, num_prompts=1, max_tokens=4)),
                                 "warming up")
        result = serve.run(replace(config, base_url=server.url))
        server.check_alive_after(result, "serving the benchmark")
        return result


def _run_rounds(commands: list[ServerCommand], config: serve.ServeBenchConfig,
                rounds: int) -> tuple[dict[str, list[dict[str, Any]]], list[dict[str, Any]]]:
    """Each server's runs, by name, and the references' failures; the first command is kvserve,
    whose failure raises. Servers alternate their order round by round."""
    runs: dict[str, list[dict[str, Any]]] = {c.name: [] for c in commands}
    failures: list[dict[str, Any]] = []
    running = list(commands)
    for round_index in range(rounds):
        for command in (list(running) if round_index % 2 == 0 else running[::-1]):
            try:
                runs[command.name].append(_one_round(command, config))
            except ServerExitedError as error:
                if command is commands[0]:
                    raise
                phase = "start" if "while starting" in str(error) else "run"
                failures.append(failure_record(command.name, error, phase, "left out of the later rounds",
                                               round_index + 1))
                running.remove(command)
    return runs, failures


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    def median(key: str, stat: str | None = None) -> float:
        return statistics.median(r[key][stat] if stat else r[key] for r in runs)
    return {"output_token_throughput": median("output_token_throughput"), "tpot_mean_ms": median("tpot", "mean_ms"),
            "tpot_p50_ms": median("tpot", "p50_ms"), "ttft_mean_ms": median("ttft", "mean_ms"),
            "ttft_p50_ms": median("ttft", "p50_ms"), "failed": sum(r["failed"] for r in runs)}


def run(model: str, config: serve.ServeBenchConfig, *, rounds: int = 1, kvserve_args: list[str] | None = None,
        llama_server: str | None = None, threads: int | None = None, context_per_slot: int = 2048) -> dict[str, Any]:
    """Serve `model` with kvserve and llama.cpp in turn and benchmark each with `config`."""
    if threads is None:
        import torch
        threads = torch.get_num_threads()
    commands = [kvserve_command(model, kvserve_args or [])]
    skipped = {}
    llama = llama_cpp_command(model, config.concurrency or 8, threads, context_per_slot,
                              find_llama_server(llama_server))
    if llama is None:
        skipped["llama.cpp"] = "neither llama-server nor llama_cpp.server is installed"
    else:
        commands.append(llama)
    runs, failures = _run_rounds(commands, config, rounds)
    return {"model": model, "threads": threads, "rounds": rounds, "servers": _servers(commands, runs),
            "ratios": _ratios(runs) if runs.get("llama.cpp") else {}, "skipped": skipped,
            "reference_failures": failures,
            "config": {k: v for k, v in vars(config).items() if k not in ("api_key", "base_url")}}


def _servers(commands: list[ServerCommand], runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per server: how it was started, its medians (None when it finished no round) and its rounds."""
    return {c.name: {"command": " ".join(shlex.quote(a) for a in c.argv), "note": c.note,
                     "summary": _summary(runs[c.name]) if runs[c.name] else None, "rounds": runs[c.name]}
            for c in commands}


def _ratios(runs: dict[str, list[dict[str, Any]]]) -> dict[str, float]:
    """kvserve / llama.cpp per round, then the median: throughput (higher is better for kvserve),
    TPOT and TTFT (lower is better for kvserve)."""
    pairs = list(zip(runs["kvserve"], runs["llama.cpp"]))

    def median_ratio(value) -> float:
        return statistics.median(value(ours) / value(theirs) for ours, theirs in pairs)
    return {"output_tok_s": median_ratio(lambda r: r["output_token_throughput"]),
            "tpot_mean": median_ratio(lambda r: r["tpot"]["mean_ms"]),
            "ttft_mean": median_ratio(lambda r: r["ttft"]["mean_ms"])}


def format_result(result: dict[str, Any]) -> str:
    rows = [[name, s["note"], s["summary"]["output_token_throughput"], s["summary"]["tpot_mean_ms"],
             s["summary"]["ttft_mean_ms"], s["summary"]["failed"]] if s["summary"] else
            [name, s["note"], "no round finished", "-", "-", "-"] for name, s in result["servers"].items()]
    text = format_table(["server", "how", "output tok/s", "TPOT mean ms", "TTFT mean ms", "failed"], rows,
                        title=f"serve-compare: median of {result['rounds']} round(s), {result['threads']} threads")
    if result["ratios"]:
        r = result["ratios"]
        text += (f"\n\nkvserve / llama.cpp (median of per-round ratios): output tok/s {r['output_tok_s']:.2f}x, "
                 f"TPOT {r['tpot_mean']:.2f}x, TTFT {r['ttft_mean']:.2f}x (below 1 is better for TPOT/TTFT)")
    for name, why in result["skipped"].items():
        text += f"\nskipped {name}: {why}"
    return text + format_failures(result.get("reference_failures") or [])


def plot_values(result: dict[str, Any]) -> tuple[list[str], list[float]]:
    served = {name: s for name, s in result["servers"].items() if s["summary"]}
    return list(served), [s["summary"]["output_token_throughput"] for s in served.values()]

