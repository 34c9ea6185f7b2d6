"""Fixtures for the engine front-end tests: real tokenizers, no model."""
from __future__ import annotations

import pytest

from kvserve.engine.model_path import default_model_path
from kvserve.engine.tokenizer import load_tokenizer
from frontend_tokenizers import make_byte_fallback_tokenizer


@pytest.fixture(scope="session")
def smollm_tokenizer():
    """The default model's tokenizer (byte-level BPE), built from its GGUF file."""
    return load_tokenizer(default_model_path())


@pytest.fixture(scope="session")
def byte_fallback_tokenizer():
    """A small sentencepiece-style tokenizer: unknown characters become <0xNN> byte tokens."""
    return make_byte_fallback_tokenizer()
