"""POST /v1/chat/completions: messages rendered with the model's chat template."""
from __future__ import annotations

import math
import time
from functools import partial
from typing import AsyncIterator

from fastapi import Request

from kvserve.engine.outputs import CompletionOutput, RequestOutput
from kvserve.server.errors import bad_request
from kvserve.server.protocol import ChatCompletionRequest
from kvserve.server.serving import (ChoiceStreamState, ChunkFormatter, ServingContext, merged_outputs,
                                    new_id, next_delta, parse_request, resolve_max_tokens, respond,
                                    run_tokenizer, submit_all, to_api_error, token_logprob_entries,
                                    token_text, usage_dict)


async def _render_prompt(ctx: ServingContext, body: ChatCompletionRequest) -> list[int]:
    from kvserve.engine.tokenizer import apply_chat_template
    conversation = body.conversation()  # raises UnsupportedFeatureError for non-text parts
    text_len = sum(len(message["content"]) for message in conversation)
    try:
        token_ids = await run_tokenizer(text_len, apply_chat_template, ctx.engine.tokenizer,
                                        conversation, add_generation_prompt=body.add_generation_prompt)
    except Exception as exc:  # noqa: BLE001 - template errors are the request's fault
        raise bad_request(f"the chat template rejected the messages: {exc}",
                          param="messages") from None
    return list(token_ids)


async def create_chat_completion(raw_request: Request, ctx: ServingContext):
    """Handle one /v1/chat/completions call (streaming or not)."""
    body = await parse_request(raw_request, ctx, ChatCompletionRequest)
    try:
        prompt_token_ids = await _render_prompt(ctx, body)
        max_tokens = resolve_max_tokens(ctx.engine, len(prompt_token_ids),
                                        body.requested_max_tokens())
        params = body.build_sampling_params(max_tokens, body.num_logprobs())
        ctx.engine.validator.check_prompt_fits(len(prompt_token_ids), max_tokens)
    except Exception as exc:  # noqa: BLE001
        raise to_api_error(exc) from None
    response_id = new_id("chatcmpl")
    outputs = merged_outputs(ctx, submit_all(ctx, [(prompt_token_ids, params)], response_id))
    return await respond(raw_request, outputs, body.stream, partial(_stream_events, ctx, body, response_id),
                         partial(_full_response, ctx, body, response_id))


def _full_response(ctx: ServingContext, body: ChatCompletionRequest, response_id: str,
                   final_by_index: dict[int, RequestOutput]) -> dict:
    request_output = final_by_index[0]
    choices = []
    for completion in request_output.outputs:
        logprobs = None
        if body.logprobs:
            logprobs = {"content": _chat_logprobs(ctx, completion, 0, len(completion.token_ids),
                                                   body.top_logprobs or 0)}
        choices.append({"index": completion.index,
                        "message": {"role": "assistant", "content": completion.text},
                        "logprobs": logprobs, "finish_reason": completion.finish_reason,
                        "stop_reason": completion.stop_reason})
    choices.sort(key=lambda c: c["index"])
    return {"id": response_id, "object": "chat.completion", "created": int(time.time()),
            "model": ctx.served_model_name, "choices": choices,
            "usage": usage_dict([request_output])}


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
                         outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[str]:
    chunk = ChunkFormatter(response_id, "chat.completion.chunk", ctx.served_model_name, body.include_usage)
    states: dict[int, ChoiceStreamState] = {}
    last_output = None
    yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                  "logprobs": None, "finish_reason": None} for i in range(body.n)])
    async for _, request_output in outputs:
        last_output = request_output
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
