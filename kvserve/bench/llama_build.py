"""Build llama.cpp's `llama-quantize` from the source vendored in llama-cpp-python's sdist and cache
the binary under kvserve's cache root; find cached llama.cpp tools.

The build is optional and slow (10+ minutes on 2 cores): the model zoo calls it on demand; CI never
does. Usage: python3 -m kvserve.bench.llama_build llama-quantize. (`llama-server`, whose native build
needs the AMX switch, is built by scripts/build_llama_server.sh.)
"""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile

LLAMA_CPP_PYTHON_VERSION = os.environ.get("LLAMA_CPP_PYTHON_VERSION", "0.3.36")
KNOWN_TOOLS = ("llama-quantize",)


class LlamaBuildError(RuntimeError):
    """The llama.cpp tool could not be built (missing compiler, no network, build failure)."""


def cached_tool_path(tool: str) -> str:
    from kvserve.paths import cache_root
    return os.path.join(cache_root(), tool)


def find_tool(tool: str) -> str | None:
    """The tool on PATH, else the cached build; None if neither exists."""
    cached = cached_tool_path(tool)
    return shutil.which(tool) or (cached if os.path.isfile(cached) and os.access(cached, os.X_OK) else None)


def _run(command: list[str], log) -> None:
    completed = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT)
    if completed.returncode != 0:
        raise LlamaBuildError(f"'{' '.join(command[:3])} ...' failed (exit {completed.returncode}); "
                              f"see {log.name}")


def _download_sdist(work: str, log) -> str:
    """The path of llama-cpp-python's sdist, downloaded by pip into `work`."""
    _run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
          f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", work], log)
    archives = glob.glob(os.path.join(work, "llama_cpp_python-*.tar.gz"))
    if not archives:
        raise LlamaBuildError(f"pip download gave no llama-cpp-python sdist in {work}")
    return archives[0]


def _unpack_source(work: str, log) -> str:
    with tarfile.open(_download_sdist(work, log)) as archive:
        archive.extractall(work, filter="data")
    sources = glob.glob(os.path.join(work, "llama_cpp_python-*", "vendor", "llama.cpp"))
    if not sources:
        raise LlamaBuildError("the sdist has no vendor/llama.cpp")
    return sources[0]


def build_tools(tools: list[str], jobs: int | None = None, force: bool = False) -> dict[str, str]:
    """Build the named llama.cpp tools (those not cached yet, or all with force) and return their
    cached paths. Raises LlamaBuildError with the build log's path on failure."""
    unknown = [tool for tool in tools if tool not in KNOWN_TOOLS]
    if unknown:
        raise LlamaBuildError(f"unknown llama.cpp tool(s) {unknown}; known: {list(KNOWN_TOOLS)}")
    paths = {tool: cached_tool_path(tool) for tool in tools}
    missing = [tool for tool in tools if force or not os.access(paths[tool], os.X_OK)]
    if not missing:
        return paths
    for program in ("cmake", "make", "cc", "c++"):
        if shutil.which(program) is None:
            raise LlamaBuildError(f"building {missing} needs '{program}', which is not installed")
    cache_dir = os.path.dirname(paths[missing[0]])
    os.makedirs(cache_dir, exist_ok=True)
    log_path = os.path.join(cache_dir, "llama-build.log")
    with tempfile.TemporaryDirectory(prefix="kvserve-llama-build-") as work, open(log_path, "w") as log:
        source = _unpack_source(work, log)
        build = os.path.join(work, "build")
        # Native CPU build, as llama-cpp-python's own wheel build; no curl so that nothing reaches a hub.
        _run(["cmake", "-S", source, "-B", build, "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_SERVER=ON",
              "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_CURL=OFF",
              "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF"], log)
        job_count = str(jobs or os.cpu_count() or 1)
        _run(["cmake", "--build", build, "-j", job_count, "--target", *missing], log)
        for tool in missing:
            staged = paths[tool] + ".tmp"
            shutil.copy2(os.path.join(build, "bin", tool), staged)
            os.chmod(staged, 0o755)
            os.replace(staged, paths[tool])
    return paths


# What llama.cpp's HF -> GGUF converter needs of its source tree: the script, its per-family
# `conversion` package and the gguf-py it imports (the one of its own version).
_CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


def converter_script() -> str:
    """The path of llama.cpp's convert_hf_to_gguf.py from llama-cpp-python's sdist, unpacked
    (with its `conversion` package and gguf-py) once into kvserve's cache. Raises
    LlamaBuildError where the sdist cannot be downloaded."""
    from kvserve.paths import cache_root
    target = os.path.join(cache_root(), f"llama-convert-{LLAMA_CPP_PYTHON_VERSION}")
    script = os.path.join(target, "convert_hf_to_gguf.py")
    if os.path.isfile(script):
        return script
    os.makedirs(cache_root(), exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvserve-llama-convert-") as work, \
            open(os.path.join(work, "download.log"), "w") as log:
        with tarfile.open(_download_sdist(work, log)) as archive:
            prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp/"
            members = [m for m in archive.getmembers()
                       if m.name.startswith(prefix) and m.name[len(prefix):].startswith(_CONVERTER_PARTS)]
            if not members:
                raise LlamaBuildError("the sdist has no vendor/llama.cpp/convert_hf_to_gguf.py")
            archive.extractall(work, members=members, filter="data")
        staged = tempfile.mkdtemp(dir=cache_root(), prefix=".llama-convert-")
        os.rmdir(staged)
        shutil.move(os.path.join(work, prefix), staged)
        try:
            os.rename(staged, target)
        except OSError:  # another process unpacked it first
            shutil.rmtree(staged, ignore_errors=True)
    return script


# Runs the converter with the tokenizer's pre-tokenizer named (the converter recognizes one by
# hashing what it does to a sample text, and knows no test or random model's).
_CONVERT = """import runpy, sys
sys.path[:0] = [{src!r}, {src!r} + "/gguf-py"]
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: {pre!r}
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[1:]]
runpy.run_path({src!r} + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def convert_hf_to_gguf(model_dir: str, out_path: str, pre: str, outtype: str = "f32",
                       extra_args: tuple[str, ...] = (), converter: str | None = None) -> str:
    """Run llama.cpp's convert_hf_to_gguf.py (`converter`, else `converter_script()`) on the Hugging
    Face directory `model_dir`, tensors it does not keep as they are written as `outtype`, the
    tokenizer's pre-tokenizer named `pre`; returns `out_path`. Raises LlamaBuildError on failure."""
    source = os.path.dirname(converter or converter_script())
    completed = subprocess.run([sys.executable, "-c", _CONVERT.format(src=source, pre=pre), model_dir,
                                "--outfile", out_path, "--outtype", outtype, *extra_args],
                               capture_output=True, text=True, timeout=1800)
    if completed.returncode != 0:
        raise LlamaBuildError(f"convert_hf_to_gguf.py failed:\n{completed.stderr[-3000:]}")
    return out_path

def main(argv: list[str]) -> int:
    force = os.environ.get("FORCE") == "1"
    jobs = int(os.environ["JOBS"]) if os.environ.get("JOBS") else None
    tools = argv or ["llama-quantize"]
    try:
        for tool, path in build_tools(tools, jobs=jobs, force=force).items():
            print(f"{tool}: {path}")
    except LlamaBuildError as error:
        print(f"llama_build: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
