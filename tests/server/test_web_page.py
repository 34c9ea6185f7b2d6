"""The page at `/` in a real headless Chromium (Debian's `chromium`, driven by Playwright).

It loads `/`, asks for the API key, sends a chat through the page, streams
the answer token by token, and its KV numbers change and agree with `/kv-cache`.
`scripts/setup.sh --test` installs chromium and playwright: this test fails, never
skips, when they are missing. KVSERVE_PAGE_SCREENSHOT=path saves a screenshot.
"""
from __future__ import annotations

import os
import shutil
import time

import httpx
import pytest
from helpers.scheduler_engine import make_scheduler_async_llm

from kvserve.server.app import build_app
from server.conftest import ThreadedServer

MODEL = "fake-model"
API_KEY = "page-key"


def chromium_path() -> str:
    path = os.environ.get("KVSERVE_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    assert path, "chromium is not installed: run `bash scripts/setup.sh --test` (apt-get install chromium)"
    return path


@pytest.fixture
def page_server(tokenizer):
    engine = make_scheduler_async_llm(tokenizer, num_blocks=96, step_delay_s=0.03, max_num_seqs=8)
    app = build_app(engine, MODEL, api_key=API_KEY)
    with ThreadedServer(app) as server:
        yield server


@pytest.fixture
def hybrid_page_server(tokenizer):
    """A server over full-attention and recurrent-state KV groups."""
    from kvserve.kv_cache.interface import FullAttentionSpec, StateSpec
    specs = {"layer.0": FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype="float32"),
             "layer.1": StateSpec(block_size=16, shapes=((3, 8), (8,)), dtype="float32")}
    engine = make_scheduler_async_llm(tokenizer, num_blocks=96, step_delay_s=0.01, max_num_seqs=8, specs=specs)
    with ThreadedServer(build_app(engine, MODEL, api_key=API_KEY)) as server:
        yield server


@pytest.fixture
def page(request):
    # The server starts before the browser (the hybrid test brings its own).
    request.getfixturevalue("hybrid_page_server" if "hybrid" in request.node.name else "page_server")
    from playwright.sync_api import sync_playwright
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_path(), headless=True,
                                             args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            yield page
            assert not errors, errors
        finally:
            browser.close()


def kv_json(server) -> dict:
    return httpx.get(server.base_url + "/kv-cache", headers={"Authorization": f"Bearer {API_KEY}"},
                     timeout=10).json()


def wait_until(condition, timeout_s: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.03)


def group_title(page) -> str:
    return page.locator("#groups .group .title").first.inner_text()


def test_page_chats_streams_and_shows_the_kv_cache(page_server, page):
    server = page_server
    page.goto(server.base_url + "/")
    page.wait_for_function("document.getElementById('view-status').textContent.includes('API key')")
    page.fill("#api-key", API_KEY)
    page.dispatch_event("#api-key", "change")
    page.wait_for_function("document.getElementById('model-name').textContent === 'fake-model'")
    page.wait_for_selector("#groups .group")
    before = kv_json(server)
    assert f"cached {before['blocks_cached']} " in group_title(page)

    page.fill("#temperature", "0")
    page.fill("#max-tokens", "48")
    page.fill("#user-input", "Tell me about paged attention, please.")
    page.press("#user-input", "Enter")
    answer = page.locator(".msg.assistant").last
    lengths = []
    while answer.get_attribute("data-done") != "true":
        lengths.append(len(answer.locator(".text").inner_text()))
        time.sleep(0.02)
    growing = sorted(set(n for n in lengths if n > 0))
    assert len(growing) >= 3, f"the answer did not stream: text lengths seen {lengths}"
    assert answer.get_attribute("data-completion-tokens") == "48"
    meta = answer.locator(".meta").inner_text()
    assert "TTFT" in meta and "tok/s" in meta and "prompt tokens cached" in meta

    # Idle again: the page's numbers change and agree with /kv-cache.
    wait_until(lambda: kv_json(server)["blocks_in_use"] == 0, what="an idle pool")
    after = kv_json(server)
    assert after["blocks_cached"] > before["blocks_cached"]
    assert after["prefix_cache"]["queries"] > before["prefix_cache"]["queries"]
    expected = (f"in use 0 · cached {after['blocks_cached']} · free {after['blocks_free']} "
                f"of {after['num_blocks']} blocks")
    wait_until(lambda: expected in group_title(page), what=f"the page to show {expected!r}")
    queries = after["prefix_cache"]["queries"]
    wait_until(lambda: f"/ {queries})" in page.inner_text("#hit-rate"), what="the hit rate")
    assert page.locator("#eviction-head span").count() == len(after["eviction_queue_head"])
    assert "tokens" in page.inner_text("#step-summary")

    # A second turn repeats the conversation prefix: the page reports cached prompt tokens.
    page.fill("#user-input", "And why does it help?")
    page.press("#user-input", "Enter")
    second = page.locator(".msg.assistant").nth(1)
    wait_until(lambda: second.get_attribute("data-done") == "true", what="the second answer")
    assert int(second.get_attribute("data-cached-tokens")) > 0
    screenshot = os.environ.get("KVSERVE_PAGE_SCREENSHOT")
    if screenshot:
        page.screenshot(path=screenshot, full_page=True)


def test_page_shows_a_hybrid_models_state_group_with_its_own_kind(hybrid_page_server, page):
    page.goto(hybrid_page_server.base_url + "/")
    page.wait_for_function("document.getElementById('view-status').textContent.includes('API key')")
    page.fill("#api-key", API_KEY)
    page.dispatch_event("#api-key", "change")
    page.wait_for_selector("#groups .group >> nth=1")
    titles = page.locator("#groups .group .title")
    assert titles.nth(0).get_attribute("data-kind") == "full"
    assert titles.nth(1).get_attribute("data-kind") == "state"
    assert "group 1: state, recurrent state, snapshot every 16 tokens, 1 layers" in titles.nth(1).inner_text()


def test_page_is_public_but_data_needs_the_key(page_server):
    base = page_server.base_url
    index = httpx.get(base + "/")
    assert index.status_code == 200 and "kvserve" in index.text
    assert "http://" not in index.text and "https://" not in index.text
    for asset in ("/ui/app.js", "/ui/style.css"):
        response = httpx.get(base + asset)
        assert response.status_code == 200
        assert "https://" not in response.text and "http://" not in response.text
    assert httpx.get(base + "/ui/nope.js").status_code == 404
    assert httpx.get(base + "/kv-cache").status_code == 401
