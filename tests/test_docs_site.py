"""The built docs site, as a reader sees it: headless Chromium renders the home page and a
notebook page; each must show its title and at least one figure.

Needs the site built first (`make docs-build`; `make test` does it before running this
file) and Chromium (Debian/Ubuntu: `apt-get install -y chromium`; `.ci/run` installs it).
Without either, the tests skip and say so. Screenshots land in pytest's tmp directory.
"""

from __future__ import annotations

import base64
import functools
import http.server
import os
import shutil
import subprocess
import threading
from html.parser import HTMLParser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SITE = ROOT / "site"
CHROMIUM = (
    os.environ.get("MINIVLLM_CHROMIUM")
    or shutil.which("chromium")
    or shutil.which("chromium-browser")
    or shutil.which("google-chrome")
)
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--window-size=1280,2200",
    "--virtual-time-budget=5000",
]

pytestmark = [
    pytest.mark.skipif(
        CHROMIUM is None,
        reason="headless Chromium not found: install it (Debian/Ubuntu: apt-get install -y "
        "chromium) or point MINIVLLM_CHROMIUM at a Chrome/Chromium binary",
    ),
    pytest.mark.skipif(
        not (SITE / "index.html").is_file(),
        reason="the docs site is not built: run `make docs-build` first (make test does)",
    ),
]


class _Page(HTMLParser):
    """The bits of a rendered DOM the tests look at: <title>, <h1> text, <img> sources."""

    def __init__(self) -> None:
        super().__init__()
        self.title = ""
        self.h1: list[str] = []
        self.img_srcs: list[str] = []
        self._in: str | None = None

    def handle_starttag(self, tag, attrs):
        if tag in ("title", "h1"):
            self._in = tag
            if tag == "h1":
                self.h1.append("")
        elif tag == "img":
            self.img_srcs.append(dict(attrs).get("src") or "")

    def handle_endtag(self, tag):
        if tag == self._in:
            self._in = None

    def handle_data(self, data):
        if self._in == "title":
            self.title += data
        elif self._in == "h1":
            self.h1[-1] += data


@pytest.fixture(scope="module")
def site_server():
    """Serve site/ on a free loopback port; yields (base_url, list of (path, status))."""
    requests: list[tuple[str, int]] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_request(self, code="-", size="-"):
            requests.append((self.path, int(code)))

    handler = functools.partial(Handler, directory=str(SITE))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", requests
    server.shutdown()
    server.server_close()


def _chromium(url: str, profile: Path, *action: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *action, url],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )


def render(url: str, tmp_path: Path, name: str) -> tuple[_Page, str, Path]:
    """The page's DOM after scripts ran, parsed, and a screenshot of it."""
    dom = _chromium(url, tmp_path / f"profile-{name}-dom", "--dump-dom").stdout
    page = _Page()
    page.feed(dom)
    screenshot = tmp_path / f"{name}.png"
    _chromium(url, tmp_path / f"profile-{name}-shot", f"--screenshot={screenshot}")
    assert screenshot.is_file() and screenshot.stat().st_size > 10_000, "blank screenshot"
    return page, dom, screenshot


def test_home_page_shows_title_and_figure(site_server, tmp_path):
    base_url, requests = site_server
    page, _, _ = render(base_url + "/", tmp_path, "home")

    assert page.title.startswith("minivllm")
    assert any("minivllm" in h for h in page.h1), page.h1
    figures = [src for src in page.img_srcs if src.endswith(".png")]
    assert figures, f"no figure on the home page: {page.img_srcs}"
    # The browser fetched every figure and the server had it.
    for src in figures:
        path = "/" + src.lstrip("./")
        assert (path, 200) in requests, f"{path} not loaded; requests: {requests}"


def test_notebook_page_shows_title_and_figure(site_server, tmp_path):
    base_url, _ = site_server
    page, dom, _ = render(base_url + "/notebooks/01_paged_kv_cache/", tmp_path, "notebook")

    assert "The paged KV cache" in page.title
    assert any("The paged KV cache" in h for h in page.h1), page.h1
    # mkdocs-jupyter inlines each matplotlib figure as a base64 PNG.
    inline = [src for src in page.img_srcs if src.startswith("data:image/png;base64,")]
    assert inline, "no figure on the notebook page"
    png = base64.b64decode(inline[0].split(",", 1)[1])
    assert png.startswith(b"\x89PNG") and len(png) > 5_000
    assert "Traceback" not in dom, "the executed notebook shows an error"
