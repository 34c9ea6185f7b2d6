#!/usr/bin/env bash
# Build llama.cpp's llama-server from the source vendored in llama-cpp-python's
# sdist, for `kvserve bench serve-compare`. Optional (not run by CI): it takes
# 10+ minutes on 2 cores. The binary is cached as
# ${KVSERVE_CACHE_DIR:-~/.cache/kvserve}/llama-server, where serve-compare looks
# for it when no --llama-server is given and none is on PATH.
#
# Usage: scripts/build_llama_server.sh [--no-amx]
#   --no-amx (or NO_AMX=1): build without llama.cpp's AMX kernels. The default
#   native build (-DGGML_NATIVE=ON) compiles them on CPUs whose CPUID lists AMX,
#   and on some such machines (seen on a 2-core Intel Xeon virtual machine)
#   llama.cpp then dies of a general-protection fault (SIGSEGV) in
#   ggml_backend_amx_mul_mat on its first matmul. This build turns
#   GGML_NATIVE off and enables, one by one, the x86 features this machine's
#   /proc/cpuinfo lists (AVX, AVX2, FMA, F16C, BMI2, AVX-VNNI, AVX-512 F/VBMI/
#   VNNI/BF16), with AMX off: the same kernels minus AMX. `kvserve bench
#   compare`/`serve-compare` record which llama.cpp ran and any crash.
#   FORCE=1 rebuilds over a cached binary (e.g. to switch to --no-amx).
set -euo pipefail

NO_AMX="${NO_AMX:-0}"
for arg in "$@"; do
    case "$arg" in
        --no-amx) NO_AMX=1 ;;
        -h|--help) sed -n '2,/^set /{/^#/p}' "$0"; exit 0 ;;
        *) echo "build_llama_server.sh: unknown argument '$arg' (use --no-amx)" >&2; exit 2 ;;
    esac
done

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

# Native CPU build (same as llama-cpp-python's wheel build on this machine), or
# with --no-amx the features /proc/cpuinfo lists minus AMX; no curl so that
# nothing tries to reach a model hub.
cpu_flags() {
    local flags on
    flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
    for pair in avx:AVX avx2:AVX2 fma:FMA f16c:F16C bmi2:BMI2 avx_vnni:AVX_VNNI avx512f:AVX512 \
                avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
        on=OFF
        case "$flags" in *" ${pair%%:*} "*) on=ON ;; esac
        printf -- '-DGGML_%s=%s ' "${pair##*:}" "$on"
    done
    printf -- '-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF'
}
if [ "$NO_AMX" = "1" ]; then
    # shellcheck disable=SC2207
    ISA_FLAGS=(-DGGML_NATIVE=OFF $(cpu_flags))
    echo "building without AMX: ${ISA_FLAGS[*]}"
else
    ISA_FLAGS=(-DGGML_NATIVE=ON)
fi
cmake -S "$SRC" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF "${ISA_FLAGS[@]}" \
    -DBUILD_SHARED_LIBS=OFF
cmake --build "$WORK/build" --target llama-server -j "$JOBS"
mkdir -p "$CACHE_DIR"
install -m 0755 "$WORK/build/bin/llama-server" "$TARGET"
echo "built $TARGET"
