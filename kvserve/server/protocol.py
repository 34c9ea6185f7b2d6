"""OpenAI-compatible request models (pydantic), validated strictly.

Requests are parsed from the raw JSON body in pydantic's strict JSON mode, so
`"max_tokens": "16"` is a type error rather than a silent coercion. Fields the
OpenAI API defines but kvserve does not implement are accepted only at their
"off" value; anything else is rejected with a message naming the feature.
Unknown extra fields are ignored, as the OpenAI API does.
"""
from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from kvserve.sampling_params import SamplingParams, StructuredOutputsParams

# Each choice is its own engine request: cap the fan-out one call can cause.
MAX_N = 64


class UnsupportedFeatureError(ValueError):
    """The request asks for an OpenAI feature kvserve does not implement."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class _StrictModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


# The base of every API's request models (Responses and Messages too).
StrictModel = _StrictModel


class StreamOptions(_StrictModel):
    """`stream_options`: `include_usage` adds a final chunk with token usage."""

    include_usage: bool = False


class ResponseFormat(_StrictModel):
    """`response_format`: `text`, `json_object`, or `json_schema` with {name, schema, strict}."""

    type: StrictStr
    json_schema: dict[str, Any] | None = None


class _SamplingFields(_StrictModel):
    """Sampling fields shared by /v1/completions and /v1/chat/completions.

    `top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `ignore_eos`,
    `stop_token_ids` and `skip_special_tokens` are extensions (vLLM's names).
    """

    model: StrictStr | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    best_of: int | None = None
    logit_bias: dict[str, float] | None = None
    # Output constraints (kvserve/server/structured.py): OpenAI's field (also on /v1/completions,
    # as vLLM accepts it there), vLLM's field and its older names.
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None

    def _check_common_unsupported(self) -> None:
        if self.best_of is not None and self.best_of != self.n:
            raise UnsupportedFeatureError("best_of", "best_of is not supported by kvserve")
        if self.stream_options is not None and not self.stream:
            raise UnsupportedFeatureError(
                "stream_options", "stream_options is only allowed when stream is true")

    def build_sampling_params(self, max_tokens: int, logprobs: int | None,
                              structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
        """SamplingParams with OpenAI defaults for the fields left unset."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=self.logit_bias,
            structured_outputs=structured_outputs,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


PromptInput = Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]


class CompletionRequest(_SamplingFields):
    """Body of POST /v1/completions."""

    prompt: PromptInput
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: StrictStr | None = None
    # vLLM's extension: each choice gets `prompt_logprobs` ({token id: {logprob, rank,
    # decoded_token}} per prompt token, null for the first).
    prompt_logprobs: int | None = None

    def check_supported(self) -> None:
        self._check_common_unsupported()
        if self.suffix:
            raise UnsupportedFeatureError("suffix", "suffix (insertion) is not supported by kvserve")
        if self.prompt_logprobs is not None and self.stream:
            raise UnsupportedFeatureError("prompt_logprobs", "prompt_logprobs is not supported when streaming")

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of single prompts (text or token ids)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            return []
        if isinstance(prompt[0], list):
            return [list(p) for p in prompt]
        if isinstance(prompt[0], int):
            return [list(prompt)]
        return list(prompt)


class TextContentPart(_StrictModel):
    """One `{"type": "text", "text": ...}` part of a message's content."""

    type: Literal["text"]
    text: StrictStr


class ChatMessage(_StrictModel):
    """One chat message; content is a string or a list of text parts."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[dict[str, Any]] | None = None
    name: StrictStr | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: StrictStr | None = None
    # An assistant turn's chain of thought, as the server returned it (vLLM's field).
    reasoning_content: StrictStr | None = None

    def text(self) -> str:
        """The content as plain text; non-text parts are unsupported."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for part in self.content:
            if part.get("type") != "text":
                raise UnsupportedFeatureError(
                    "messages", f"content part type {part.get('type')!r} is not supported "
                    "(kvserve serves text-only models)")
            texts.append(TextContentPart.model_validate(part, strict=False).text)
        return "".join(texts)


class ChatCompletionRequest(_SamplingFields):
    """Body of POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    # How long a reasoning model (gpt-oss) thinks: low, medium or high.
    reasoning_effort: StrictStr | None = None

    def check_supported(self) -> None:
        self._check_common_unsupported()
        if self.functions or self.function_call not in (None, "none"):
            raise UnsupportedFeatureError("functions", "the deprecated functions / function_call fields are not "
                                          "supported by kvserve: use tools / tool_choice")
        if self.top_logprobs is not None and not self.logprobs:
            raise UnsupportedFeatureError("top_logprobs", "top_logprobs requires logprobs to be true")

    def requested_max_tokens(self) -> int | None:
        """`max_completion_tokens` wins over the deprecated `max_tokens`."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0

    def conversation(self) -> list[dict[str, str]]:
        """Messages as plain dicts for the chat template."""
        return [{"role": m.role, "content": m.text()} for m in self.messages]
