"""A real browser (Debian's chromium driven by Playwright) opens the built chapter pages."""
import functools
import http.server
import threading

import pytest

from conftest import BOOK_MARKS, CHROMIUM, NEEDS_CHROMIUM
from flashbook import notebooks, sources

pytestmark = BOOK_MARKS + [NEEDS_CHROMIUM]


@pytest.fixture(scope="module")
def site(built_book):
    handler = functools.partial(http.server.SimpleHTTPRequestHandler,
                                directory=str(built_book.parent))
    handler.log_message = lambda *a, **k: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run"])
        yield b
        b.close()


@pytest.mark.parametrize("ch", sources.sources(), ids=[c.id for c in sources.sources()])
def test_chapter_page_in_a_real_browser(site, browser, ch):
    page = browser.new_page()
    problems = []
    page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}")
            if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url}"))
    # no request may leave this machine: the book must read offline
    page.route("**/*", lambda route: route.continue_() if route.request.url.startswith(site)
               else (problems.append(f"external request: {route.request.url}"), route.abort()))
    page.goto(f"{site}/notebooks/{ch.name}.html", wait_until="networkidle")
    # MathJax typesets asynchronously: wait for its containers
    page.wait_for_function("document.querySelectorAll('mjx-container').length > 5", timeout=30000)
    assert page.locator("mjx-container").count() > 5
    assert page.locator("span.math, div.math").count() == 0 or \
        page.evaluate("() => !document.body.innerText.includes('\\\\frac')")
    # every figure loaded (naturalWidth > 0)
    images = page.evaluate("() => Array.from(document.images).map(i => [i.src, i.naturalWidth])")
    assert images and all(w > 0 for _, w in images), f"broken images: {[s for s, w in images if not w]}"
    # the Colab badge opens this chapter's student notebook
    hrefs = page.evaluate("() => Array.from(document.querySelectorAll('a')).map(a => a.href)")
    assert notebooks.colab_url(ch, sources.repo_root()) in hrefs
    assert not problems, "\n".join(problems)
    page.close()


@pytest.mark.parametrize("ch", sources.sources(), ids=[c.id for c in sources.sources()])
def test_reader_sees_the_chapter_title_above_the_colab_cells(site, browser, ch):
    page = browser.new_page()
    page.goto(f"{site}/notebooks/{ch.name}.html", wait_until="load")
    title = page.locator("article h1").first.bounding_box()
    badge = page.locator('article img[src*="open-in-colab"]').first.bounding_box()
    setup = page.locator("article div.cell", has_text="Setup: on Colab").first.bounding_box()
    assert title["y"] < badge["y"] and title["y"] < setup["y"], f"{ch.id}: title below the Colab cells"
    page.close()
