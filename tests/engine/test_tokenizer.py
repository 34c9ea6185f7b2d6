"""Tokenizer loading (GGUF with its on-disk cache, HF directories) and chat templates."""
from __future__ import annotations

import os

import pytest

from kvserve.model import tokenizer_files as tokenizer_module
from kvserve.model.fast_tokenizer import FastTokenizer
from kvserve.engine.model_path import default_model_path
from kvserve.engine.tokenizer import (TokenizerError, apply_chat_template, load_tokenizer,
                                      render_chat_template, tokenizer_cache_dir)

TEXTS = ["Why is the sky blue?", "naïve café 你好 😀", "  spaces\tand\nnewlines  ", "<|im_start|>user"]
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "Another one?"},
]


def test_gguf_tokenizer_is_cached_on_disk_and_identical(tmp_path, monkeypatch, smollm_tokenizer):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tokenizer_module, "_loaded", {})
    path = default_model_path()

    built = load_tokenizer(path)
    cached_dirs = os.listdir(tokenizer_cache_dir())
    assert len(cached_dirs) == 1
    assert os.path.isfile(os.path.join(tokenizer_cache_dir(), cached_dirs[0], "tokenizer.json"))

    # The reload reads the cached tokenizer.json with the tokenizers library alone: it never
    # parses the GGUF file again nor goes through transformers (what made it several times
    # faster; checked by what it calls, not by a timing that a loaded machine can upset).
    monkeypatch.setattr(tokenizer_module, "_loaded", {})
    calls = []

    def spy(directory, fast_only=False, **kwargs):
        calls.append((directory, fast_only, kwargs))
        raise AssertionError("the cached tokenizer went through transformers")

    monkeypatch.setattr(tokenizer_module, "_from_pretrained", spy)
    reloaded = load_tokenizer(path)
    assert calls == []
    assert isinstance(reloaded, FastTokenizer)
    assert reloaded.name_or_path == os.path.join(tokenizer_cache_dir(), cached_dirs[0])

    for text in TEXTS:
        ids = built.encode(text)
        assert reloaded.encode(text) == ids
        assert reloaded.decode(ids) == built.decode(ids) == text
    assert reloaded.all_special_ids == built.all_special_ids
    assert reloaded.eos_token == built.eos_token == "<|im_end|>"
    assert render_chat_template(reloaded, CONVERSATION) == render_chat_template(built, CONVERSATION)
    # The session fixture went through the default cache; same tokenizer again.
    assert smollm_tokenizer.encode(TEXTS[1]) == built.encode(TEXTS[1])


def test_load_is_memoized(smollm_tokenizer):
    assert load_tokenizer(default_model_path()) is smollm_tokenizer


def test_chat_template_ids_match_transformers(smollm_tokenizer):
    ids = apply_chat_template(smollm_tokenizer, CONVERSATION)
    expected = smollm_tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert ids == list(expected)
    text = render_chat_template(smollm_tokenizer, CONVERSATION)
    assert text.endswith("<|im_start|>assistant\n")
    assert text.startswith("<|im_start|>system\nYou are terse.<|im_end|>")


def test_default_system_prompt_comes_from_the_template(smollm_tokenizer):
    text = render_chat_template(smollm_tokenizer, [{"role": "user", "content": "hi"}])
    assert "You are a helpful AI assistant named SmolLM" in text


def test_hf_directory_with_and_without_chat_template(tmp_path, byte_fallback_tokenizer):
    plain_dir = tmp_path / "plain"
    byte_fallback_tokenizer.save_pretrained(str(plain_dir))
    loaded = load_tokenizer(str(plain_dir))
    assert loaded.encode("hello world 😀") == byte_fallback_tokenizer.encode("hello world 😀")
    with pytest.raises(TokenizerError, match="no chat template"):
        apply_chat_template(loaded, [{"role": "user", "content": "hi"}])

    templated_dir = tmp_path / "templated"
    byte_fallback_tokenizer.chat_template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    try:
        byte_fallback_tokenizer.save_pretrained(str(templated_dir))
    finally:
        byte_fallback_tokenizer.chat_template = None
    templated = load_tokenizer(str(templated_dir))
    assert render_chat_template(templated, [{"role": "user", "content": "hello"}]) == "[user] hello\n"


@pytest.mark.parametrize("messages", [[], "hello", [{"role": "user"}], [("user", "hi")]])
def test_bad_conversations_are_rejected(smollm_tokenizer, messages):
    with pytest.raises(TokenizerError):
        apply_chat_template(smollm_tokenizer, messages)


def test_missing_or_wrong_paths(tmp_path):
    with pytest.raises(TokenizerError, match="does not exist"):
        load_tokenizer(str(tmp_path / "missing"))
    not_a_model = tmp_path / "weights.bin"
    not_a_model.write_bytes(b"\0")
    with pytest.raises(TokenizerError, match="directory or a .gguf"):
        load_tokenizer(str(not_a_model))
