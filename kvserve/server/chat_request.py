"""The one translation from a chat-style API call to kvserve's engine request.

Chat Completions, Responses and Messages each parse their own request shape into a
`ChatSpec` (a conversation of `ChatMessage`s, tools in the Chat Completions shape, an
output constraint, sampling fields); `prepare_chat` turns it into the prompt token ids
(the model's chat template, or the built-in tool template), the checked tool request and
the `SamplingParams` with the compiled constraint or tool-forcing grammar. The answer
comes back through `parsed_message` (content and tool calls of a finished completion)
or, streamed, through `kvserve/server/chat_events.py`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from kvserve.engine.outputs import CompletionOutput
from kvserve.sampling_params import SamplingParams, StructuredOutputsParams
from kvserve.server.errors import bad_request
from kvserve.server.protocol import ChatMessage
from kvserve.server.serving import (ServingContext, merged_outputs, resolve_max_tokens, run_tokenizer, submit_all,
                                    to_api_error)
from kvserve.server.structured import ConstraintSource, checked_source
from kvserve.server.tool_checks import check_tool_messages
from kvserve.server.tools import (FALLBACK_TOOL_TEMPLATE, ToolCall, ToolRequest, extract_tool_calls,
                                  parse_tool_request, parser_for_template, template_messages,
                                  template_supports_tools)

# Builds the call's SamplingParams once `max_tokens` and the compiled constraint are known.
ParamsBuilder = Callable[[int, StructuredOutputsParams | None], SamplingParams]


@dataclass
class ChatSpec:
    """An API-neutral chat call: what each API's request is translated into."""

    messages: list[ChatMessage]
    build_params: ParamsBuilder
    max_tokens: int | None = None
    tools: list[dict] = field(default_factory=list)  # Chat Completions shape: {"type", "function"}
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    constraint: ConstraintSource | None = None
    add_generation_prompt: bool = True
    # Text the answer continues (Anthropic's prefilled last assistant turn).
    assistant_prefix: str = ""


@dataclass
class PreparedChat:
    """A `ChatSpec` as the engine takes it."""

    prompt_token_ids: list[int]
    params: SamplingParams
    tool_request: ToolRequest | None


async def prepare_chat(ctx: ServingContext, spec: ChatSpec) -> PreparedChat:
    """Render, tokenize and check `spec`; raises InvalidRequestError / APIError (400s) for
    what the request got wrong."""
    tool_request = checked_tools(ctx, spec)
    prompt_token_ids = await render_prompt(ctx, spec, tool_request)
    max_tokens = resolve_max_tokens(ctx.engine, len(prompt_token_ids), spec.max_tokens)
    tool_grammar = tool_request.forcing_grammar() if tool_request is not None else None
    params = spec.build_params(max_tokens, await checked_source(ctx, spec.constraint, tool_grammar))
    if tool_request is not None and tool_request.parses_calls and tool_request.parser == "mistral":
        params.skip_special_tokens = False  # [TOOL_CALLS] is a special token
    ctx.engine.validator.check_prompt_fits(len(prompt_token_ids), max_tokens)
    ctx.engine.validator.check_sampling_params(params)
    return PreparedChat(prompt_token_ids, params, tool_request)


async def start_chat(ctx: ServingContext, build_spec: Callable[[], ChatSpec], request_id: str
                     ) -> tuple[PreparedChat, AsyncIterator[tuple[int, Any]]]:
    """Translate (`build_spec`), prepare and submit one chat call: (the prepared call, its
    outputs); what the request got wrong is raised as an APIError before anything runs."""
    try:
        prepared = await prepare_chat(ctx, build_spec())
    except Exception as exc:  # noqa: BLE001
        raise to_api_error(exc) from None
    outputs = merged_outputs(ctx, submit_all(ctx, [(prepared.prompt_token_ids, prepared.params)], request_id))
    return prepared, outputs


def checked_tools(ctx: ServingContext, spec: ChatSpec) -> ToolRequest | None:
    """The call's tool request, its tools and the conversation's tool turns checked."""
    check_tool_messages(spec.messages)
    parser = ctx.tool_call_parser or parser_for_template(ctx.engine.tokenizer.chat_template)
    return parse_tool_request(spec, parser)


async def count_prompt_tokens(ctx: ServingContext, spec: ChatSpec) -> int:
    """How many tokens `spec`'s prompt has (its tools included), without running it."""
    return len(await render_prompt(ctx, spec, checked_tools(ctx, spec)))


async def render_prompt(ctx: ServingContext, spec: ChatSpec, tool_request: ToolRequest | None) -> list[int]:
    """The conversation's prompt token ids (the tools rendered when the call may use them)."""
    from kvserve.engine.tokenizer import apply_chat_template
    conversation = template_messages(spec.messages)  # raises UnsupportedFeatureError for non-text parts
    text_len = sum(len(message["content"]) for message in conversation) + len(spec.assistant_prefix)
    tools = tool_request.rendered_tools if tool_request is not None else None
    template = None
    uses_tools = tools or any(m.role == "tool" or m.tool_calls for m in spec.messages)
    if uses_tools and not template_supports_tools(ctx.engine.tokenizer.chat_template):
        template = FALLBACK_TOOL_TEMPLATE
    try:
        token_ids = await run_tokenizer(text_len, apply_chat_template, ctx.engine.tokenizer,
                                        conversation, add_generation_prompt=spec.add_generation_prompt,
                                        chat_template=template, tools=tools)
    except Exception as exc:  # noqa: BLE001 - template errors are the request's fault
        raise bad_request(f"the chat template rejected the messages: {exc}",
                          param="messages") from None
    token_ids = list(token_ids)
    if spec.assistant_prefix:
        token_ids += await run_tokenizer(len(spec.assistant_prefix), ctx.engine.encode, spec.assistant_prefix)
    return token_ids


def parsed_message(completion: CompletionOutput, tool_request: ToolRequest | None) -> tuple[str, list[ToolCall]]:
    """(content, tool calls) of a finished completion; no calls unless the call may make them."""
    if tool_request is None or not tool_request.parses_calls:
        return completion.text, []
    content, calls = extract_tool_calls(tool_request.parser, completion.text)
    return content, calls if tool_request.parallel else calls[:1]
