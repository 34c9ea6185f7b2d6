"""Errors in the OpenAI shape: `{"error": {"message", "type", "param", "code"}}`, and under
/v1/messages in Anthropic's: `{"type": "error", "error": {"type", "message"}}`.

Every failure the server reports goes through `APIError` so clients (the
official `openai` and `anthropic` packages included) see the status and shape they expect.
"""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError
from kvserve.server.protocol import UnsupportedFeatureError

logger = logging.getLogger(__name__)

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error the server answers with; `status` is the HTTP status."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, error_type: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type or _TYPE_BY_STATUS.get(status, "invalid_request_error")
        self.headers = headers

    def to_dict(self) -> dict:
        return {"error": {"message": self.message, "type": self.error_type,
                          "param": self.param, "code": self.code}}

    def to_response(self) -> JSONResponse:
        return JSONResponse(self.to_dict(), status_code=self.status, headers=self.headers)


# Routes answered in Anthropic's error shape.
ANTHROPIC_PATH_PREFIX = "/v1/messages"
_ANTHROPIC_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    499: "invalid_request_error",
    500: "api_error",
    529: "overloaded_error",
}


def anthropic_error(error: APIError) -> tuple[int, dict]:
    """(status, body) of `error` as Anthropic answers it; "busy" (503) is Anthropic's 529 overloaded."""
    status = 529 if error.status == 503 else error.status
    kind = _ANTHROPIC_TYPE_BY_STATUS.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return status, {"type": "error", "error": {"type": kind, "message": error.message}}


def error_response(path: str, error: APIError) -> JSONResponse:
    """`error` in the shape of the API that `path` belongs to."""
    if not path.startswith(ANTHROPIC_PATH_PREFIX):
        return error.to_response()
    status, body = anthropic_error(error)
    return JSONResponse(body, status_code=status, headers=error.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_validation_error(exc: ValidationError | RequestValidationError) -> APIError:
    """One 400 naming the first offending field (invalid JSON included)."""
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request body")
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return bad_request(f"request body is not valid JSON: {first.get('msg')}", code="invalid_json")
    where = f"{param}: " if param else ""
    extra = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return bad_request(f"{where}{first.get('msg')}{extra}", param=param, code="invalid_value")


def from_unsupported(exc: UnsupportedFeatureError) -> APIError:
    return bad_request(str(exc), param=exc.param, code="unsupported_feature")


def to_api_error(exc: BaseException) -> APIError:
    """Map an exception raised while handling a request onto the status a client should see."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, UnsupportedFeatureError):
        return from_unsupported(exc)
    if isinstance(exc, EngineOverloadedError):
        return APIError(503, str(exc), code="server_busy", headers={"Retry-After": str(exc.retry_after_s)})
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), code="engine_unavailable")
    if isinstance(exc, InvalidRequestError):
        return bad_request(str(exc), param=exc.param, code=exc.code)
    if isinstance(exc, ValueError):
        return bad_request(str(exc), code="invalid_value")
    logger.error("request failed: %s: %s", type(exc).__name__, exc)
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}")


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception the app can raise to an OpenAI-shaped response."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(request.url.path, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(request.url.path, from_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(request.url.path, APIError(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error while serving a request")
        return error_response(request.url.path, APIError(500, f"internal error: {type(exc).__name__}"))
