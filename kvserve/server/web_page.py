"""`GET /`: the built-in page (chat playground + live KV-cache view).

Its three files ship in the package (`server/static`) and are read once; the
page fetches nothing from the internet. The page itself is public; the data
it shows comes from /v1 and /kv-cache, which require the API key when one is
set (the page asks for it and sends it).
"""
from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, Response

from kvserve.server.errors import APIError

_ASSET_TYPES = {"app.js": "text/javascript; charset=utf-8", "style.css": "text/css; charset=utf-8"}


def _read_static(name: str) -> str:
    return resources.files("kvserve.server").joinpath("static", name).read_text(encoding="utf-8")


def add_page_routes(app: FastAPI) -> None:
    """Register `/` and its assets under `/ui/`."""
    index_html = _read_static("index.html")
    assets = {name: _read_static(name) for name in _ASSET_TYPES}

    @app.get("/", response_class=HTMLResponse)
    async def index() -> HTMLResponse:
        return HTMLResponse(index_html)

    @app.get("/ui/{name}")
    async def asset(name: str) -> Response:
        if name not in assets:
            raise APIError(404, f"no such file: /ui/{name}", code="not_found")
        return Response(assets[name], media_type=_ASSET_TYPES[name], headers={"Cache-Control": "no-cache"})
