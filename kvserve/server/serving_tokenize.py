"""POST /tokenize and /detokenize in vLLM's shapes.

/tokenize takes `{"prompt": str, "add_special_tokens": true}` or a chat
`{"messages": [...], "add_generation_prompt": true}` and answers
`{"count", "max_model_len", "tokens", "token_strs"}` (token strings only when
`return_token_strs` is true); /detokenize takes `{"tokens": [...]}` and
answers `{"prompt": text}`.
"""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import Field, StrictInt, StrictStr

from kvserve.server.chat_request import speaks_harmony
from kvserve.server.errors import bad_request, to_api_error
from kvserve.server.harmony import render_harmony
from kvserve.server.protocol import ChatMessage, _StrictModel
from kvserve.server.serving import ServingContext, parse_request, run_tokenizer


class TokenizeRequest(_StrictModel):
    """Body of POST /tokenize: a prompt or chat messages."""

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    def check_supported(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise bad_request("give exactly one of 'prompt' and 'messages'", param="prompt")


class DetokenizeRequest(_StrictModel):
    """Body of POST /detokenize."""

    model: StrictStr | None = None
    tokens: list[StrictInt] = Field(min_length=0)

    def check_supported(self) -> None:
        return None


async def _token_ids(ctx: ServingContext, body: TokenizeRequest) -> list[int]:
    tokenizer = ctx.engine.tokenizer
    if body.prompt is not None:
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        return list(await run_tokenizer(len(body.prompt), tokenizer.encode, body.prompt,
                                        add_special_tokens=add_special))
    from kvserve.engine.tokenizer import render_chat_template
    if speaks_harmony(ctx):
        text = render_harmony(body.messages, None, None, body.add_generation_prompt)
    else:
        conversation = [{"role": m.role, "content": m.text()} for m in body.messages]
        text = render_chat_template(tokenizer, conversation, body.add_generation_prompt)
    return list(tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens)))


def add_tokenize_routes(app: FastAPI, ctx: ServingContext) -> None:
    """Register /tokenize and /detokenize on `app`."""

    @app.post("/tokenize")
    async def tokenize(raw_request: Request) -> JSONResponse:
        body = await parse_request(raw_request, ctx, TokenizeRequest)
        try:
            token_ids = await _token_ids(ctx, body)
        except Exception as exc:  # noqa: BLE001
            raise to_api_error(exc) from None
        token_strs = ctx.engine.tokenizer.convert_ids_to_tokens(token_ids) if body.return_token_strs else None
        return JSONResponse({"count": len(token_ids), "max_model_len": ctx.engine.max_model_len,
                             "tokens": token_ids, "token_strs": token_strs})

    @app.post("/detokenize")
    async def detokenize(raw_request: Request) -> JSONResponse:
        body = await parse_request(raw_request, ctx, DetokenizeRequest)
        try:
            token_ids = ctx.engine.validator.check_token_ids(body.tokens, param="tokens") if body.tokens else []
        except Exception as exc:  # noqa: BLE001
            raise to_api_error(exc) from None
        return JSONResponse({"prompt": ctx.engine.tokenizer.decode(token_ids)})
