"""The Anthropic Messages API: POST /v1/messages and POST /v1/messages/count_tokens.

A request is translated once into a `ChatSpec` (kvserve/server/chat_request.py). The
answer is a `thinking` block when the request enables thinking and the model wrote its
reasoning apart (harmony's analysis channel, a `<think>` block; its `signature` an HMAC of the
text, see protocol_anthropic.py), a `text` block and one `tool_use` block per tool call. Without
thinking enabled the reasoning is not shown, and a model whose chat template switches thinking
(`enable_thinking`, Qwen3's) is asked not to think; `stop_reason` is
"end_turn", "max_tokens", "stop_sequence" (with `stop_sequence`) or "tool_use". Usage
counts the prompt tokens read from the prefix cache as `cache_read_input_tokens` and the
rest as `input_tokens`, as Anthropic does. Streamed, it is Anthropic's event sequence
(`message_start`, `ping`, `content_block_start` / `_delta` / `_stop`, `message_delta`,
`message_stop`; a thinking block's `thinking_delta`s end with its `signature_delta`), or an
`error` event once the stream has begun. Errors on these routes have Anthropic's shape (kvserve/server/errors.py).
"""
from __future__ import annotations

import json
from functools import partial
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from kvserve.engine.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import SamplingParams, StructuredOutputsParams
from kvserve.server.chat_events import (ArgumentsDelta, CallStarted, ChatEvent, ChatEventReader, ReasoningDelta,
                                       TextDelta)
from kvserve.server.chat_request import ChatSpec, count_prompt_tokens, parsed_reply, start_chat
from kvserve.server.errors import anthropic_error
from kvserve.server.protocol_anthropic import CountTokensRequest, MessagesRequest, thinking_signature
from kvserve.server.serving import ServingContext, new_id, parse_request, respond, to_api_error
from kvserve.server.tools import ToolCall, ToolRequest


def add_messages_routes(app: FastAPI, ctx: ServingContext) -> None:
    """POST /v1/messages and /v1/messages/count_tokens."""

    @app.post("/v1/messages")
    async def messages(raw_request: Request):
        return await create_message(raw_request, ctx)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(raw_request: Request):
        body = await parse_request(raw_request, ctx, CountTokensRequest)
        try:
            count = await count_prompt_tokens(ctx, _spec(body))
        except Exception as exc:  # noqa: BLE001
            raise to_api_error(exc) from None
        return JSONResponse({"input_tokens": count})


def _spec(body: CountTokensRequest) -> ChatSpec:
    messages, prefix = body.conversation()
    tool_choice, parallel = body.chat_tool_choice()
    full = isinstance(body, MessagesRequest)
    return ChatSpec(messages=messages, build_params=partial(_build_params, body),
                    max_tokens=body.max_tokens if full else None, tools=body.chat_tools(), tool_choice=tool_choice,
                    parallel_tool_calls=parallel, constraint=body.constraint() if full else None,
                    assistant_prefix=prefix, enable_thinking=body.shows_thinking)


def _build_params(body: MessagesRequest, max_tokens: int, constraint: StructuredOutputsParams | None
                  ) -> SamplingParams:
    return SamplingParams(temperature=1.0 if body.temperature is None else body.temperature,
                          top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k,
                          max_tokens=max_tokens, stop=list(body.stop_sequences or []),
                          structured_outputs=constraint)


async def create_message(raw_request: Request, ctx: ServingContext):
    """Handle one /v1/messages call (streaming or not)."""
    body = await parse_request(raw_request, ctx, MessagesRequest)
    message_id = new_id("msg").replace("-", "_")
    prepared, outputs = await start_chat(ctx, partial(_spec, body), message_id)
    return await respond(raw_request, outputs, body.stream,
                         partial(_stream_events, ctx, message_id, prepared.tool_request, body),
                         partial(_full_response, ctx, message_id, prepared.tool_request, body), sse_done=None)


def _stop(completion: CompletionOutput, called: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished completion."""
    if completion.finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(completion.stop_reason, str):
        return "stop_sequence", completion.stop_reason
    return "end_turn", None


def _usage(request_output: RequestOutput, output_tokens: int) -> dict:
    cached = request_output.num_cached_tokens
    return {"input_tokens": len(request_output.prompt_token_ids or []) - cached, "output_tokens": output_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def _message(ctx: ServingContext, message_id: str, content: list[dict], usage: dict,
             stop: tuple[str | None, str | None] = (None, None)) -> dict:
    return {"id": message_id, "type": "message", "role": "assistant", "model": ctx.served_model_name,
            "content": content, "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}


def _tool_use(call: ToolCall) -> dict:
    try:
        arguments = json.loads(call.arguments) if call.arguments else {}
    except json.JSONDecodeError:
        arguments = {}
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": arguments}


def _thinking_block(thinking: str, body: MessagesRequest) -> dict:
    shown = "" if body.omits_thinking_text else thinking
    return {"type": "thinking", "thinking": shown, "signature": thinking_signature(shown)}


def _full_response(ctx: ServingContext, message_id: str, tool_request: ToolRequest | None, body: MessagesRequest,
                   final_by_index: dict[int, RequestOutput]) -> dict:
    request_output = final_by_index[0]
    completion = request_output.outputs[0]
    reasoning, text, calls = parsed_reply(completion, tool_request)
    content = [_thinking_block(reasoning, body)] if reasoning and body.shows_thinking else []
    content += ([{"type": "text", "text": text}] if text else []) + [_tool_use(call) for call in calls]
    return _message(ctx, message_id, content, _usage(request_output, len(completion.token_ids)),
                    _stop(completion, bool(calls)))


def _sse(event_type: str, payload: dict) -> str:
    return f"event: {event_type}\ndata: {json.dumps({'type': event_type, **payload}, ensure_ascii=False)}\n\n"


class _BlockStream:
    """Content blocks as they are streamed: a thinking block while reasoning comes (when the
    request shows it), a text block while text comes, a tool_use block per call."""

    def __init__(self, body: MessagesRequest) -> None:
        self.body = body
        self.index = -1
        self._open: str | None = None  # "thinking", "text" or "tool_use"
        self._call_index = -1
        self._thinking = ""

    def add(self, event: ChatEvent) -> list[str]:
        if isinstance(event, ReasoningDelta):
            if not self.body.shows_thinking:
                return []
            events = [] if self._open == "thinking" else self._start({"type": "thinking", "thinking": "",
                                                                       "signature": ""})
            if self.body.omits_thinking_text:
                return events
            self._thinking += event.text
            return events + [_sse("content_block_delta", {"index": self.index, "delta": {
                "type": "thinking_delta", "thinking": event.text}})]
        if isinstance(event, TextDelta):
            events = [] if self._open == "text" else self._start({"type": "text", "text": ""})
            return events + [_sse("content_block_delta", {"index": self.index, "delta": {
                "type": "text_delta", "text": event.text}})]
        if isinstance(event, CallStarted):
            self._call_index = event.index
            return self._start({"type": "tool_use", "id": event.call_id, "name": event.name, "input": {}})
        if isinstance(event, ArgumentsDelta) and self._open == "tool_use" and event.index == self._call_index:
            return [_sse("content_block_delta", {"index": self.index, "delta": {
                "type": "input_json_delta", "partial_json": event.text}})]
        return []

    def close(self) -> list[str]:
        if self._open is None:
            return []
        events = []
        if self._open == "thinking":
            events.append(_sse("content_block_delta", {"index": self.index, "delta": {
                "type": "signature_delta", "signature": thinking_signature(self._thinking)}}))
        self._open = None
        return events + [_sse("content_block_stop", {"index": self.index})]

    def _start(self, block: dict) -> list[str]:
        events = self.close()
        self.index += 1
        self._open = block["type"]
        self._thinking = ""
        return events + [_sse("content_block_start", {"index": self.index, "content_block": block})]


async def _stream_events(ctx: ServingContext, message_id: str, tool_request: ToolRequest | None,
                         body: MessagesRequest, outputs: AsyncIterator[tuple[int, RequestOutput]]
                         ) -> AsyncIterator[str]:
    reader = ChatEventReader(tool_request)
    blocks = _BlockStream(body)
    last_output = None
    try:
        async for _, request_output in outputs:
            if last_output is None:
                start = _message(ctx, message_id, [], _usage(request_output, 0))
                yield _sse("message_start", {"message": start})
                yield _sse("ping", {})
            last_output = request_output
            for event in reader.update(request_output.outputs[0]):
                for sse_event in blocks.add(event):
                    yield sse_event
    except Exception as exc:  # noqa: BLE001 - the stream has started: report in-band
        _, error_body = anthropic_error(to_api_error(exc))
        yield _sse("error", {"error": error_body["error"]})
        return
    if last_output is None:
        return
    for sse_event in blocks.close():
        yield sse_event
    completion = last_output.outputs[0]
    stop_reason, stop_sequence = _stop(completion, reader.called)
    usage = _usage(last_output, len(completion.token_ids))
    yield _sse("message_delta", {"delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                 "usage": {"output_tokens": usage["output_tokens"],
                                           "input_tokens": usage["input_tokens"],
                                           "cache_read_input_tokens": usage["cache_read_input_tokens"]}})
    yield _sse("message_stop", {})
