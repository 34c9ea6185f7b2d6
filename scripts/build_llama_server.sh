#!/usr/bin/env bash
# Build llama.cpp's llama-server from the source vendored in llama-cpp-python's
# sdist, for `kvserve bench serve-compare`. Optional (not run by CI): it takes
# 10+ minutes on 2 cores. The binary is cached as
# ${KVSERVE_CACHE_DIR:-~/.cache/kvserve}/llama-server, where serve-compare looks
# for it when no --llama-server is given and none is on PATH.
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
CACHE_DIR="${KVSERVE_CACHE_DIR:-$HOME/.cache/kvserve}"
TARGET="$CACHE_DIR/llama-server"
JOBS="${JOBS:-$(nproc)}"

if [ -x "$TARGET" ] && [ "${FORCE:-0}" != "1" ]; then
    echo "llama-server already built: $TARGET (FORCE=1 rebuilds)"
    exit 0
fi
for tool in cmake make cc c++; do
    command -v "$tool" >/dev/null || { echo "build_llama_server.sh: '$tool' is missing" >&2; exit 1; }
done

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
python3 -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$WORK"
tar -xzf "$WORK"/llama_cpp_python-*.tar.gz -C "$WORK"
SRC="$(echo "$WORK"/llama_cpp_python-*/vendor/llama.cpp)"
[ -d "$SRC/tools/server" ] || { echo "no tools/server in $SRC" >&2; exit 1; }

# Native CPU build (same as llama-cpp-python's wheel build on this machine);
# no curl so that nothing tries to reach a model hub.
cmake -S "$SRC" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DGGML_NATIVE=ON \
    -DBUILD_SHARED_LIBS=OFF
cmake --build "$WORK/build" --target llama-server -j "$JOBS"
mkdir -p "$CACHE_DIR"
install -m 0755 "$WORK/build/bin/llama-server" "$TARGET"
echo "built $TARGET"
