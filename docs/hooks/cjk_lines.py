"""mkdocs hook: join the source lines of a Chinese paragraph where the break falls between
two CJK characters.

Markdown turns a line break inside a paragraph into a space, and Chromium draws that space
between two Chinese characters ("实现： 基于"), where Chinese text has none. A break next to
Latin text stays a space, as Chinese typesetting wants it ("分页 KV Cache"). Code blocks,
tables and lines that start a new block are left alone.
"""

from __future__ import annotations

import re

# CJK ideographs, CJK punctuation and full-width forms.
CJK = r"\u3000-\u303f\u3400-\u4dbf\u4e00-\u9fff\uff00-\uffef"
# Emphasis markers and a link's "](target)" between the character and the break don't count.
ENDS_CJK = re.compile(f"[{CJK}][*_]*(\\]\\([^)]*\\))?$")
STARTS_CJK = re.compile(f"^\\s*[*_\\[]*[{CJK}]")
FENCE = re.compile(r"^\s*(```|~~~)")


def join_cjk_lines(markdown: str) -> str:
    out: list[str] = []
    in_fence = False
    for line in markdown.split("\n"):
        if FENCE.match(line):
            in_fence = not in_fence
        elif (
            not in_fence
            and out
            and ENDS_CJK.search(out[-1])
            and STARTS_CJK.match(line)
            and not out[-1].lstrip().startswith("|")
        ):
            out[-1] += line.lstrip()
            continue
        out.append(line)
    return "\n".join(out)


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri.endswith(".zh.md"):
        return join_cjk_lines(markdown)
    return markdown
