"""Drive the `kvserve` command like a person: a subprocess, or a pseudo-terminal."""
from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import shutil
import signal
import subprocess
import sys
import termios
import time


def kvserve_command() -> list[str]:
    """The installed console script when there is one, else `python -m kvserve.cli`."""
    script = shutil.which("kvserve")
    return [script] if script else [sys.executable, "-m", "kvserve.cli"]


def run_kvserve(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*kvserve_command(), *args], capture_output=True, text=True, timeout=timeout,
                          env=env)


def stream_kvserve(*args: str, timeout: float = 300) -> tuple[list[tuple[float, str]], str, int, float]:
    """Run the command and read stdout as it arrives.

    Returns ([(seconds since start, chunk)], stderr, exit code, total seconds)."""
    start = time.monotonic()
    proc = subprocess.Popen([*kvserve_command(), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    chunks = []
    try:
        while True:
            ready, _, _ = select.select([proc.stdout], [], [], max(0.0, start + timeout - time.monotonic()))
            if not ready:
                raise TimeoutError(f"no output after {timeout} s")
            data = os.read(proc.stdout.fileno(), 4096)
            if not data:
                break
            chunks.append((time.monotonic() - start, data.decode("utf-8", errors="replace")))
        returncode = proc.wait(timeout=30)
        stderr = proc.stderr.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return chunks, stderr, returncode, time.monotonic() - start


def _own_terminal() -> None:
    """In the child: a new session whose controlling terminal is the pty, so
    Ctrl-C typed there sends SIGINT as in a real terminal, and SIGINT handled as a
    terminal's command gets it (a test run started in the background by a
    non-interactive shell inherits SIGINT ignored, and Python keeps it ignored)."""
    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class PtySession:
    """A command on a pseudo-terminal: `send` lines, `expect` a regex in the output."""

    def __init__(self, *args: str, timeout: float = 300) -> None:
        self.timeout = timeout
        main_fd, child_fd = pty.openpty()
        self.proc = subprocess.Popen([*kvserve_command(), *args], stdin=child_fd, stdout=child_fd,
                                     stderr=child_fd, close_fds=True, preexec_fn=_own_terminal)
        os.close(child_fd)
        self.fd = main_fd
        self.buffer = ""

    def expect(self, pattern: str, timeout: float | None = None) -> re.Match:
        """Wait for `pattern` in the output; consume output up to the match's end."""
        deadline = time.monotonic() + (timeout or self.timeout)
        regex = re.compile(pattern)
        while True:
            match = regex.search(self.buffer)
            if match:
                self.buffer = self.buffer[match.end():]
                return match
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{pattern!r} not seen; output so far: {self.buffer[-2000:]!r}")
            ready, _, _ = select.select([self.fd], [], [], remaining)
            if ready:
                try:
                    data = os.read(self.fd, 4096)
                except OSError:  # the child closed the terminal
                    data = b""
                if not data and self.proc.poll() is not None:
                    raise EOFError(f"process exited; output: {self.buffer[-2000:]!r}")
                self.buffer += data.decode("utf-8", errors="replace").replace("\r\n", "\n")

    def send(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def wait(self, timeout: float = 30) -> int:
        # A clock deadline: a process still streaming its answer makes select return at once,
        # so counting 0.1 s per pass ran out after ~300 reads (~1 s on a busy machine).
        deadline = time.monotonic() + timeout
        try:
            while self.proc.poll() is None and time.monotonic() < deadline:
                ready, _, _ = select.select([self.fd], [], [], 0.1)
                if ready:
                    try:
                        self.buffer += os.read(self.fd, 4096).decode("utf-8", errors="replace")
                    except OSError:
                        pass
            return self.proc.wait(timeout=1)
        finally:
            self.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        try:
            os.close(self.fd)
        except OSError:
            pass
