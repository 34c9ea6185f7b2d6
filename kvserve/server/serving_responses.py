"""The OpenAI Responses API: POST /v1/responses, GET / DELETE /v1/responses/{id},
POST /v1/responses/{id}/cancel.

A request is translated once into a `ChatSpec` (kvserve/server/chat_request.py): the
stored conversation of `previous_response_id`, then `instructions` as the system turn,
then `input`. The answer is a `reasoning` item when the model wrote its reasoning apart
(harmony's analysis channel, a `<think>` block: its text in `content` as `reasoning_text`,
`summary` empty), a message item (`output_text`) and one `function_call` item per tool
call; `status` is "completed", or "incomplete" with `incomplete_details.reason`
"max_output_tokens" when the token limit cut it. Streamed, it is Responses' typed events
with increasing `sequence_number`s (the reasoning as `response.reasoning_text.delta` /
`.done`), ending with `response.completed` (or `response.incomplete`), or an `error`
event. With `background: true` the call answers at once (status "in_progress"); GET polls
it and cancel aborts it.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from functools import partial
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse

from kvserve.engine.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams, StructuredOutputsParams
from kvserve.server.chat_events import (ArgumentsDelta, CallStarted, ChatEvent, ChatEventReader, ReasoningDelta,
                                       TextDelta)
from kvserve.server.chat_request import ChatSpec, parsed_reply, start_chat
from kvserve.server.errors import APIError
from kvserve.server.protocol import ChatMessage
from kvserve.server.protocol_responses import ResponsesRequest, input_messages
from kvserve.server.response_store import ResponseStore, StoredResponse
from kvserve.server.serving import ServingContext, parse_request, respond, to_api_error
from kvserve.server.tools import ToolCall, ToolRequest


def _hex_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id {response_id!r} not found.", param="response_id",
                    code="response_not_found")


@dataclass
class ResponseState:
    """One response object as it evolves: the request's echo fields, then status, output, usage."""

    body: ResponsesRequest
    model: str
    id: str = field(default_factory=lambda: _hex_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))
    status: str = "in_progress"
    output: list[dict] = field(default_factory=list)
    usage: dict | None = None
    # How many tokens the model spent on reasoning (re-tokenized from its text).
    reasoning_tokens: int = 0
    incomplete_reason: str | None = None
    error: dict | None = None
    completed_at: int | None = None

    def to_dict(self) -> dict:
        body = self.body
        text_format = body.text.format.model_dump(by_alias=True, exclude_none=True) \
            if body.text is not None and body.text.format is not None else {"type": "text"}
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": self.status,
            "background": body.background, "completed_at": self.completed_at, "error": self.error,
            "incomplete_details": {"reason": self.incomplete_reason} if self.incomplete_reason else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {}, "model": self.model, "output": self.output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id, "store": body.store,
            "reasoning": {"effort": body.reasoning.effort if body.reasoning else None, "summary": None},
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": {"format": text_format}, "tool_choice": body.tool_choice or "auto",
            "tools": body.tools or [], "top_p": 1.0 if body.top_p is None else body.top_p,
            "truncation": "disabled", "usage": self.usage, "user": body.user,
        }

    def finish(self, request_output: RequestOutput, output: list[dict]) -> None:
        completion = request_output.outputs[0]
        self.output = output
        if completion.finish_reason == "length":
            self.status, self.incomplete_reason = "incomplete", "max_output_tokens"
        else:
            self.status = "completed"
        self.usage = _usage(request_output, self.reasoning_tokens)
        self.completed_at = int(time.time())


def _usage(request_output: RequestOutput, reasoning_tokens: int) -> dict:
    input_tokens = len(request_output.prompt_token_ids or [])
    output_tokens = sum(len(c.token_ids) for c in request_output.outputs)
    return {"input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": request_output.num_cached_tokens, "cache_write_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, output_tokens)},
            "total_tokens": input_tokens + output_tokens}


def _message_item(text: str, status: str, item_id: str | None = None) -> dict:
    return {"id": item_id or _hex_id("msg"), "type": "message", "role": "assistant", "status": status,
            "content": [_text_part(text)]}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _reasoning_item(text: str, status: str) -> dict:
    return {"id": _hex_id("rs"), "type": "reasoning", "status": status, "summary": [],
            "content": [_reasoning_part(text)]}


def _reasoning_part(text: str) -> dict:
    return {"type": "reasoning_text", "text": text}


def _call_item(call: ToolCall, status: str = "completed", item_id: str | None = None) -> dict:
    return {"id": item_id or _hex_id("fc"), "type": "function_call", "call_id": call.id, "name": call.name,
            "arguments": call.arguments, "status": status}


def output_items(reasoning: str, content: str, calls: list[ToolCall], incomplete: bool) -> list[dict]:
    """A finished answer's output items: its reasoning, the message (unless it only called tools
    or was cut while reasoning), then the calls."""
    status = "incomplete" if incomplete else "completed"
    answered = bool(content or calls)
    items = [_reasoning_item(reasoning, "completed" if answered else status)] if reasoning else []
    if content or not (calls or reasoning):
        items.append(_message_item(content, status))
    return items + [_call_item(call) for call in calls]


def conversation_after(messages: list[ChatMessage], reasoning: str, content: str,
                       calls: list[ToolCall]) -> list[ChatMessage]:
    """`messages` followed by the answer, for a later `previous_response_id`."""
    tool_calls = [call.to_openai() for call in calls] or None
    return [*messages, ChatMessage(role="assistant", content=content or None, tool_calls=tool_calls,
                                   reasoning_content=reasoning or None)]


class ResponsesHandler:
    """The Responses routes over one engine and one response store."""

    def __init__(self, ctx: ServingContext, store: ResponseStore | None = None) -> None:
        self.ctx = ctx
        self.store = store or ResponseStore()

    async def create(self, raw_request: Request):
        ctx = self.ctx
        body = await parse_request(raw_request, ctx, ResponsesRequest)
        try:
            conversation = self._history(body) + input_messages(body.input)
        except Exception as exc:  # noqa: BLE001
            raise to_api_error(exc) from None
        state = ResponseState(body, ctx.served_model_name)
        prepared, outputs = await start_chat(ctx, partial(_spec, body, conversation), state.id)
        if body.background:
            return self._start_background(state, conversation, prepared.tool_request, outputs)
        return await respond(raw_request, outputs, body.stream,
                             partial(self._stream_events, state, conversation, prepared.tool_request),
                             partial(self._full_response, state, conversation, prepared.tool_request),
                             sse_done=None)

    def _history(self, body: ResponsesRequest) -> list[ChatMessage]:
        if body.previous_response_id is None:
            return []
        previous = self.store.get(body.previous_response_id)
        if previous is None:
            raise APIError(400, f"Previous response with id {body.previous_response_id!r} not found.",
                           param="previous_response_id", code="previous_response_not_found")
        if previous.running:
            raise APIError(400, f"Previous response {body.previous_response_id!r} is still in progress.",
                           param="previous_response_id")
        return [m.model_copy() for m in previous.conversation]

    def _full_response(self, state: ResponseState, conversation: list[ChatMessage], tool_request: ToolRequest | None,
                       final_by_index: dict[int, RequestOutput]) -> dict:
        request_output = final_by_index[0]
        completion = request_output.outputs[0]
        reasoning, content, calls = parsed_reply(completion, tool_request)
        state.reasoning_tokens = self._count_tokens(reasoning)
        state.finish(request_output, output_items(reasoning, content, calls, completion.finish_reason == "length"))
        self._store(state, conversation_after(conversation, reasoning, content, calls))
        return state.to_dict()

    def _count_tokens(self, text: str) -> int:
        return len(self.ctx.engine.tokenizer.encode(text, add_special_tokens=False)) if text else 0

    def _store(self, state: ResponseState, conversation: list[ChatMessage], task: asyncio.Task | None = None) -> None:
        if state.body.store:
            self.store.put(StoredResponse(state.to_dict(), conversation, task))

    async def _stream_events(self, state: ResponseState, conversation: list[ChatMessage],
                             tool_request: ToolRequest | None,
                             outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[str]:
        writer = EventWriter()
        yield writer.emit("response.created", response=state.to_dict())
        yield writer.emit("response.in_progress", response=state.to_dict())
        reader = ChatEventReader(tool_request)
        items = OutputItemStream(writer)
        last_output = None
        try:
            async for _, request_output in outputs:
                last_output = request_output
                for event in reader.update(request_output.outputs[0]):
                    for sse_event in items.add(event):
                        yield sse_event
        except Exception as exc:  # noqa: BLE001 - the stream has started: report in-band
            error = to_api_error(exc)
            yield writer.emit("error", code=error.code or error.error_type, message=error.message, param=error.param)
            return
        if last_output is None:
            return
        incomplete = last_output.outputs[0].finish_reason == "length"
        for sse_event in items.close_all(incomplete):
            yield sse_event
        message = reader.message
        state.reasoning_tokens = self._count_tokens(message.reasoning)
        state.finish(last_output, items.output)
        self._store(state, conversation_after(conversation, message.reasoning, message.content, message.calls))
        final_type = "response.incomplete" if state.status == "incomplete" else "response.completed"
        yield writer.emit(final_type, response=state.to_dict())

    def _start_background(self, state: ResponseState, conversation: list[ChatMessage],
                          tool_request: ToolRequest | None,
                          outputs: AsyncIterator[tuple[int, RequestOutput]]) -> JSONResponse:
        async def run() -> None:
            last_output = None
            try:
                async for _, request_output in outputs:
                    last_output = request_output
            except asyncio.CancelledError:
                state.status = "cancelled"
                self._update(state, conversation)
                raise
            except Exception as exc:  # noqa: BLE001 - reported in the stored response
                error = to_api_error(exc)
                state.status, state.error = "failed", {"code": error.code or error.error_type,
                                                      "message": error.message}
                self._update(state, conversation)
                return
            if last_output is None:
                state.status = "cancelled"
                self._update(state, conversation)
            elif self.store.get(state.id) is not None:
                self._full_response(state, conversation, tool_request, {0: last_output})

        self._store(state, conversation)
        task = asyncio.create_task(run())
        self.store.get(state.id).background_task = task
        return JSONResponse(state.to_dict())

    def _update(self, state: ResponseState, conversation: list[ChatMessage]) -> None:
        """Store a background response's new state, unless it was deleted meanwhile."""
        if self.store.get(state.id) is not None:
            self._store(state, conversation)

    async def retrieve(self, response_id: str) -> JSONResponse:
        entry = self.store.get(response_id)
        if entry is None:
            raise not_found(response_id)
        return JSONResponse(entry.response)

    async def delete(self, response_id: str) -> JSONResponse:
        entry = self.store.delete(response_id)
        if entry is None:
            raise not_found(response_id)
        if entry.background_task is not None:
            entry.background_task.cancel()
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    async def cancel(self, response_id: str) -> JSONResponse:
        entry = self.store.get(response_id)
        if entry is None:
            raise not_found(response_id)
        if not entry.response.get("background"):
            raise APIError(400, "Only responses created with background=true can be cancelled.",
                           param="response_id", code="not_background")
        task = entry.background_task
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return JSONResponse(self.store.get(response_id).response)


def _spec(body: ResponsesRequest, conversation: list[ChatMessage]) -> ChatSpec:
    return ChatSpec(messages=_with_instructions(body.instructions, conversation),
                    build_params=partial(_build_params, body), max_tokens=body.max_output_tokens,
                    tools=body.chat_tools(), tool_choice=body.chat_tool_choice(),
                    parallel_tool_calls=body.parallel_tool_calls, constraint=body.constraint(),
                    reasoning_effort=body.reasoning.harmony_effort() if body.reasoning else None,
                    enable_thinking=body.reasoning.enable_thinking() if body.reasoning else None)


def _with_instructions(instructions: str | None, messages: list[ChatMessage]) -> list[ChatMessage]:
    if not instructions:
        return messages
    return [ChatMessage(role="system", content=instructions), *messages]


def _build_params(body: ResponsesRequest, max_tokens: int, constraint: StructuredOutputsParams | None
                  ) -> SamplingParams:
    return SamplingParams(temperature=1.0 if body.temperature is None else body.temperature,
                          top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k, seed=body.seed,
                          max_tokens=max_tokens, structured_outputs=constraint)


class EventWriter:
    """Responses SSE events (`event:` line, then the JSON with `type` and `sequence_number`)."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def emit(self, event_type: str, **fields) -> str:
        payload = {"type": event_type, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {event_type}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


class OutputItemStream:
    """Output items as they are streamed: a reasoning item while reasoning comes, the message
    item while text comes, one `function_call` item per call; `output` holds each item once it
    is done."""

    def __init__(self, writer: EventWriter) -> None:
        self.writer = writer
        self.output: list[dict] = []
        self._reasoning: dict | None = None  # the open reasoning item
        self._text: dict | None = None  # the open message item
        self._call: dict | None = None  # the open function_call item
        self._call_index = -1
        self._arguments: dict[int, str] = {}

    def add(self, event: ChatEvent) -> list[str]:
        if isinstance(event, ReasoningDelta):
            events = [] if self._reasoning is not None else self._open_reasoning()
            self._reasoning["content"][0]["text"] += event.text
            return events + [self._emit("response.reasoning_text.delta", item_id=self._reasoning["id"],
                                        content_index=0, delta=event.text)]
        if isinstance(event, TextDelta):
            events = [] if self._text is not None else self._close_reasoning() + self._open_message()
            self._text["content"][0]["text"] += event.text
            return events + [self._emit("response.output_text.delta", item_id=self._text["id"], content_index=0,
                                        delta=event.text, logprobs=[])]
        if isinstance(event, CallStarted):
            events = self._close_reasoning() + self._close_message("completed") + self._close_call()
            self._call_index = event.index
            self._call = _call_item(ToolCall(event.name, "", event.call_id), status="in_progress")
            return events + [self._emit("response.output_item.added", item=dict(self._call))]
        if isinstance(event, ArgumentsDelta) and self._call is not None and event.index == self._call_index:
            self._call["arguments"] += event.text
            return [self._emit("response.function_call_arguments.delta", item_id=self._call["id"],
                               delta=event.text)]
        return []

    def close_all(self, incomplete: bool) -> list[str]:
        """Close the open items (reasoning cut by the token limit: incomplete); an answer with
        no item at all gets an empty message."""
        status = "incomplete" if incomplete else "completed"
        reasoning_only = self._reasoning is not None and not (self._text or self._call)
        events = self._close_reasoning(status if reasoning_only else "completed")
        if not (self.output or self._text or self._call):
            events += self._open_message()
        return events + self._close_message(status) + self._close_call()

    @property
    def _output_index(self) -> int:
        return len(self.output)

    def _emit(self, event_type: str, **fields) -> str:
        return self.writer.emit(event_type, output_index=self._output_index, **fields)

    def _open_reasoning(self) -> list[str]:
        events = self._close_message("completed") + self._close_call()
        self._reasoning = _reasoning_item("", "in_progress")
        return events + self._open_part_item(self._reasoning, _reasoning_part(""))

    def _close_reasoning(self, status: str = "completed") -> list[str]:
        item, self._reasoning = self._reasoning, None
        return self._close_part_item(item, status, "response.reasoning_text.done")

    def _open_message(self) -> list[str]:
        self._text = _message_item("", "in_progress")
        return self._open_part_item(self._text, _text_part(""))

    def _close_message(self, status: str) -> list[str]:
        item, self._text = self._text, None
        return self._close_part_item(item, status, "response.output_text.done", logprobs=[])

    def _open_part_item(self, item: dict, part: dict) -> list[str]:
        """The events of an item of one text part (a message, a reasoning item) being opened."""
        item["content"] = [part]
        return [self._emit("response.output_item.added", item={**item, "content": []}),
                self._emit("response.content_part.added", item_id=item["id"], content_index=0, part=dict(part))]

    def _close_part_item(self, item: dict | None, status: str, done_type: str, **done_fields) -> list[str]:
        """The events of an item of one text part being done (`done_type`: its text's done event)."""
        if item is None:
            return []
        item["status"] = status
        part = item["content"][0]
        events = [self._emit(done_type, item_id=item["id"], content_index=0, text=part["text"], **done_fields),
                  self._emit("response.content_part.done", item_id=item["id"], content_index=0, part=part),
                  self._emit("response.output_item.done", item=item)]
        self.output.append(item)
        return events

    def _close_call(self) -> list[str]:
        item = self._call
        if item is None:
            return []
        self._call = None
        item["status"] = "completed"
        events = [self._emit("response.function_call_arguments.done", item_id=item["id"], name=item["name"],
                             arguments=item["arguments"]),
                  self._emit("response.output_item.done", item=item)]
        self.output.append(item)
        return events
