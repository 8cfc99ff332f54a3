"""mkdocs hook: each notebook page (English only) points Chinese readers to the tutorial
chapter that explains the same idea, so the notebooks stay untouched and are never
re-executed for the second language."""

from __future__ import annotations

import posixpath
from pathlib import Path

from mkdocs.exceptions import PluginError

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


def on_page_content(html, page, config, files):
    src = page.file.src_uri
    if not src.endswith(".ipynb"):
        return html
    chapters = CHINESE_CHAPTERS.get(posixpath.splitext(posixpath.basename(src))[0])
    if not chapters:
        return html
    # Relative links, so the site works under any base URL. page.url is e.g.
    # "notebooks/01_paged_kv_cache/" (English) or "zh/notebooks/01_paged_kv_cache/".
    to_root = "../" * (page.url.rstrip("/").count("/") + 1)
    links = "、".join(
        f'<a href="{to_root}{_chinese_url(path)}">{title}</a>' for path, title in chapters
    )
    banner = (
        '<div class="admonition info zh-chapter-link" lang="zh">'
        '<p class="admonition-title">中文</p>'
        f"<p>本 notebook 为英文；对应的中文讲解见 {links}。</p>"
        "</div>"
    )
    return banner + html
