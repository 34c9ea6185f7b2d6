"""The one translation from a chat-style API call to kvserve's engine request.

Chat Completions, Responses and Messages each parse their own request shape into a
`ChatSpec` (a conversation of `ChatMessage`s, tools in the Chat Completions shape, an
output constraint, sampling fields); `prepare_chat` turns it into the prompt token ids
(the model's chat template, or the built-in tool template), the checked tool request and
the `SamplingParams` with the compiled constraint or tool-forcing grammar. The answer
comes back through `parsed_reply` (reasoning, content and tool calls of a finished completion)
or, streamed, through `kvserve/server/chat_events.py`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from kvserve.engine.outputs import CompletionOutput
from kvserve.sampling_params import SamplingParams, StructuredOutputsParams
from kvserve.server.errors import bad_request
from kvserve.server.harmony import STOP_TOKENS, render_harmony
from kvserve.server.harmony_reply import parse_reply
from kvserve.server.think_reply import prompt_opens_thinking, split_thinking
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
    # low / medium / high, for a model that reasons (harmony's system message says it).
    reasoning_effort: str | None = None
    # The chat template's `enable_thinking` (Qwen3's switch between thinking and not); None: its default.
    enable_thinking: bool | None = None


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
    if tool_request is not None and tool_request.parser == "harmony":
        _read_by_channel(ctx, params)
    if tool_request is not None and tool_request.reads_thinking:
        tool_request.thinking_open = prompt_opens_thinking(prompt_token_ids, ctx.think_token_ids())
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


def _read_by_channel(ctx: ServingContext, params: SamplingParams) -> None:
    """A harmony reply keeps its channel tokens in the text and stops at `<|return|>` or `<|call|>`."""
    token_ids = ctx.harmony_token_ids()
    if token_ids is None:
        raise bad_request("--tool-call-parser harmony needs a model whose tokenizer has the harmony tokens")
    params.skip_special_tokens = False
    params.stop_token_ids = list(dict.fromkeys([*params.stop_token_ids, *(token_ids[t] for t in STOP_TOKENS)]))


def speaks_harmony(ctx: ServingContext) -> bool:
    """Whether chats are rendered and read in harmony (asked for, or the tokenizer has its tokens)."""
    if ctx.tool_call_parser is not None:
        return ctx.tool_call_parser == "harmony"
    return ctx.harmony_token_ids() is not None


def checked_tools(ctx: ServingContext, spec: ChatSpec) -> ToolRequest | None:
    """The call's tool request, its tools and the conversation's tool turns checked. A harmony
    model, or one that thinks in a <think> block, always gets one (its reply is read by channel,
    or for the block), with no tools when the call has none."""
    check_tool_messages(spec.messages)
    parser = "harmony" if speaks_harmony(ctx) else (
        ctx.tool_call_parser or parser_for_template(ctx.engine.tokenizer.chat_template))
    tool_request = parse_tool_request(spec, parser)
    thinks = parser != "harmony" and ctx.think_token_ids() is not None
    if tool_request is None and (parser == "harmony" or thinks):
        tool_request = ToolRequest([], "none", None, True, parser)
    if tool_request is not None:
        tool_request.reads_thinking = thinks
    return tool_request


async def count_prompt_tokens(ctx: ServingContext, spec: ChatSpec) -> int:
    """How many tokens `spec`'s prompt has (its tools included), without running it."""
    return len(await render_prompt(ctx, spec, checked_tools(ctx, spec)))


async def render_prompt(ctx: ServingContext, spec: ChatSpec, tool_request: ToolRequest | None) -> list[int]:
    """The conversation's prompt token ids (the tools rendered when the call may use them)."""
    from kvserve.engine.tokenizer import apply_chat_template
    if tool_request is not None and tool_request.parser == "harmony":
        return await _render_harmony(ctx, spec, tool_request)
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
                                        chat_template=template, tools=tools, enable_thinking=spec.enable_thinking)
    except Exception as exc:  # noqa: BLE001 - template errors are the request's fault
        raise bad_request(f"the chat template rejected the messages: {exc}",
                          param="messages") from None
    token_ids = list(token_ids)
    if spec.assistant_prefix:
        token_ids += await run_tokenizer(len(spec.assistant_prefix), ctx.engine.encode, spec.assistant_prefix)
    return token_ids


async def _render_harmony(ctx: ServingContext, spec: ChatSpec, tool_request: ToolRequest) -> list[int]:
    text = render_harmony(spec.messages, tool_request.rendered_tools, spec.reasoning_effort,
                          spec.add_generation_prompt) + spec.assistant_prefix
    return list(await run_tokenizer(len(text), ctx.engine.tokenizer.encode, text, add_special_tokens=False))


def parsed_reply(completion: CompletionOutput, tool_request: ToolRequest | None) -> tuple[str, str, list[ToolCall]]:
    """(reasoning, content, tool calls) of a finished completion; no calls unless the call may
    make them, reasoning only from a model that writes it apart (harmony's analysis channel,
    a <think> block)."""
    if tool_request is None or not tool_request.parses_reply:
        return "", completion.text, []
    if tool_request.parser == "harmony":
        reasoning, content, calls = parse_reply(completion.text, tool_request.parses_calls)
        return reasoning, content, calls if tool_request.parallel else calls[:1]
    reasoning, answer = "", completion.text
    if tool_request.reads_thinking:
        reasoning, answer = split_thinking(answer, tool_request.thinking_open, final=True)
    if not tool_request.parses_calls:
        return reasoning, answer, []
    content, calls = extract_tool_calls(tool_request.parser, answer)
    return reasoning, content, calls if tool_request.parallel else calls[:1]
