"""Pieces shared by the completion and chat handlers.

Parsing and admission happen before any response is started, so every error
a request can cause is answered with its own status code; once streaming has
begun, an error is sent as a final SSE `error` event.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from kvserve.engine.async_llm import AsyncLLM, RequestHandle
from kvserve.engine.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.server.errors import APIError, from_validation_error, to_api_error
from kvserve.server.harmony import harmony_token_ids
from kvserve.server.think_reply import think_token_ids
from kvserve.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)

ModelT = TypeVar("ModelT", bound=BaseModel)


@dataclass
class ServingContext:
    """What every handler needs: the engine, the public model name, metrics."""

    engine: AsyncLLM
    served_model_name: str
    metrics: ServerMetrics
    created_s: int = field(default_factory=lambda: int(time.time()))
    # Tool-call format (kvserve/server/tools.py); None: harmony when the tokenizer has its
    # tokens, else picked from the chat template.
    tool_call_parser: str | None = None
    _harmony_ids: dict[str, int] | None = field(default=None, init=False, repr=False)
    _harmony_probed: bool = field(default=False, init=False, repr=False)
    _think_ids: tuple[int, int] | None = field(default=None, init=False, repr=False)
    _think_probed: bool = field(default=False, init=False, repr=False)

    def harmony_token_ids(self) -> dict[str, int] | None:
        """The ids of the harmony tokens when the model speaks harmony (gpt-oss), else None."""
        if not self._harmony_probed:
            self._harmony_ids = harmony_token_ids(self.engine.tokenizer)
            self._harmony_probed = True
        return self._harmony_ids

    def think_token_ids(self) -> tuple[int, int] | None:
        """(`<think>`, `</think>`) ids when the model writes its reasoning in a think block, else None."""
        if not self._think_probed:
            self._think_ids = think_token_ids(self.engine.tokenizer)
            self._think_probed = True
        return self._think_ids


async def parse_body(raw_request: Request, model_cls: type[ModelT]) -> ModelT:
    """Validate the raw JSON body (strict mode) into `model_cls`."""
    body = await raw_request.body()
    try:
        return model_cls.model_validate_json(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


async def parse_request(raw_request: Request, ctx: ServingContext, model_cls: type[ModelT]) -> ModelT:
    """The validated body, checked to name the served model and only supported features."""
    body = await parse_body(raw_request, model_cls)
    try:
        check_model_name(ctx, body.model)
        body.check_supported()
    except Exception as exc:  # noqa: BLE001
        raise to_api_error(exc) from None
    return body


def check_model_name(ctx: ServingContext, requested: str | None) -> None:
    if requested is not None and requested != ctx.served_model_name:
        raise APIError(404, f"The model {requested!r} does not exist; this server serves "
                            f"{ctx.served_model_name!r}", param="model", code="model_not_found")


def resolve_max_tokens(engine: AsyncLLM, num_prompt_tokens: int, requested: int | None) -> int:
    """`None` means "the rest of the context"; the fit is checked by the caller."""
    if requested is not None:
        return requested
    return max(1, engine.max_model_len - num_prompt_tokens)


# Longer texts are tokenized on a worker thread (the tokenizer releases the
# GIL), so one huge prompt does not stall every other stream on the loop.
INLINE_TOKENIZE_MAX_CHARS = 16_384


async def run_tokenizer(text_len: int, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` inline for short texts, on a thread for long ones."""
    if text_len <= INLINE_TOKENIZE_MAX_CHARS:
        return fn(*args, **kwargs)
    return await asyncio.to_thread(fn, *args, **kwargs)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


@dataclass
class ChunkFormatter:
    """The SSE chunks of one streamed call: same id, object, creation time and model in each."""

    response_id: str
    object_name: str
    model: str
    include_usage: bool
    created: int = field(default_factory=lambda: int(time.time()))

    def __call__(self, choices: list[dict], usage: dict | None = None) -> str:
        payload = {"id": self.response_id, "object": self.object_name, "created": self.created,
                   "model": self.model, "choices": choices}
        if self.include_usage:
            payload["usage"] = usage
        return sse(payload)


def usage_dict(final_outputs: list[RequestOutput]) -> dict:
    """OpenAI usage (cached prompt tokens included) over one call's requests."""
    prompt_tokens = sum(len(o.prompt_token_ids or []) for o in final_outputs)
    completion_tokens = sum(len(c.token_ids) for o in final_outputs for c in o.outputs)
    cached_tokens = sum(o.num_cached_tokens for o in final_outputs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def submit_all(ctx: ServingContext, requests: list[tuple[list[int], SamplingParams]], response_id: str
               ) -> list[RequestHandle]:
    """Admit and submit a call's engine requests in one event-loop step.

    Ids are `f"{response_id}-{i}"`; if one cannot be submitted, the ones
    already submitted are aborted and the error is raised as an APIError.
    """
    handles = []
    try:
        ctx.engine.reserve(len(requests))
        for index, (token_ids, sampling_params) in enumerate(requests):
            handles.append(ctx.engine.add_request(token_ids, sampling_params, f"{response_id}-{index}",
                                                  check_capacity=False))
    except Exception as exc:  # noqa: BLE001
        for handle in handles:
            handle.close()
        raise to_api_error(exc) from None
    return handles


async def merged_outputs(ctx: ServingContext, handles: list[RequestHandle]
                         ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several requests' outputs as `(prompt_index, output)`.

    Leaving the iteration early aborts every request still running.
    """
    queue: asyncio.Queue = asyncio.Queue()
    done_marker = object()

    async def pump(index: int, handle: RequestHandle) -> None:
        timer = ctx.metrics.timer()
        try:
            async for output in handle:
                timer.observe(output)
                _raise_if_failed(output)
                queue.put_nowait((index, output))
        except BaseException as exc:  # noqa: BLE001 - forwarded to the consumer
            queue.put_nowait((index, exc))
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            handle.close()
            timer.close()
            queue.put_nowait((index, done_marker))

    tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
    remaining = len(tasks)
    try:
        while remaining:
            index, item = await queue.get()
            if item is done_marker:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        for handle in handles:
            handle.close()


def _raise_if_failed(request_output: RequestOutput) -> None:
    """A sequence the engine finished with "error" (a failed model step) fails the call."""
    for completion in request_output.outputs:
        if completion.finish_reason == "error":
            raise APIError(500, f"generation failed: {completion.stop_reason}", code="engine_error")


async def _close_quietly(outputs: AsyncIterator[Any]) -> None:
    try:
        await outputs.aclose()  # type: ignore[attr-defined]
    except BaseException:  # noqa: BLE001 - a closing stream may still raise its error
        pass


async def collect_until_disconnect(raw_request: Request, outputs: AsyncIterator[tuple[int, Any]]
                                   ) -> dict[int, Any] | None:
    """Consume to the end; None if the client hung up first (the requests are aborted)."""
    final_by_index: dict[int, Any] = {}

    async def consume() -> None:
        async for index, output in outputs:
            final_by_index[index] = output

    consumer = asyncio.create_task(consume())
    listener = asyncio.create_task(_wait_for_disconnect(raw_request))
    try:
        await asyncio.wait({consumer, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        listener.cancel()
    if not consumer.done():
        consumer.cancel()
        await asyncio.gather(consumer, return_exceptions=True)
        await _close_quietly(outputs)
        return None
    consumer.result()  # re-raise an engine error
    return final_by_index


async def respond(raw_request: Request, outputs: AsyncIterator[tuple[int, Any]], stream: bool,
                  make_events: Callable[[AsyncIterator[tuple[int, Any]]], AsyncIterator[str]],
                  make_full_response: Callable[[dict[int, Any]], dict],
                  sse_done: str | None = SSE_DONE) -> Response:
    """Answer a call: its outputs streamed as the SSE events `make_events` builds (then
    `sse_done`, if any), or once all are final, the JSON `make_full_response` builds from
    them by prompt index (an empty 499 when the client hung up first)."""
    if stream:
        return await _streaming_response(outputs, make_events, sse_done)
    try:
        final_by_index = await collect_until_disconnect(raw_request, outputs)
    except Exception as exc:  # noqa: BLE001
        raise to_api_error(exc) from None
    if final_by_index is None:
        return JSONResponse({}, status_code=499)
    return JSONResponse(make_full_response(final_by_index))


async def _streaming_response(
        outputs: AsyncIterator[tuple[int, Any]],
        make_events: Callable[[AsyncIterator[tuple[int, Any]]], AsyncIterator[str]],
        sse_done: str | None = SSE_DONE) -> StreamingResponse:
    """An SSE response whose events `make_events` builds from the call's outputs.

    The first output is awaited before the headers go out, so an error the
    engine reports for the request still gets its own status code.
    """
    try:
        first = await outputs.__anext__()
    except StopAsyncIteration:
        first = None
    except Exception as exc:  # noqa: BLE001
        raise to_api_error(exc) from None
    events = _sse_body(make_events(_prepend(first, outputs)), outputs, sse_done)
    return StreamingResponse(events, media_type="text/event-stream")


async def _prepend(first: tuple[int, Any] | None,
                   outputs: AsyncIterator[tuple[int, Any]]) -> AsyncIterator[tuple[int, Any]]:
    if first is not None:
        yield first
    async for item in outputs:
        yield item


async def _sse_body(events: AsyncIterator[str], outputs: AsyncIterator[Any],
                    sse_done: str | None) -> AsyncIterator[str]:
    """`events`, an in-band error event if they raise, then `sse_done` ([DONE]); `outputs`
    closed in any case."""
    try:
        async for event in events:
            yield event
    except Exception as exc:  # noqa: BLE001 - the stream has started: report in-band
        error: APIError = to_api_error(exc)
        yield sse(error.to_dict())
    finally:
        await events.aclose()  # type: ignore[attr-defined]
        await outputs.aclose()  # type: ignore[attr-defined]
    if sse_done:
        yield sse_done


async def _wait_for_disconnect(raw_request: Request) -> None:
    while True:
        message = await raw_request.receive()
        if message.get("type") == "http.disconnect":
            return


@dataclass
class ChoiceStreamState:
    """What one choice has already sent, to compute the next delta."""

    num_chars: int = 0
    num_tokens: int = 0
    finish_sent: bool = False


def next_delta(state: ChoiceStreamState, completion: CompletionOutput) -> tuple[str, int, int, bool]:
    """(new text, first new token index, end token index, finished now) for a choice."""
    text = completion.text or ""
    delta_text = text[state.num_chars:] if len(text) >= state.num_chars else ""
    start, end = state.num_tokens, len(completion.token_ids)
    finished_now = completion.finish_reason is not None and not state.finish_sent
    state.num_chars = max(state.num_chars, len(text))
    state.num_tokens = end
    state.finish_sent = state.finish_sent or finished_now
    return delta_text, start, end, finished_now


def token_logprob_entries(completion: CompletionOutput, start: int, end: int
                          ) -> list[tuple[int, float, list[tuple[int, float, int | None]]]]:
    """`(token_id, logprob, candidates)` for tokens start..end of a choice.

    `candidates` are `(token_id, logprob, rank)`, best first: the top N the
    request asked for plus the sampled token.
    """
    logprobs = completion.logprobs or []
    entries = []
    for position in range(start, min(end, len(logprobs))):
        by_token_id = logprobs[position]
        token_id = completion.token_ids[position]
        sampled = by_token_id.get(token_id)
        candidates = [(tid, lp.logprob, lp.rank) for tid, lp in by_token_id.items()]
        candidates.sort(key=lambda c: -c[1])
        entries.append((token_id, float("nan") if sampled is None else sampled.logprob, candidates))
    return entries


def prompt_logprob_entries(request_output: RequestOutput
                           ) -> list[tuple[int, float | None, list[tuple[int, float, int | None]] | None]]:
    """`token_logprob_entries` of the prompt tokens: the first (and every token when the
    request did not ask for prompt logprobs) has logprob and candidates None."""
    scored = request_output.prompt_logprobs or []
    entries = []
    for position, token_id in enumerate(request_output.prompt_token_ids):
        by_token_id = scored[position] if position < len(scored) else None
        if by_token_id is None:
            entries.append((token_id, None, None))
            continue
        candidates = sorted(((tid, lp.logprob, lp.rank) for tid, lp in by_token_id.items()), key=lambda c: -c[1])
        own = by_token_id.get(token_id)
        entries.append((token_id, float("nan") if own is None else own.logprob, candidates))
    return entries


def token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)
