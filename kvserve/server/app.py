"""The FastAPI app: OpenAI-compatible routes over one AsyncLLM.

Authentication and the body-size limit are plain ASGI middleware so they run
before any route parses anything, and leave streaming responses untouched.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

import kvserve
from kvserve.engine.async_llm import AsyncLLM
from kvserve.errors import EngineDeadError
from kvserve.server.errors import APIError, error_response, install_error_handlers
from kvserve.server.gateway import add_gateway_routes
from kvserve.server.kv_cache_routes import add_kv_cache_routes, optional_kv_view
from kvserve.server.metrics import ServerMetrics
from kvserve.server.serving import ServingContext
from kvserve.server.serving_chat import create_chat_completion
from kvserve.server.serving_completions import create_completion
from kvserve.server.serving_messages import add_messages_routes
from kvserve.server.serving_responses import ResponsesHandler
from kvserve.server.serving_tokenize import add_tokenize_routes
from kvserve.server.web_page import add_page_routes

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024


# Routes that need the API key when one is set; `/`, /health, /metrics stay open.
_PROTECTED_PATH_PREFIXES = ("/v1", "/kv-cache")


class _ApiKeyMiddleware:
    """Requires the API key on every /v1 and /kv-cache route: `Authorization: Bearer <key>`
    (OpenAI's header) or `x-api-key: <key>` (Anthropic's)."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self._bearer = f"Bearer {api_key}".encode()
        self._key = api_key.encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith(_PROTECTED_PATH_PREFIXES):
            headers = dict(scope.get("headers") or [])
            bearer = headers.get(b"authorization", b"")
            key = headers.get(b"x-api-key", b"")
            if not (hmac.compare_digest(bearer, self._bearer) or hmac.compare_digest(key, self._key)):
                message = "missing API key" if not (bearer or key) else "invalid API key"
                response = error_response(scope["path"], APIError(401, message, code="invalid_api_key"))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _BodyLimitMiddleware:
    """Answers 413 for bodies over the limit, declared or streamed."""

    def __init__(self, app: Any, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await error_response(scope["path"], self._too_large())(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise self._too_large()
            return message

        await self.app(scope, limited_receive, send)

    def _too_large(self) -> APIError:
        return APIError(413, f"request body is larger than {self.max_body_bytes} bytes",
                        code="request_too_large")


def build_app(engine: AsyncLLM, served_model_name: str, *, api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, model_root: str | None = None,
              shutdown_engine: bool = True, tool_call_parser: str | None = None) -> FastAPI:
    """An app serving `engine` (an AsyncLLM) under `served_model_name`."""
    metrics = ServerMetrics(engine.get_stats, served_model_name)
    ctx = ServingContext(engine=engine, served_model_name=served_model_name, metrics=metrics,
                         tool_call_parser=tool_call_parser)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        if shutdown_engine:
            await asyncio.to_thread(engine.shutdown)
            logger.info("engine stopped; server shut down cleanly")

    app = FastAPI(title="kvserve", version=kvserve.__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ctx = ctx
    install_error_handlers(app)
    _add_routes(app, ctx, model_root)
    add_kv_cache_routes(app, engine)
    add_page_routes(app)
    add_gateway_routes(app, engine, served_model_name)
    add_tokenize_routes(app, ctx)
    app.add_middleware(_BodyLimitMiddleware, max_body_bytes=max_body_bytes)
    if api_key:
        app.add_middleware(_ApiKeyMiddleware, api_key=api_key)
    return app


def add_responses_routes(app: FastAPI, handler: ResponsesHandler) -> None:
    """POST /v1/responses, GET / DELETE /v1/responses/{id}, POST /v1/responses/{id}/cancel."""
    app.post("/v1/responses")(handler.create)
    app.get("/v1/responses/{response_id}")(handler.retrieve)
    app.delete("/v1/responses/{response_id}")(handler.delete)
    app.post("/v1/responses/{response_id}/cancel")(handler.cancel)


def _add_routes(app: FastAPI, ctx: ServingContext, model_root: str | None) -> None:
    @app.get("/health")
    async def health() -> Response:
        try:
            ctx.engine.check_health()
        except EngineDeadError as exc:
            return APIError(503, str(exc), code="engine_unavailable").to_response()
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": kvserve.__version__})

    @app.get("/metrics")
    async def metrics() -> Response:
        kv_view = await optional_kv_view(ctx.engine)
        return Response(ctx.metrics.render(kv_view), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        card = {"id": ctx.served_model_name, "object": "model", "created": ctx.created_s,
                "owned_by": "kvserve", "root": model_root or ctx.served_model_name,
                "max_model_len": ctx.engine.max_model_len}
        return JSONResponse({"object": "list", "data": [card]})

    @app.post("/v1/completions")
    async def completions(raw_request: Request):
        return await create_completion(raw_request, ctx)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw_request: Request):
        return await create_chat_completion(raw_request, ctx)

    add_responses_routes(app, ResponsesHandler(ctx))
    add_messages_routes(app, ctx)
