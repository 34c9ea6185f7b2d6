"""Where kvserve keeps its files on disk (built kernels, tokenizers, exported models)."""
from __future__ import annotations

import os


def cache_root() -> str:
    """Root of kvserve's on-disk caches: $KVSERVE_CACHE_DIR, else $XDG_CACHE_HOME/kvserve or ~/.cache/kvserve."""
    return os.environ.get("KVSERVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvserve")
