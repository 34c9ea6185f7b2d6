"""Chat templates over the model's tokenizer (loading lives in `kvserve.model.tokenizer_files`)."""
from __future__ import annotations

from typing import Any, Sequence

from kvserve.model.tokenizer_files import TokenizerError, load_tokenizer, tokenizer_cache_dir

__all__ = ["TokenizerError", "load_tokenizer", "tokenizer_cache_dir", "apply_chat_template",
           "chat_prompt", "render_chat_template"]


def apply_chat_template(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    tools: list[dict[str, Any]] | None = None,
    enable_thinking: bool | None = None,
) -> list[int]:
    """Token ids of a conversation rendered with the model's chat template (`enable_thinking`:
    the template's switch of that name, as Qwen3's have; None leaves the template's default)."""
    return chat_prompt(tokenizer, messages, add_generation_prompt, chat_template, tools, enable_thinking)[1]


def chat_prompt(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    tools: list[dict[str, Any]] | None = None,
    enable_thinking: bool | None = None,
) -> tuple[str, list[int]]:
    """(text, token ids) of a conversation, rendered once with the model's chat template.

    The template writes the special tokens itself (BOS, role markers), so the
    rendered text is encoded without adding any.
    """
    text = render_chat_template(tokenizer, messages, add_generation_prompt, chat_template, tools, enable_thinking)
    return text, list(tokenizer.encode(text, add_special_tokens=False))


def render_chat_template(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    tools: list[dict[str, Any]] | None = None,
    enable_thinking: bool | None = None,
) -> str:
    """The conversation as the prompt text the model was trained on."""
    _check_messages(messages)
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise TokenizerError("this model has no chat template: use generate() with a plain prompt")
    switches = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    return tokenizer.apply_chat_template(
        list(messages), chat_template=template, add_generation_prompt=add_generation_prompt,
        tokenize=False, tools=tools, **switches)


def _check_messages(messages: Sequence[dict[str, Any]]) -> None:
    if isinstance(messages, (str, bytes)) or not messages:
        raise TokenizerError("a conversation must be a non-empty list of {'role', 'content'} messages")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise TokenizerError(f"message {index} must be a dict with 'role' and 'content'")
