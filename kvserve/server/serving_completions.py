"""POST /v1/completions: prompts as text, a list of texts, or token ids."""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from functools import partial
from typing import AsyncIterator

from fastapi import Request

from kvserve.engine.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.server.errors import bad_request
from kvserve.server.protocol import CompletionRequest
from kvserve.server.serving import (ChoiceStreamState, ChunkFormatter, ServingContext,
                                    merged_outputs, new_id, next_delta, parse_request, resolve_max_tokens,
                                    prompt_logprob_entries, respond, run_tokenizer, submit_all, to_api_error,
                                    token_logprob_entries,
                                    token_text, usage_dict)
from kvserve.server.structured import checked_constraint

# Engine requests (prompts x n) one call may cause.
MAX_CHOICES_PER_CALL = 256


@dataclass
class _PreparedPrompt:
    """One prompt of the call, tokenized, with its sampling parameters."""

    text: str | None
    token_ids: list[int]
    sampling_params: SamplingParams


async def _prepare(ctx: ServingContext, body: CompletionRequest) -> list[_PreparedPrompt]:
    engine = ctx.engine
    prompts = body.prompts()
    if not prompts:
        raise bad_request("prompt must not be empty", param="prompt")
    if len(prompts) * body.n > MAX_CHOICES_PER_CALL:
        raise bad_request(f"prompts x n must be at most {MAX_CHOICES_PER_CALL} per call, "
                          f"got {len(prompts)} x {body.n}", param="prompt")
    if body.max_tokens == 0 and not body.echo:
        raise bad_request("max_tokens 0 is allowed only with echo: true (the prompt alone is returned)",
                          param="max_tokens")
    constraint = await checked_constraint(ctx, body)
    prepared = []
    for prompt in prompts:
        if isinstance(prompt, str):
            text, token_ids = prompt, await run_tokenizer(len(prompt), engine.encode, prompt)
        else:
            text, token_ids = None, engine.validator.check_token_ids(prompt, param="prompt")
        if not token_ids:
            raise bad_request("prompt must not be empty", param="prompt")
        # echo with max_tokens 0 (scoring a text, as lm-evaluation-harness does): the
        # engine samples one token, which the response leaves out (`_prompt_only`).
        max_tokens = 1 if _echo_only(body) else resolve_max_tokens(engine, len(token_ids), body.max_tokens)
        params = body.build_sampling_params(max_tokens, body.logprobs, constraint)
        wanted = [k for k in (body.logprobs if body.echo else None, body.prompt_logprobs) if k is not None]
        if wanted:
            params = dataclasses.replace(params, prompt_logprobs=max(wanted))  # validated again
        engine.validator.check_prompt_fits(len(token_ids), max_tokens)
        engine.validator.check_sampling_params(params)
        prepared.append(_PreparedPrompt(text, token_ids, params))
    return prepared


async def create_completion(raw_request: Request, ctx: ServingContext):
    """Handle one /v1/completions call (streaming or not)."""
    body = await parse_request(raw_request, ctx, CompletionRequest)
    try:
        prepared = await _prepare(ctx, body)
    except Exception as exc:  # noqa: BLE001
        raise to_api_error(exc) from None
    response_id = new_id("cmpl")
    handles = submit_all(ctx, [(p.token_ids, p.sampling_params) for p in prepared], response_id)
    outputs = merged_outputs(ctx, handles)
    if _echo_only(body):
        outputs = _prompt_only(outputs)
    return await respond(raw_request, outputs, body.stream,
                         partial(_stream_events, ctx, body, prepared, response_id),
                         partial(_full_response, ctx, body, prepared, response_id))


def _echo_only(body: CompletionRequest) -> bool:
    return body.echo and body.max_tokens == 0


async def _prompt_only(outputs: AsyncIterator[tuple[int, RequestOutput]]
                       ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The outputs without their generated token: each choice ends ("length") with none."""
    try:
        async for index, output in outputs:
            completions = [dataclasses.replace(
                completion, text="", token_ids=[], new_text="", new_token_ids=[],
                logprobs=None if completion.logprobs is None else [],
                cumulative_logprob=None if completion.cumulative_logprob is None else 0.0,
                finish_reason="length" if completion.finished else None, stop_reason=None)
                for completion in output.outputs]
            yield index, dataclasses.replace(output, outputs=completions)
    finally:
        await outputs.aclose()


def _full_response(ctx: ServingContext, body: CompletionRequest, prepared: list[_PreparedPrompt],
                   response_id: str, final_by_index: dict[int, RequestOutput]) -> dict:
    choices = []
    for prompt_index, prompt in enumerate(prepared):
        request_output = final_by_index[prompt_index]
        for completion in request_output.outputs:
            text = completion.text
            logprobs = None
            if body.logprobs is not None:
                logprobs = _legacy_logprobs(ctx, completion, 0, len(completion.token_ids),
                                            request_output if body.echo else None)
            if body.echo:
                text = _prompt_text(ctx, prompt) + text
            choice = {"index": prompt_index * body.n + completion.index, "text": text,
                      "logprobs": logprobs, "finish_reason": completion.finish_reason,
                      "stop_reason": completion.stop_reason}
            if body.prompt_logprobs is not None:
                choice["prompt_logprobs"] = _vllm_prompt_logprobs(request_output, body.prompt_logprobs)
            choices.append(choice)
    choices.sort(key=lambda c: c["index"])
    return {"id": response_id, "object": "text_completion", "created": int(time.time()),
            "model": ctx.served_model_name, "choices": choices,
            "usage": usage_dict([final_by_index[i] for i in range(len(prepared))])}


def _vllm_prompt_logprobs(request_output: RequestOutput, num_top: int) -> list[dict | None]:
    """vLLM's `prompt_logprobs` of a choice: per prompt token, null or {token id: {logprob,
    rank, decoded_token}} holding the prompt token and the top `num_top`."""
    positions = []
    for token_id, by_token_id in zip(request_output.prompt_token_ids, request_output.prompt_logprobs or []):
        if by_token_id is None:
            positions.append(None)
            continue
        positions.append({str(tid): {"logprob": _finite(lp.logprob), "rank": lp.rank,
                                     "decoded_token": lp.decoded_token}
                          for tid, lp in by_token_id.items() if tid == token_id or (lp.rank or 0) <= num_top})
    return positions


def _prompt_text(ctx: ServingContext, prompt: _PreparedPrompt) -> str:
    if prompt.text is not None:
        return prompt.text
    return ctx.engine.tokenizer.decode(prompt.token_ids, skip_special_tokens=False)


def _finite(value: float | None) -> float | None:
    if value is None or math.isnan(value):
        return None
    return value if math.isfinite(value) else -9999.0


def _legacy_logprobs(ctx: ServingContext, completion: CompletionOutput, start: int, end: int,
                     echoed: RequestOutput | None, text_offset: int = 0) -> dict:
    """The completions API's logprobs object; with `echoed`, its prompt tokens first (the
    first one's logprob null, as OpenAI and vLLM return it)."""
    tokenizer = ctx.engine.tokenizer
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    entries = prompt_logprob_entries(echoed) if echoed is not None else []
    entries += token_logprob_entries(completion, start, end)
    for token_id, logprob, top in entries:
        token = token_text(tokenizer, token_id)
        offsets.append(text_offset)
        text_offset += len(token)
        tokens.append(token)
        token_logprobs.append(_finite(logprob))
        if top is None:
            top_logprobs.append(None)
            continue
        top_dict = {}
        for top_id, top_logprob, _ in top:
            top_dict.setdefault(token_text(tokenizer, top_id), _finite(top_logprob))
        top_logprobs.append(top_dict)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


async def _stream_events(ctx: ServingContext, body: CompletionRequest,
                         prepared: list[_PreparedPrompt], response_id: str,
                         outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[str]:
    chunk = ChunkFormatter(response_id, "text_completion", ctx.served_model_name, body.include_usage)
    states: dict[int, ChoiceStreamState] = {}
    final_by_index: dict[int, RequestOutput] = {}
    async for prompt_index, request_output in outputs:
        final_by_index[prompt_index] = request_output
        choices = _delta_choices(ctx, body, prepared[prompt_index], prompt_index, request_output, states)
        if choices:
            yield chunk(choices)
    if body.include_usage:
        yield chunk([], usage_dict(list(final_by_index.values())))


def _delta_choices(ctx: ServingContext, body: CompletionRequest, prompt: _PreparedPrompt,
                   prompt_index: int, request_output: RequestOutput,
                   states: dict[int, ChoiceStreamState]) -> list[dict]:
    choices = []
    for completion in request_output.outputs:
        choice_index = prompt_index * body.n + completion.index
        first_chunk = choice_index not in states
        state = states.setdefault(choice_index, ChoiceStreamState())
        chars_sent = state.num_chars
        text, start, end, finished_now = next_delta(state, completion)
        echo = body.echo and first_chunk
        if not text and start == end and not finished_now and not echo:
            continue
        logprobs = None
        if body.logprobs is not None:
            # Offsets count from the start of the choice's whole text (echoed prompt included).
            offset = 0 if echo else chars_sent + (len(_prompt_text(ctx, prompt)) if body.echo else 0)
            logprobs = _legacy_logprobs(ctx, completion, start, end, request_output if echo else None, offset)
        if echo:
            text = _prompt_text(ctx, prompt) + text
        choices.append({"index": choice_index, "text": text, "logprobs": logprobs,
                        "finish_reason": completion.finish_reason if finished_now else None,
                        "stop_reason": completion.stop_reason if finished_now else None})
    return choices
