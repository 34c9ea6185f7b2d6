"""`FastTokenizer` (tokenizers library alone) against transformers' fast tokenizer of the
same saved directory: the ids, the text, the chat prompts and the special tokens must be
identical, for the default model and for a zoo file (a 128k-entry Llama-3.2-1B vocabulary)."""
from __future__ import annotations

import os

import pytest

from kvserve.bench import zoo
from kvserve.engine.model_path import default_model_path
from kvserve.model import tokenizer_files
from kvserve.model.fast_tokenizer import FastTokenizer, fast_tokenizer_supports
from kvserve.model.tokenizer_files import load_tokenizer

STRINGS = [
    "", "Hi", " ", "   ", "Why is the sky blue?", "  leading and trailing  ", "multiple   inner    spaces",
    "naïve café 你好 日本語 한국어 😀👍🏽 🤖", "tabs\tand\nnewlines\r\n\n", "\u200bzero width\u00a0nbsp",
    "<|im_start|>user\nhi<|im_end|>", "a<|endoftext|>b<|im_end|>", "<|im_start|><|im_start|>",
    "x" * 500, "1234567890 3.14159 -42", "def f(x):\n    return x ** 2  # comment", "Ünïcödé ÀÉÎÕÜ ß ǅ ﬁ",
]
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo 🤖"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": " b "}, {"role": "user", "content": "c\n"}],
    [{"role": "user", "content": "with a None field", "name": None}],
]
# Templates in the styles of other families, exercising what transformers' environment adds
# (trim_blocks, lstrip_blocks, loop controls, namespace, tojson, raise_exception).
OTHER_TEMPLATES = [
    "{{- bos_token }}{%- for m in messages %}\n    {{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' "
    "+ m['content'] | trim + '<|eot_id|>' }}\n{%- endfor %}\n{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n{%- endif %}\n",
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}{% endif %}"
    "{% set ns.n = ns.n + 1 %}\n  {{ ns.n }}:{{ m | tojson }}\n{% endfor %}{% if add_generation_prompt %}>{% endif %}",
    "{% for m in messages %}{% if m['role'] not in ['user', 'assistant', 'system'] %}"
    "{{ raise_exception('bad role') }}{% endif %}<{{ m['role'] }}>{{ m['content'] }}{{ eos_token }}\n{% endfor %}",
]


def _zoo_llama_path() -> str:
    path = zoo.zoo_path(zoo.parse_zoo_name("llama-1b-q4_k_m"))
    if not os.path.isfile(path):
        pytest.skip("the 1B zoo file is not built here (kvserve bench zoo llama-1b-q4_k_m)")
    return path


@pytest.fixture(scope="module", params=["default", "zoo-llama-1b"])
def tokenizer_pair(request):
    """(FastTokenizer, transformers tokenizer) of one model's saved tokenizer directory."""
    from transformers import PreTrainedTokenizerFast
    path = default_model_path() if request.param == "default" else _zoo_llama_path()
    fast = load_tokenizer(path)
    assert isinstance(fast, FastTokenizer), "the saved tokenizer did not take the fast path"
    reference = PreTrainedTokenizerFast.from_pretrained(fast.name_or_path)
    return fast, reference


@pytest.mark.parametrize("text", STRINGS)
def test_ids_and_text_equal_transformers(tokenizer_pair, text):
    fast, reference = tokenizer_pair
    for add_special_tokens in (True, False):
        ids = fast.encode(text, add_special_tokens=add_special_tokens)
        assert ids == reference.encode(text, add_special_tokens=add_special_tokens)
        for skip in (True, False):
            assert fast.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)
        assert fast.convert_ids_to_tokens(ids) == reference.convert_ids_to_tokens(ids)


def test_special_tokens_and_vocabulary_equal_transformers(tokenizer_pair):
    fast, reference = tokenizer_pair
    for name in ("bos_token", "eos_token", "unk_token", "pad_token", "bos_token_id", "eos_token_id",
                 "pad_token_id", "special_tokens_map", "chat_template"):
        assert getattr(fast, name) == getattr(reference, name), name
    assert len(fast) == len(reference)
    assert fast.get_added_vocab() == reference.get_added_vocab()
    # An attribute FastTokenizer does not define comes from transformers' tokenizer.
    assert fast.all_special_ids == reference.all_special_ids


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("template_index", [None, *range(len(OTHER_TEMPLATES))])
def test_chat_prompts_equal_transformers(tokenizer_pair, messages, template_index):
    fast, reference = tokenizer_pair
    template = None if template_index is None else OTHER_TEMPLATES[template_index]
    for add_generation_prompt in (True, False):
        kwargs = dict(chat_template=template, add_generation_prompt=add_generation_prompt)
        text = fast.apply_chat_template(messages, tokenize=False, **kwargs)
        assert text == reference.apply_chat_template(messages, tokenize=False, **kwargs)
    # Rendered here, not by transformers (a fresh tokenizer has not loaded it).
    fresh = FastTokenizer(fast.name_or_path)
    assert fresh.apply_chat_template(messages, tokenize=False, chat_template=template) == text
    assert fresh._hf is None


def test_a_template_error_is_raised_as_by_transformers(tokenizer_pair):
    import jinja2
    fast, _ = tokenizer_pair
    with pytest.raises(jinja2.exceptions.TemplateError, match="bad role"):
        fast.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False, chat_template=OTHER_TEMPLATES[2])


def test_what_the_fast_path_does_not_render_goes_to_transformers(tokenizer_pair):
    fast, reference = tokenizer_pair
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    template = "{% for m in messages %}{{ m['role'] }}{{ m.get('reasoning_content', '') }}{% endfor %}{{ tools | tojson }}"
    cases = [
        dict(conversation=[{"role": "user", "content": "hi"}], tools=tools, chat_template=template),
        dict(conversation=[{"role": "assistant", "content": "x", "reasoning": "because"}], chat_template=template),
        dict(conversation=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
             chat_template="{% for m in messages %}{{ m['content'][0]['text'] }}{% endfor %}"),
    ]
    for case in cases:
        assert (fast.apply_chat_template(tokenize=False, **case)
                == reference.apply_chat_template(tokenize=False, **case))
    ids = fast.apply_chat_template(CONVERSATIONS[1], add_generation_prompt=True)
    expected = reference.apply_chat_template(CONVERSATIONS[1], add_generation_prompt=True)
    assert list(ids["input_ids"] if hasattr(ids, "keys") else ids) == list(
        expected["input_ids"] if hasattr(expected, "keys") else expected)


def test_the_fast_path_never_imports_transformers(tmp_path):
    """A fresh process loads the default model's saved tokenizer, encodes, decodes and renders a
    chat prompt without importing transformers (its import is most of the start-up it saves)."""
    import subprocess
    import sys

    import kvserve
    load_tokenizer(default_model_path())  # the saved directory exists
    script = (
        "import sys\n"
        "from kvserve.engine.model_path import default_model_path\n"
        "from kvserve.engine.tokenizer import chat_prompt, load_tokenizer\n"
        "tokenizer = load_tokenizer(default_model_path())\n"
        "text, ids = chat_prompt(tokenizer, [{'role': 'user', 'content': 'héllo'}])\n"
        "assert tokenizer.decode(ids) == text, (text, ids)\n"
        "print(type(tokenizer).__name__, sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))\n")
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(kvserve.__file__))}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.split() == ["FastTokenizer", "[]"]


def test_a_config_with_options_transformers_applies_on_load_is_not_taken(tmp_path):
    import json
    import shutil
    saved = load_tokenizer(default_model_path()).name_or_path
    copy = tmp_path / "copy"
    shutil.copytree(saved, copy)
    assert fast_tokenizer_supports(str(copy))
    config = json.loads((copy / "tokenizer_config.json").read_text())
    (copy / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True}))
    assert not fast_tokenizer_supports(str(copy))
    assert not isinstance(tokenizer_files._load_saved(str(copy)), FastTokenizer)


def test_a_fast_tokenizer_pickles_as_its_directory(tokenizer_pair):
    import pickle
    fast, _ = tokenizer_pair
    copy = pickle.loads(pickle.dumps(fast))
    assert isinstance(copy, FastTokenizer) and copy.name_or_path == fast.name_or_path
    assert copy.encode(STRINGS[7]) == fast.encode(STRINGS[7])
