"""A tokenizer read straight from a saved `tokenizer.json`, without importing transformers.

Importing transformers costs about 0.7 s of CPU (its hub and HTTP stack), most of
`kvserve generate`'s start-up after torch. The tokenizers we save ourselves (built once
from a GGUF file's vocabulary, see `kvserve.model.tokenizer_files`) are complete
`tokenizer.json` files: the `tokenizers` library encodes and decodes them exactly as
transformers' fast tokenizer does, and a plain conversation renders through the chat
template with the same Jinja settings transformers uses. Anything else (tools,
documents, reasoning fields, template options, attributes this class does not define)
goes to the transformers tokenizer of the same directory, loaded on first use, so the
results never differ from transformers'.
"""
from __future__ import annotations

import datetime
import json
import os
import re
import threading
from typing import Any, Sequence

# tokenizer_config.json keys whose effect this class reproduces (or that have none on
# encoding): with any other key the directory is loaded by transformers instead.
_UNDERSTOOD_CONFIG_KEYS = frozenset({
    "backend", "bos_token", "eos_token", "pad_token", "unk_token", "is_local", "local_files_only",
    "model_max_length", "tokenizer_class", "added_tokens_decoder", "chat_template",
    "clean_up_tokenization_spaces", "add_prefix_space",
})
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
# Message keys transformers renames or duplicates before rendering (reasoning aliases).
_ALIASED_MESSAGE_KEYS = frozenset({"reasoning_content", "reasoning", "thinking"})
# transformers' `{% generation %}` block (assistant token masks), which plain Jinja lacks.
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\b")


def fast_tokenizer_supports(directory: str) -> bool:
    """Whether `directory` (a saved fast tokenizer) loads as a `FastTokenizer` with the
    same behaviour as transformers: a tokenizer.json, and a config without options that
    transformers applies on load (a prefix space, BOS/EOS switches, clean-up of spaces)."""
    config = _read_config(directory)
    if config is None or not os.path.isfile(os.path.join(directory, "tokenizer.json")):
        return False
    if not set(config) <= _UNDERSTOOD_CONFIG_KEYS:
        return False
    if config.get("add_prefix_space") is not None or config.get("clean_up_tokenization_spaces"):
        return False
    return not isinstance(config.get("chat_template"), (list, dict))


def _read_config(directory: str) -> dict | None:
    try:
        with open(os.path.join(directory, "tokenizer_config.json"), encoding="utf-8") as file:
            config = json.load(file)
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # an AddedToken saved as a dict
        value = value.get("content")
    return value if isinstance(value, str) else None


class FastTokenizer:
    """The subset of transformers' fast tokenizer that kvserve calls on every request
    (encode, decode, chat template, special tokens), over `tokenizers.Tokenizer`.

    Other attributes come from the transformers tokenizer of the same directory
    (`hf_tokenizer`, loaded on first use)."""

    def __init__(self, directory: str) -> None:
        from tokenizers import Tokenizer
        config = _read_config(directory) or {}
        self.name_or_path = directory
        self.backend_tokenizer = Tokenizer.from_file(os.path.join(directory, "tokenizer.json"))
        self.chat_template = _read_chat_template(directory, config)
        for name in _SPECIAL_TOKEN_NAMES:
            setattr(self, name, _token_text(config.get(name)))
        self._hf: Any = None
        self._hf_lock = threading.Lock()

    # ---- special tokens ---------------------------------------------------------

    @property
    def special_tokens_map(self) -> dict[str, str]:
        return {name: getattr(self, name) for name in _SPECIAL_TOKEN_NAMES if getattr(self, name) is not None}

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self.backend_tokenizer.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._id_of(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self._id_of(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self._id_of(self.pad_token)

    @property
    def unk_token_id(self) -> int | None:
        return self._id_of(self.unk_token)

    def get_added_vocab(self) -> dict[str, int]:
        return {token.content: index for index, token in self.backend_tokenizer.get_added_tokens_decoder().items()}

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    # ---- text <-> ids -----------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True, **kwargs: Any) -> list[int]:
        if kwargs:
            return self.hf_tokenizer.encode(text, add_special_tokens=add_special_tokens, **kwargs)
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: int | Sequence[int], skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None, **kwargs: Any) -> str:
        if kwargs or clean_up_tokenization_spaces:
            return self.hf_tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens,
                                            clean_up_tokenization_spaces=clean_up_tokenization_spaces, **kwargs)
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        return self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: int | Sequence[int], skip_special_tokens: bool = False
                              ) -> str | list[str | None] | None:
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        if skip_special_tokens:
            return self.hf_tokenizer.convert_ids_to_tokens(ids, skip_special_tokens=True)
        return [self.backend_tokenizer.id_to_token(index) for index in ids]

    # ---- chat template ------------------------------------------------------------

    def apply_chat_template(self, conversation: Any, tools: Any = None, documents: Any = None,
                            chat_template: str | None = None, add_generation_prompt: bool = False,
                            tokenize: bool = True, **kwargs: Any) -> Any:
        """A plain conversation (string fields only) rendered here; anything else by transformers."""
        template = chat_template or self.chat_template
        messages = _plain_messages(conversation)
        if (tokenize or tools is not None or documents is not None or kwargs or messages is None
                or not isinstance(template, str) or _GENERATION_TAG.search(template)):
            return self.hf_tokenizer.apply_chat_template(
                conversation, tools=tools, documents=documents, chat_template=chat_template,
                add_generation_prompt=add_generation_prompt, tokenize=tokenize, **kwargs)
        return render_plain_chat(template, messages, add_generation_prompt, self.special_tokens_map)

    # ---- everything else ------------------------------------------------------------

    @property
    def hf_tokenizer(self) -> Any:
        """The transformers tokenizer of the same directory (imports transformers once)."""
        with self._hf_lock:
            if self._hf is None:
                from transformers import PreTrainedTokenizerFast
                self._hf = PreTrainedTokenizerFast.from_pretrained(self.name_or_path)
        return self._hf

    def __reduce__(self) -> tuple:
        return FastTokenizer, (self.name_or_path,)  # pickled as its directory (a lock does not pickle)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.hf_tokenizer, name)


def _read_chat_template(directory: str, config: dict) -> str | None:
    path = os.path.join(directory, "chat_template.jinja")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as file:
            return file.read()
    template = config.get("chat_template")
    return template if isinstance(template, str) else None


def _plain_messages(conversation: Any) -> list[dict[str, str]] | None:
    """The messages with their None fields dropped (as transformers does), when every message
    is a dict of string fields without reasoning aliases; else None."""
    if not isinstance(conversation, (list, tuple)) or not conversation:
        return None
    messages = []
    for message in conversation:
        if type(message) is not dict:
            return None
        kept = {key: value for key, value in message.items() if value is not None}
        if not all(type(key) is str and type(value) is str for key, value in kept.items()):
            return None
        if _ALIASED_MESSAGE_KEYS & kept.keys():
            return None
        messages.append(kept)
    return messages


_template_cache: dict[str, Any] = {}
_template_lock = threading.Lock()


def render_plain_chat(template: str, messages: list[dict[str, str]], add_generation_prompt: bool,
                      special_tokens: dict[str, str]) -> str:
    """Render `template` the way transformers' `apply_chat_template(tokenize=False)` does for
    string-only messages: a sandboxed Jinja environment with trimmed blocks and loop
    controls, `raise_exception`, `strftime_now` and a `tojson` that does not escape HTML."""
    with _template_lock:
        compiled = _template_cache.get(template)
        if compiled is None:
            compiled = _template_cache[template] = _jinja_environment().from_string(template)
    return compiled.render(messages=messages, tools=None, documents=None,
                           add_generation_prompt=add_generation_prompt, **special_tokens)


def _jinja_environment() -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        return datetime.datetime.now().strftime(format)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[jinja2.ext.loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = strftime_now
    return environment
