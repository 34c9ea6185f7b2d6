#!/usr/bin/env bash
# Build llama.cpp's llama-server (and, given as arguments, other tools such as llama-quantize)
# from the source vendored in llama-cpp-python's sdist, for `kvserve bench serve-compare` and the
# model zoo. Optional (not run by CI): it takes 10+ minutes on 2 cores. Binaries are cached as
# ${KVSERVE_CACHE_DIR:-~/.cache/kvserve}/<tool>, where kvserve looks for them when none is on PATH.
# FORCE=1 rebuilds; JOBS=N sets the parallel jobs. The work is done by kvserve.bench.llama_build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec python3 -m kvserve.bench.llama_build "${@:-llama-server}"
