"""Tokenizer loading from a Hugging Face directory or a GGUF file.

In the model layer because the worker needs the vocabulary too (grammar
token masks for structured output); `kvserve.engine.tokenizer` re-exports it.

Building a fast tokenizer from GGUF metadata takes several seconds (the
vocabulary and merges are rebuilt in Python), so the result is saved once to
an on-disk cache keyed by the file's path, size and modification time, and
later loads read the saved `tokenizer.json` (a fraction of a second) with the
`tokenizers` library alone (`kvserve.model.fast_tokenizer`: transformers is not imported
on that path).
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import threading
from typing import Any

from kvserve.model.fast_tokenizer import FastTokenizer, fast_tokenizer_supports
from kvserve.paths import cache_root

logger = logging.getLogger(__name__)

# Bump when the cached layout changes, so stale entries are ignored.
_CACHE_VERSION = "1"

_loaded: dict[str, Any] = {}
_load_lock = threading.Lock()


class TokenizerError(ValueError):
    """The tokenizer cannot be loaded or used as asked; the message says why."""


def tokenizer_cache_dir() -> str:
    """Root of the on-disk tokenizer cache ($KVSERVE_CACHE_DIR or ~/.cache/kvserve)."""
    return os.path.join(cache_root(), "tokenizers")


def load_tokenizer(model: Any) -> Any:
    """The tokenizer of a model: `model` is a ModelConfig (anything with `.path`)
    or a path to a Hugging Face directory or a `.gguf` file.

    Loaded tokenizers are memoized per process; GGUF-built ones are also
    cached on disk (see the module docstring).
    """
    path = os.path.abspath(os.path.expanduser(str(getattr(model, "path", model))))
    with _load_lock:
        tokenizer = _loaded.get(path)
        if tokenizer is None:
            tokenizer = _load_uncached(path)
            _loaded[path] = tokenizer
    return tokenizer


def _load_uncached(path: str) -> Any:
    if os.path.isdir(path):
        return _from_pretrained(path)
    if os.path.isfile(path) and path.endswith(".gguf"):
        return _load_gguf_tokenizer(path)
    if not os.path.exists(path):
        raise TokenizerError(f"tokenizer path {path!r} does not exist")
    raise TokenizerError(f"cannot load a tokenizer from {path!r}: expected a model directory or a .gguf file")


def _from_pretrained(directory: str, fast_only: bool = False, **kwargs: Any) -> Any:
    # AutoTokenizer imports transformers' model registry (about 2 s of CPU);
    # a directory we saved ourselves holds a fast tokenizer, which loads
    # directly through PreTrainedTokenizerFast.
    if fast_only:
        from transformers import PreTrainedTokenizerFast as tokenizer_class
    else:
        from transformers import AutoTokenizer as tokenizer_class
    try:
        return tokenizer_class.from_pretrained(directory, **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        raise TokenizerError(f"cannot load the tokenizer of {directory!r}: {exc}") from exc


# GGUF architectures whose model config AutoTokenizer cannot read (transformers 5 fails on
# gpt-oss's rope.scaling keys, and does not know granitehybrid): their tokenizer is built from
# the file's tokenizer keys alone.
_FAST_ONLY_GGUF_ARCHS = ("gpt-oss", "granitehybrid")


def _gguf_architecture(path: str) -> str | None:
    from kvserve.model.gguf_file import open_gguf
    try:
        return open_gguf(path).get("general.architecture")
    except (OSError, ValueError) as exc:
        raise TokenizerError(f"{path!r} is not a readable GGUF file: {exc}") from exc


def _gguf_cache_key(path: str) -> str:
    stat = os.stat(path)
    ident = f"{_CACHE_VERSION}|{path}|{stat.st_size}|{stat.st_mtime_ns}"
    return hashlib.sha256(ident.encode()).hexdigest()[:24]


def _load_gguf_tokenizer(path: str) -> Any:
    cached_dir = os.path.join(tokenizer_cache_dir(), _gguf_cache_key(path))
    if os.path.isfile(os.path.join(cached_dir, "tokenizer.json")):
        try:
            return _load_saved(cached_dir)
        except TokenizerError:
            logger.warning("ignoring unreadable tokenizer cache %s", cached_dir)
    directory, file_name = os.path.split(path)
    tokenizer = _from_pretrained(directory, fast_only=_gguf_architecture(path) in _FAST_ONLY_GGUF_ARCHS,
                                 gguf_file=file_name)
    _save_to_cache(tokenizer, cached_dir)
    return tokenizer


def _load_saved(directory: str) -> Any:
    """A tokenizer we saved: read by `FastTokenizer` where it behaves as transformers would."""
    if fast_tokenizer_supports(directory):
        try:
            return FastTokenizer(directory)
        except Exception as exc:  # noqa: BLE001 - the tokenizers library raises plain Exception
            raise TokenizerError(f"cannot read the tokenizer in {directory!r}: {exc}") from exc
    return _from_pretrained(directory, fast_only=True)


def _save_to_cache(tokenizer: Any, cached_dir: str) -> None:
    # Save into a temporary sibling and rename, so a concurrent reader never
    # sees a half-written directory.
    parent = os.path.dirname(cached_dir)
    try:
        os.makedirs(parent, exist_ok=True)
        staging = tempfile.mkdtemp(dir=parent, prefix=".tmp-")
        tokenizer.save_pretrained(staging)
        try:
            os.rename(staging, cached_dir)
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
    except OSError as exc:
        logger.debug("tokenizer cache not written (%s); loads stay slow", exc)
