"""One benchmarked engine in its own child process.

Engines measured in one process disturb each other: once a kvserve engine has
run, llama.cpp in the same process decodes at about half its speed (thread
pools that spin, memory arenas, CPU affinity). `EngineProcess` loads a runner
(any object with `run(workload) -> ThroughputResult`) in a fresh `spawn`ed
process, keeps it loaded between rounds, and runs workloads on request; the
parent only sends workloads and receives plain dicts. Every child uses the
thread count it is given (the parent's torch thread count), so each engine
gets the same cores.
"""
from __future__ import annotations

import importlib
import logging
import multiprocessing
import resource
import signal
import traceback
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

# How long a child may take to load its engine, and to leave once asked.
_LOAD_TIMEOUT_S = 1800.0
_STOP_TIMEOUT_S = 30.0


class EngineProcessError(RuntimeError):
    """The engine's child process failed: it raised (message carries its traceback) or died
    (`exit_code` is then its exit status, negative for the signal that killed it)."""

    def __init__(self, message: str, exit_code: int | None = None) -> None:
        super().__init__(message)
        self.exit_code = exit_code

    @property
    def signal_name(self) -> str | None:
        """The signal that killed the child ("SIGSEGV"), or None."""
        return signal_name(self.exit_code)


def signal_name(exit_code: int | None) -> str | None:
    """"SIGSEGV" for a child's exit status -11 (killed by that signal), else None."""
    if exit_code is None or exit_code >= 0:
        return None
    try:
        return signal.Signals(-exit_code).name
    except ValueError:
        return f"signal {-exit_code}"


def describe_exit(exit_code: int | None) -> str:
    """How a child ended, for messages: "killed by SIGSEGV" or "exit code 1"."""
    name = signal_name(exit_code)
    return f"killed by {name}" if name else f"exit code {exit_code}"


@dataclass(frozen=True)
class RunnerSpec:
    """How the child builds its runner: `factory` is "module:callable", called with `kwargs`."""

    name: str
    factory: str
    kwargs: dict[str, Any]


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux reports KiB


def _build(spec: RunnerSpec, num_threads: int):
    import torch

    torch.set_num_threads(num_threads)
    module_name, attribute = spec.factory.split(":")
    return getattr(importlib.import_module(module_name), attribute)(**spec.kwargs)


def _child_main(conn, spec: RunnerSpec, num_threads: int) -> None:
    """The child's loop: build the runner, then answer ("warm_up"|"run", workload) until "stop"."""
    try:
        runner = _build(spec, num_threads)
        info = {"load_s": runner.load_s, "dtype": getattr(runner, "dtype", None), "peak_rss_mib": _peak_rss_mib()}
        conn.send(("ok", info))
    except Exception:  # reported to the parent, which decides what to do
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        command, workload = conn.recv()
        if command == "stop":
            conn.send(("ok", {"peak_rss_mib": _peak_rss_mib()}))
            getattr(runner, "shutdown", lambda: None)()
            return
        try:
            if command == "warm_up":
                runner.warm_up() if hasattr(runner, "warm_up") else runner.run(workload)
                conn.send(("ok", None))
            else:
                conn.send(("ok", runner.run(workload).as_dict()))
        except Exception:
            conn.send(("error", traceback.format_exc()))


def failure_record(engine: str, error: BaseException, phase: str, action: str,
                   round_number: int | None = None, workload: str | None = None) -> dict[str, Any]:
    """One entry of a comparison's `reference_failures`: which engine failed, where, how (the
    signal or exit code of a child that died), and what was done about it."""
    exit_code = getattr(error, "exit_code", None)
    return {"engine": engine, "phase": phase, "round": round_number, "workload": workload,
            "signal": signal_name(exit_code), "exit_code": exit_code,
            "error": str(error).strip().splitlines()[0], "action": action}


def format_failures(failures: list[dict[str, Any]]) -> str:
    """One line per failed reference: what happened, where, and what was done about it."""
    lines = []
    for f in failures:
        how = f"killed by {f['signal']}" if f.get("signal") else (
            f"exited with code {f['exit_code']}" if f.get("exit_code") is not None else "failed")
        where = f"round {f['round']}" if f.get("round") else f["phase"]
        if f.get("workload"):
            where += f", workload {f['workload']}"
        lines.append(f"\nREFERENCE FAILED: {f['engine']} {how} ({where}): {f['error']}; {f['action']}")
    return "".join(lines)


class EngineProcess:
    """A runner loaded in a spawned child process; `run` sends it a workload and waits."""

    def __init__(self, spec: RunnerSpec, num_threads: int) -> None:
        self.spec = spec
        self.name = spec.name
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(target=_child_main, args=(child_conn, spec, num_threads),
                                        name=f"bench-{spec.name}", daemon=True)
        self._process.start()
        child_conn.close()
        self.info: dict[str, Any] = self._receive(_LOAD_TIMEOUT_S, "loading")
        self.load_s = self.info["load_s"]
        self.dtype = self.info.get("dtype")

    def _receive(self, timeout_s: float | None, doing: str) -> Any:
        if not self._conn.poll(timeout_s):
            self.close()
            raise EngineProcessError(f"{self.name}: no answer after {timeout_s:.0f} s while {doing}")
        try:
            status, payload = self._conn.recv()
        except (EOFError, ConnectionResetError):
            raise self._died(doing) from None
        if status == "error":
            raise EngineProcessError(f"{self.name}: failed while {doing}:\n{payload}")
        return payload

    def _call(self, command: str, workload) -> Any:
        doing = f"running {getattr(workload, 'name', command)}"
        try:
            self._conn.send((command, workload))
        except (BrokenPipeError, OSError):
            raise self._died(doing) from None
        return self._receive(None, doing)

    def _died(self, doing: str) -> EngineProcessError:
        self._process.join(5)
        code = self._process.exitcode
        return EngineProcessError(f"{self.name}: child process died while {doing} ({describe_exit(code)})", code)

    def warm_up(self, workload) -> None:
        self._call("warm_up", workload)

    def run(self, workload) -> dict[str, Any]:
        """The runner's `ThroughputResult` for `workload`, as a dict."""
        return self._call("run", workload)

    def close(self) -> dict[str, Any]:
        """Stop the child; returns its final figures (peak RSS) when it could still answer."""
        final: dict[str, Any] = {}
        if self._process.is_alive():
            try:
                self._conn.send(("stop", None))
                if self._conn.poll(_STOP_TIMEOUT_S):
                    final = self._conn.recv()[1] or {}
            except (BrokenPipeError, EOFError, OSError):
                pass
            self._process.join(_STOP_TIMEOUT_S)
            if self._process.is_alive():
                self._process.kill()
                self._process.join()
        self._conn.close()
        return final


def generate_peak_rss(model: str | None, extra_args: list[str] | None = None, max_tokens: int = 32,
                      timeout_s: float = 600.0) -> dict[str, Any]:
    """Peak resident memory of one `kvserve generate` run (a fresh process, the CLI as a user runs it).

    The peak comes from `wait4` on that very process, so it is its own, not this process's."""
    import os
    import subprocess
    import sys
    import tempfile
    import threading
    import time

    argv = [sys.executable, "-m", "kvserve.cli", "generate", "--json", "--temperature", "0",
            "--max-tokens", str(max_tokens), *(["--model", model] if model else []), *(extra_args or []),
            "Name three rivers of Europe."]
    started = time.perf_counter()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        process = subprocess.Popen(argv, stdout=out, stderr=err)
        timer = threading.Timer(timeout_s, process.kill)
        timer.start()
        try:
            _, status, usage = os.wait4(process.pid, 0)
        finally:
            timer.cancel()
        process.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode("utf-8", "replace"), err.read().decode("utf-8", "replace")
    if process.returncode != 0:
        raise EngineProcessError(f"kvserve generate failed (exit {process.returncode}): {stderr.strip()[-500:]}")
    return {"command": "kvserve " + " ".join(argv[3:]), "peak_rss_mib": usage.ru_maxrss / 1024.0,
            "wall_s": time.perf_counter() - started, "output": stdout.strip()[-300:]}
