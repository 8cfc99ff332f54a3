"""mkdocs hook: the notebook pages in a two-language site.

Notebooks stay in English; the site renders the executed copies pinned in docs/notebooks/
(`python notebooks/execute.py --pin NN`, committed), so a fresh clone builds without running
anything. A notebook with no pinned copy yet is rendered from its source, without outputs,
under a note saying so. This hook makes mkdocs-jupyter's pages survive mkdocs-static-i18n
(both languages render the same notebook), turns the notebooks' links to other pages into
site URLs, and puts at the top of each notebook page a link to the Chinese chapter that
explains the same idea.
"""

from __future__ import annotations

import os
import posixpath
import re
import tempfile
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File
from mkdocs_jupyter.plugin import NotebookFile

# Notebook file stem -> the Chinese chapters that explain it: (docs path, title).
CHINESE_CHAPTERS = {
    "01_paged_kv_cache": [("tutorial/paged-attention.zh.md", "第 3 章 分页注意力 PagedAttention")],
    "02_engine_steps": [
        ("tutorial/continuous-batching.zh.md", "第 2 章 连续批处理"),
        ("tutorial/together.zh.md", "第 4 章 两者如何配合"),
    ],
    "03_static_vs_continuous": [
        ("tutorial/static-batching.zh.md", "第 1 章 静态批处理为什么不行"),
        ("tutorial/results.zh.md", "第 5 章 实测结果"),
    ],
    "04_preemption_prefix_caching": [
        ("tutorial/continuous-batching.zh.md", "第 2 章 连续批处理（抢占）"),
        ("tutorial/together.zh.md", "第 4 章 两者如何配合（前缀缓存）"),
    ],
    "05_attention_kernel": [("kernels.zh.md", "Attention kernel")],
    "06_speculative_decoding": [
        ("tutorial/speculative-decoding.zh.md", "第 10 章 投机解码"),
    ],
    "07_what_a_gpu_would_do": [
        ("tutorial/what-a-gpu-would-do.zh.md", "第 7 章 换成 GPU 会怎样"),
    ],
}


def _chinese_url(docs_path: str) -> str:
    """The site URL of a Chinese page: docs/foo/bar.zh.md is served at zh/foo/bar/."""
    stem = docs_path.removesuffix(".zh.md")
    stem = stem.removesuffix("index")
    return posixpath.join("zh", stem) + "/" if stem else "zh/"


def on_config(config):
    """A renamed or missing Chinese chapter fails the build instead of leaving a dead link."""
    docs = Path(config["docs_dir"])
    missing = sorted(
        {path for chapters in CHINESE_CHAPTERS.values() for path, _ in chapters}
        - {str(p.relative_to(docs)) for p in docs.rglob("*.zh.md")}
    )
    if missing:
        raise PluginError(f"docs/hooks/notebook_links.py links to missing pages: {missing}")
    return config


# Notebooks without a pinned executed copy, rendered from source (see _unexecuted_copies).
UNEXECUTED_NOTE = (
    "> **No outputs in this build.** This notebook has no pinned executed copy yet: run "
    "`python notebooks/execute.py --pin {number}` to measure one, or run it yourself "
    "(`python notebooks/execute.py {number}`)."
)
_scratch = tempfile.TemporaryDirectory(prefix="minivllm-notebooks-")


def _unexecuted_copies(config) -> list[File]:
    """Pages for the notebooks that have a source but no pinned executed copy."""
    import jupytext
    import nbformat

    docs = Path(config["docs_dir"])
    sources = sorted((docs.parent / "notebooks").glob("[0-9][0-9]_*.py"))
    pages = []
    for source in sources:
        src_uri = f"notebooks/{source.stem}.ipynb"
        if (docs / src_uri).exists():
            continue
        notebook = jupytext.read(source)
        note = UNEXECUTED_NOTE.format(number=source.stem[:2])
        notebook.cells.insert(1, nbformat.v4.new_markdown_cell(note))
        target = Path(_scratch.name) / src_uri
        target.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(notebook, target)
        pages.append(File(src_uri, _scratch.name, config["site_dir"], config["use_directory_urls"]))
    return pages


@event_priority(-200)  # after mkdocs-static-i18n's on_files (-100)
def on_files(files, config):
    """mkdocs-static-i18n rebuilds every File, which turns mkdocs-jupyter's notebook pages
    back into plain assets (the raw .ipynb would be copied to index.html): wrap them
    again. In the Chinese build i18n places them like an English asset, over the English
    page: they go under zh/ instead (the same executed notebook, rendered in the Chinese
    site's frame; nothing is executed again)."""
    i18n = config.plugins["i18n"]
    prefix = "" if i18n.current_language == i18n.default_language else i18n.current_language
    for page in _unexecuted_copies(config):
        if files.get_file_from_path(page.src_uri) is None:
            files.append(page)
    for file in list(files):
        if file.src_uri.endswith(".ipynb") and not isinstance(file, NotebookFile):
            notebook = NotebookFile(
                file, use_directory_urls=config.use_directory_urls, site_dir=config.site_dir
            )
            if prefix and not notebook.dest_path.startswith(prefix + "/"):
                notebook.dest_path = f"{prefix}/{notebook.dest_path}"
                notebook.abs_dest_path = os.path.join(config.site_dir, notebook.dest_path)
                notebook.url = f"{prefix}/{notebook.url}"
            files.remove(file)
            files.append(notebook)
    return files


# A link in a notebook's Markdown to another page, e.g. ../tutorial/results.md: mkdocs-jupyter
# leaves it as written, which is a dead link on the built site.
PAGE_LINK = re.compile(r'href="([^":#]+?)\.(?:md|ipynb)(#[^"]*)?"')


def _page_links_to_urls(html: str, src_uri: str, to_root: str, lang_prefix: str) -> str:
    def to_url(match: re.Match) -> str:
        target = posixpath.normpath(posixpath.join(posixpath.dirname(src_uri), match[1]))
        directory = target.removesuffix("index").rstrip("/")
        url = f"{to_root}{lang_prefix}{directory + '/' if directory else ''}{match[2] or ''}"
        return f'href="{url}"'

    return PAGE_LINK.sub(to_url, html)


# mkdocs-jupyter renders a notebook outside the on_page_content event, so the banner goes
# into the finished page, at the start of the article.
ARTICLE = '<article class="md-content__inner md-typeset">'


def on_post_page(html, page, config):
    src = page.file.src_uri
    if not src.endswith(".ipynb") or ARTICLE not in html:
        return html
    # Relative links, so the site works under any base URL. page.url is e.g.
    # "notebooks/01_paged_kv_cache/" (English) or "zh/notebooks/01_paged_kv_cache/".
    to_root = "../" * (page.url.rstrip("/").count("/") + 1)
    lang_prefix = "zh/" if page.url.startswith("zh/") else ""
    html = _page_links_to_urls(html, src, to_root, lang_prefix)
    chapters = CHINESE_CHAPTERS.get(posixpath.splitext(posixpath.basename(src))[0])
    if not chapters:
        return html
    links = "、".join(
        f'<a href="{to_root}{_chinese_url(path)}">{title}</a>' for path, title in chapters
    )
    banner = (
        '<div class="admonition info zh-chapter-link" lang="zh">'
        '<p class="admonition-title">中文</p>'
        f"<p>本 notebook 为英文；对应的中文讲解见 {links}。</p>"
        "</div>"
    )
    return html.replace(ARTICLE, ARTICLE + banner, 1)
