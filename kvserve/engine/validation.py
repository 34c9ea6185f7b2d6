"""The one check of a request before it is queued, shared by LLM, AsyncLLM, the server and EngineCore.

The rule for the context: a prompt must leave room for at least one output
token (`len(prompt) < max_model_len`) and fit the KV-cache pool on its own.
Front-ends that know `max_tokens` up front (the OpenAI server) also require
`len(prompt) + max_tokens <= max_model_len`.

Output constraints (JSON schema, regex, choice, grammar) are compiled before a
request is queued, so a bad one is the caller's error and never reaches a step:
`check_constraints` (blocking: `LLM`) and `check_constraint_async` (on the
grammar pool, without blocking the event loop: `AsyncLLM.generate`, the
server). `EngineCore.add_request` does not compile (seconds in the engine
loop); a constraint that slips past every front-end fails only its request, in
the runner.
"""
from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvserve.errors import InvalidRequestError, PromptTooLongError, SamplingParamsError
from kvserve.model.tokenizer_files import load_tokenizer
from kvserve.sample.structured import grammar
from kvserve.sampling_params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from kvserve.model.config import ModelConfig


@dataclass(frozen=True)
class RequestValidator:
    """Checks prompts and sampling parameters against one engine's model and KV pool."""

    max_model_len: int
    vocab_size: int
    # Tokens one request's blocks can hold in the pool (None: not limited by the pool).
    max_tokens_in_pool: int | None = None
    # The model whose vocabulary constraints compile for (None, model-free test engines:
    # constraints are not compiled up front).
    model_config: "ModelConfig | None" = None

    def check_token_ids(self, token_ids: Any, param: str = "prompt") -> list[int]:
        """The ids as a list of ints; raises InvalidRequestError unless each is in [0, vocab_size)."""
        if isinstance(token_ids, (str, bytes)):
            raise InvalidRequestError("token ids must be a sequence of integers", param)
        token_ids = token_ids.tolist() if hasattr(token_ids, "tolist") else list(token_ids)
        if not token_ids:
            raise InvalidRequestError("the prompt is empty", param)
        for token_id in token_ids:
            if not isinstance(token_id, int) or isinstance(token_id, bool):
                raise InvalidRequestError(f"token ids must be integers, got {token_id!r}", param)
            if not 0 <= token_id < self.vocab_size:
                raise InvalidRequestError(f"token id {token_id} is out of range [0, {self.vocab_size})", param)
        return token_ids

    def check_prompt_fits(self, num_prompt_tokens: int, max_tokens: int | None = None) -> None:
        """Raise PromptTooLongError, with the numbers, unless the prompt (and `max_tokens`) fit."""
        if num_prompt_tokens == 0:
            raise PromptTooLongError("the prompt is empty", "prompt")
        if num_prompt_tokens >= self.max_model_len:
            raise PromptTooLongError(
                f"This model's maximum context length is {self.max_model_len} tokens, "
                f"but the prompt has {num_prompt_tokens} tokens (at least one token must "
                "be left for the completion)", "prompt")
        if max_tokens is not None and num_prompt_tokens + max_tokens > self.max_model_len:
            raise PromptTooLongError(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, you requested {num_prompt_tokens + max_tokens} tokens "
                f"({num_prompt_tokens} in the prompt, {max_tokens} for the completion). "
                "Please reduce the length of the prompt or of max_tokens", "max_tokens")
        if self.max_tokens_in_pool is not None and num_prompt_tokens > self.max_tokens_in_pool:
            raise PromptTooLongError(
                f"the prompt has {num_prompt_tokens} tokens, but the KV cache holds at most "
                f"{self.max_tokens_in_pool} tokens for one request (raise --kv-cache-memory)", "prompt")

    def check_sampling_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: token ids against the vocabulary."""
        for token_id in params.stop_token_ids:
            if not isinstance(token_id, int) or not 0 <= token_id < self.vocab_size:
                raise SamplingParamsError(
                    f"stop_token_ids holds {token_id!r}, outside the vocabulary [0, {self.vocab_size})")
        for token_id in params.logit_bias or ():
            if token_id >= self.vocab_size:
                raise SamplingParamsError(
                    f"logit_bias names token {token_id}, outside the vocabulary [0, {self.vocab_size})")

    def validate(self, prompt_token_ids: Any, params: SamplingParams,
                 max_tokens_must_fit: bool = False) -> list[int]:
        """Every check of one request; returns the prompt ids as a list of ints."""
        token_ids = self.check_token_ids(prompt_token_ids)
        self.check_prompt_fits(len(token_ids), params.max_tokens if max_tokens_must_fit else None)
        self.check_sampling_params(params)
        return token_ids

    def check_constraints(self, params_list: Sequence[SamplingParams], timeout_s: float | None = None) -> None:
        """Compile every distinct output constraint of `params_list`, waiting at most `timeout_s`
        each (default $KVSERVE_GRAMMAR_COMPILE_TIMEOUT_S); raises StructuredOutputError."""
        constraints = {id(p.structured_outputs): p.structured_outputs for p in params_list
                       if p.structured_outputs is not None}
        if not constraints or self.model_config is None:
            return
        compiler = grammar.compiler_for_model(self.model_config, load_tokenizer)
        for constraint in constraints.values():
            compiler.check(constraint, timeout_s)

    async def check_constraint_async(self, constraint: StructuredOutputsParams | None,
                                     timeout_s: float | None = None) -> None:
        """`check_constraints` for one constraint, compiled on the grammar thread pool while the
        event loop keeps running; raises StructuredOutputError (a compile past the timeout too)."""
        if constraint is None or self.model_config is None:
            return
        compiler = await asyncio.to_thread(grammar.compiler_for_model, self.model_config, load_tokenizer)
        timeout_s = grammar.compile_timeout_s() if timeout_s is None else timeout_s
        try:
            await asyncio.wait_for(asyncio.wrap_future(compiler.compile_async(constraint)), timeout_s)
        except asyncio.TimeoutError:
            raise grammar.StructuredOutputError(
                constraint.kind, f"the grammar did not compile within {timeout_s:g} s") from None
