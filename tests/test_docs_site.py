"""The built docs site, as a reader sees it: headless Chromium renders the home page and a
notebook page; each must show its title and at least one figure. The Chinese site (/zh/)
must render its text in a CJK font, its language switcher must lead to the same page in the
other language, and its measured tables must hold the English page's numbers, in order.

Needs the site built first (`make docs-build`; `make test` does it before running this
file) and Chromium (Debian/Ubuntu: `apt-get install -y chromium`; `.ci/run` installs it).
Without either, the tests skip and say so. The Chinese pages need a CJK font
(Debian/Ubuntu: `apt-get install -y fonts-noto-cjk`; `.ci/run` installs it): without one
Chromium draws empty boxes, so the CJK test skips and says so, except under CI (``CI=true``),
where a missing font fails it. Screenshots land in pytest's tmp directory.
"""

from __future__ import annotations

import base64
import functools
import http.server
import os
import re
import shutil
import subprocess
import threading
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urljoin, urlsplit

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
    """The bits of a rendered DOM the tests look at: <html lang>, <title>, <h1> text, <img>
    sources, the language switcher's links (hreflang -> href) and table cells (<td>)."""

    def __init__(self) -> None:
        super().__init__()
        self.lang = ""
        self.title = ""
        self.h1: list[str] = []
        self.img_srcs: list[str] = []
        self.alternates: dict[str, str] = {}
        self.cells: list[str] = []
        self._in: str | None = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "html":
            self.lang = attrs.get("lang") or ""
        elif tag in ("title", "h1", "td"):
            self._in = tag
            if tag == "h1":
                self.h1.append("")
            elif tag == "td":
                self.cells.append("")
        elif tag == "img":
            self.img_srcs.append(attrs.get("src") or "")
        elif tag == "a" and attrs.get("hreflang"):
            self.alternates[attrs["hreflang"]] = attrs.get("href") or ""

    def handle_endtag(self, tag):
        if tag == self._in:
            self._in = None

    def handle_data(self, data):
        if self._in == "title":
            self.title += data
        elif self._in == "h1":
            self.h1[-1] += data
        elif self._in == "td":
            self.cells[-1] += data


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


CJK = re.compile(r"[\u4e00-\u9fff]")


def _cjk_fonts() -> set[str]:
    """PostScript names of the installed fonts that cover Chinese, per fontconfig."""
    try:
        out = subprocess.run(
            ["fc-list", ":lang=zh", "postscriptname"], capture_output=True, text=True, timeout=30
        ).stdout
    except FileNotFoundError:
        return set()
    return {line.split("=", 1)[1].strip() for line in out.splitlines() if "=" in line}


def _pdf_fonts(pdf: bytes) -> set[str]:
    """Names of the fonts a PDF embeds, without the subset prefix (ABCDEF+Name)."""
    names = re.findall(rb"/FontName\s*/([^\s/<>\[\]()]+)", pdf)
    return {name.decode().split("+", 1)[-1] for name in names}


def test_chinese_home_page_renders_cjk_text(site_server, tmp_path):
    base_url, requests = site_server
    page, dom, _ = render(base_url + "/zh/", tmp_path, "zh-home")

    assert page.lang.startswith("zh"), page.lang
    assert page.title == "首页 - minivllm", page.title
    assert "连续批处理" in dom and "分页注意力" in dom
    figures = [src for src in page.img_srcs if src.endswith(".png")]
    assert figures, f"no figure on the Chinese home page: {page.img_srcs}"
    for src in figures:
        path = urlsplit(urljoin(base_url + "/zh/", src)).path
        assert (path, 200) in requests, f"{path} not loaded; requests: {requests}"

    # Chromium embeds, in a PDF, every font it drew glyphs with: the Chinese text must
    # have been drawn with a font that covers Chinese, not as empty boxes.
    cjk_fonts = _cjk_fonts()
    if not cjk_fonts and os.environ.get("CI", "").lower() != "true":
        pytest.skip("no CJK font installed (apt-get install -y fonts-noto-cjk): Chromium would "
                    "draw the Chinese text as boxes")  # fmt: skip
    assert cjk_fonts, "no CJK font installed: apt-get install -y fonts-noto-cjk"
    pdf_path = tmp_path / "zh-home.pdf"
    _chromium(base_url + "/zh/", tmp_path / "profile-zh-pdf", f"--print-to-pdf={pdf_path}")
    used = _pdf_fonts(pdf_path.read_bytes())
    assert used & cjk_fonts, f"Chinese drawn without a CJK font: PDF fonts {used}"


@pytest.mark.parametrize(
    ("path", "english_h1", "chinese_h1"),
    [
        ("tutorial/paged-attention/", "3. PagedAttention", "3. 分页注意力 PagedAttention"),
        ("glossary/", "Glossary", "术语表"),
    ],
)
def test_language_switcher_leads_to_the_same_page(
    site_server, tmp_path, path, english_h1, chinese_h1
):
    base_url, _ = site_server
    english, _, _ = render(f"{base_url}/{path}", tmp_path, "en")
    assert any(english_h1 in h for h in english.h1), english.h1
    assert set(english.alternates) >= {"en", "zh"}, english.alternates

    chinese_url = urljoin(f"{base_url}/{path}", english.alternates["zh"])
    assert chinese_url == f"{base_url}/zh/{path}"
    chinese, _, _ = render(chinese_url, tmp_path, "zh")
    assert any(chinese_h1 in h for h in chinese.h1), chinese.h1
    assert CJK.search(chinese.title), chinese.title

    back = urljoin(chinese_url, chinese.alternates["en"])
    assert back == f"{base_url}/{path}"


NUMBER = re.compile(r"\d[\d,.]*\d|\d")


def _static_page(path: str) -> _Page:
    page = _Page()
    page.feed((SITE / path / "index.html").read_text(encoding="utf-8"))
    return page


@pytest.mark.parametrize(
    "path",
    [
        "tutorial/results",
        "tutorial/paged-attention",
        "tutorial/continuous-batching",
        "tutorial/together",
        "glossary",
        "tutorial/speculative-decoding",
        "tutorial/serving",
        "tutorial/scheduler-queues",
        "tutorial/what-a-gpu-would-do",
        "tutorial/tensor-parallelism",
    ],
)
def test_chinese_pages_show_the_same_measured_tables(path):
    """One source of numbers: every number in the English page's table cells (its tables
    are shared snippets, or Chinese variants of them with the same numbers) is on the
    Chinese page too, in the same order; headers and row labels may be translated."""
    english = [n for cell in _static_page(path).cells for n in NUMBER.findall(cell)]
    chinese = iter(n for cell in _static_page(f"zh/{path}").cells for n in NUMBER.findall(cell))
    assert english, f"no table on {path}"
    missing = [n for n in english if n not in chinese]  # consumes: in order
    assert not missing, f"numbers of /{path}/ missing from /zh/{path}/: {missing}"


def test_notebook_pages_link_to_the_chinese_chapter(site_server):
    base_url, _ = site_server
    html = (SITE / "notebooks/01_paged_kv_cache/index.html").read_text(encoding="utf-8")
    links = re.findall(r'<div class="admonition info zh-chapter-link".*?</div>', html, re.S)
    assert links, "no link to the Chinese chapter on the notebook page"
    href = re.search(r'href="([^"]+)"', links[0]).group(1)
    assert urljoin(f"{base_url}/notebooks/01_paged_kv_cache/", href) == (
        f"{base_url}/zh/tutorial/paged-attention/"
    )
    assert (SITE / "zh/tutorial/paged-attention/index.html").is_file()


def test_chinese_paragraphs_have_no_space_between_characters():
    """A source line break between two Chinese characters must not reach the page, where
    Chromium would draw it as a space (docs/hooks/cjk_lines.py joins those lines)."""
    broken = re.compile(r"[\u3000-\u303f\u4e00-\u9fff\uff00-\uffef]\n\s*[\u4e00-\u9fff]")
    text_block = re.compile(r"<(p|li|figcaption)>(.*?)</\1>", re.S)
    pages = sorted((SITE / "zh").rglob("index.html"))
    assert len(pages) > 10
    for page in pages:
        html = page.read_text(encoding="utf-8")
        for _, paragraph in text_block.findall(html):
            assert not broken.search(paragraph), f"{page}: {paragraph[:200]}"


def test_every_page_has_the_language_switch():
    """Each page, in either language, links to itself in the other one (a page with no
    Chinese text, like the API reference, to its copy under /zh/, shown in English)."""
    pages = sorted(SITE.rglob("index.html"))
    assert len(pages) > 20
    for page in pages:
        parsed = _static_page(str(page.parent.relative_to(SITE)))
        url = "http://site/" + page.parent.relative_to(SITE).as_posix() + "/"
        english = url.replace("http://site/zh/", "http://site/").replace("/./", "/")
        chinese = english.replace("http://site/", "http://site/zh/")
        assert {lang: urljoin(url, href) for lang, href in parsed.alternates.items()} == {
            "en": english,
            "zh": chinese,
        }, page
