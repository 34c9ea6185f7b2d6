"""POST /v1/chat/completions: messages rendered with the model's chat template."""
from __future__ import annotations

import math
import time
from functools import partial
from typing import AsyncIterator

from fastapi import Request

from kvserve.engine.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import SamplingParams, StructuredOutputsParams
from kvserve.server.chat_events import ReplyStreamer, reply_streamer
from kvserve.server.chat_request import ChatSpec, parsed_reply, start_chat
from kvserve.server.protocol import ChatCompletionRequest
from kvserve.server.serving import (ChoiceStreamState, ChunkFormatter, ServingContext, new_id, next_delta,
                                    parse_request, respond, token_logprob_entries, token_text, usage_dict)
from kvserve.server.structured import constraint_from_request
from kvserve.server.tools import ToolRequest


def chat_spec(body: ChatCompletionRequest) -> ChatSpec:
    """The shared translation of a Chat Completions request."""
    return ChatSpec(messages=body.messages, build_params=partial(_build_params, body),
                    max_tokens=body.requested_max_tokens(), tools=body.tools or [],
                    tool_choice=body.tool_choice, parallel_tool_calls=body.parallel_tool_calls,
                    constraint=constraint_from_request(body), add_generation_prompt=body.add_generation_prompt,
                    reasoning_effort=body.reasoning_effort)


def _build_params(body: ChatCompletionRequest, max_tokens: int,
                  constraint: StructuredOutputsParams | None) -> SamplingParams:
    return body.build_sampling_params(max_tokens, body.num_logprobs(), constraint)


async def create_chat_completion(raw_request: Request, ctx: ServingContext):
    """Handle one /v1/chat/completions call (streaming or not)."""
    body = await parse_request(raw_request, ctx, ChatCompletionRequest)
    response_id = new_id("chatcmpl")
    prepared, outputs = await start_chat(ctx, partial(chat_spec, body), response_id)
    tool_request = prepared.tool_request
    return await respond(raw_request, outputs, body.stream,
                         partial(_stream_events, ctx, body, response_id, tool_request),
                         partial(_full_response, ctx, body, response_id, tool_request))


def _full_response(ctx: ServingContext, body: ChatCompletionRequest, response_id: str,
                   tool_request: ToolRequest | None, final_by_index: dict[int, RequestOutput]) -> dict:
    request_output = final_by_index[0]
    choices = []
    for completion in request_output.outputs:
        logprobs = None
        if body.logprobs:
            logprobs = {"content": _chat_logprobs(ctx, completion, 0, len(completion.token_ids),
                                                   body.top_logprobs or 0)}
        message, finish_reason = _message(completion, tool_request)
        choices.append({"index": completion.index, "message": message,
                        "logprobs": logprobs, "finish_reason": finish_reason,
                        "stop_reason": completion.stop_reason})
    choices.sort(key=lambda c: c["index"])
    return {"id": response_id, "object": "chat.completion", "created": int(time.time()),
            "model": ctx.served_model_name, "choices": choices,
            "usage": usage_dict([request_output])}


def _message(completion: CompletionOutput, tool_request: ToolRequest | None) -> tuple[dict, str | None]:
    """The assistant message and finish reason of a finished choice ("tool_calls" when it called);
    `reasoning_content` when the model wrote its reasoning apart (harmony's analysis channel)."""
    reasoning, content, calls = parsed_reply(completion, tool_request)
    message: dict = {"role": "assistant"}
    if reasoning:
        message["reasoning_content"] = reasoning
    if not calls:
        return {**message, "content": content}, completion.finish_reason
    finish_reason = "tool_calls" if completion.finish_reason == "stop" else completion.finish_reason
    return {**message, "content": content or None,
            "tool_calls": [call.to_openai() for call in calls]}, finish_reason


def _logprob_value(value: float) -> float:
    """JSON has no -inf or NaN; OpenAI clients expect a very negative number."""
    return value if math.isfinite(value) else -9999.0


def _chat_logprobs(ctx: ServingContext, completion: CompletionOutput, start: int, end: int,
                   num_top: int) -> list[dict]:
    tokenizer = ctx.engine.tokenizer
    content = []
    for token_id, logprob, top in token_logprob_entries(completion, start, end):
        token = token_text(tokenizer, token_id)
        top_entries = []
        for top_id, top_logprob, rank in top:
            if rank is not None and rank > num_top:
                continue  # the sampled token, outside the top N asked for
            top_token = token_text(tokenizer, top_id)
            top_entries.append({"token": top_token, "logprob": _logprob_value(top_logprob),
                                "bytes": list(top_token.encode("utf-8"))})
        content.append({"token": token, "logprob": _logprob_value(logprob),
                        "bytes": list(token.encode("utf-8")), "top_logprobs": top_entries})
    return content


async def _stream_events(ctx: ServingContext, body: ChatCompletionRequest, response_id: str,
                         tool_request: ToolRequest | None,
                         outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[str]:
    chunk = ChunkFormatter(response_id, "chat.completion.chunk", ctx.served_model_name, body.include_usage)
    states: dict[int, ChoiceStreamState] = {}
    streamers: dict[int, ReplyStreamer] = {}
    last_output = None
    yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                  "logprobs": None, "finish_reason": None} for i in range(body.n)])
    async for _, request_output in outputs:
        last_output = request_output
        if tool_request is not None and tool_request.parses_reply:
            for choices in _tool_stream_chunks(request_output, tool_request, streamers):
                yield chunk(choices)
            continue
        choices = _delta_choices(ctx, body, request_output, states)
        if choices:
            yield chunk(choices)
    if body.include_usage and last_output is not None:
        yield chunk([], usage_dict([last_output]))


def _delta_choices(ctx: ServingContext, body: ChatCompletionRequest, request_output: RequestOutput,
                   states: dict[int, ChoiceStreamState]) -> list[dict]:
    choices = []
    for completion in request_output.outputs:
        state = states.setdefault(completion.index, ChoiceStreamState())
        text, start, end, finished_now = next_delta(state, completion)
        if not text and start == end and not finished_now:
            continue
        logprobs = None
        if body.logprobs:
            logprobs = {"content": _chat_logprobs(ctx, completion, start, end,
                                                   body.top_logprobs or 0)}
        delta = {"content": text} if text or not finished_now else {}
        choices.append({"index": completion.index, "delta": delta, "logprobs": logprobs,
                        "finish_reason": completion.finish_reason if finished_now else None,
                        "stop_reason": completion.stop_reason if finished_now else None})
    return choices


def _tool_stream_chunks(request_output: RequestOutput, tool_request: ToolRequest,
                        streamers: dict[int, ReplyStreamer]) -> list[list[dict]]:
    """With tools (or harmony's channels), each choice's text goes through its reply streamer:
    reasoning, content that cannot become a call, then each call's id, type and name, then its
    arguments as they are generated; the finish reason last ("tool_calls" when it called)."""
    chunks = []
    for completion in request_output.outputs:
        if completion.index not in streamers:
            streamers[completion.index] = reply_streamer(tool_request)
        streamer = streamers[completion.index]
        if streamer.finished:
            continue
        finished = completion.finish_reason is not None
        text = completion.text or ""
        deltas = streamer.finish(text) if finished else streamer.update(text)
        chunks.extend([_delta_choice(completion.index, delta)] for delta in deltas)
        if finished:
            _, finish_reason = _message(completion, tool_request)
            if streamer.sent_calls and finish_reason == "stop":
                finish_reason = "tool_calls"
            chunks.append([_delta_choice(completion.index, {}, finish_reason)])
    return chunks


def _delta_choice(index: int, delta: dict, finish_reason: str | None = None) -> dict:
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
