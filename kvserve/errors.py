"""The exceptions kvserve raises across layers, in one torch-free module.

A request the engine can never serve raises an `InvalidRequestError` (a
`ValueError`) before it is queued; the server maps each class onto its HTTP
status in `kvserve/server/errors.py`.
"""
from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is invalid; the message names it."""


class InvalidRequestError(ValueError):
    """A request the engine can never serve; `param` names the offending field."""

    code = "invalid_value"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus the tokens asked for) does not fit the context or the KV cache."""

    code = "context_length_exceeded"


class SamplingParamsError(InvalidRequestError):
    """A sampling parameter is out of range; the message starts with the field's name."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message, param or message.split(" ", 1)[0])


class EngineDeadError(RuntimeError):
    """The engine cannot run any more steps (a dead executor, a stuck scheduler, shutdown)."""


class EngineOverloadedError(RuntimeError):
    """Too many requests in flight; retry after `retry_after_s` seconds."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
