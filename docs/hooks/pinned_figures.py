"""mkdocs hook: every figure a chapter takes from a notebook says which run measured it.

The chapters show ``docs/assets/figures/NAME.png``, written by a pinned notebook run
(``python notebooks/execute.py --pin NN``) and committed with
``docs/assets/figures/provenance.json``: when, on what machine, with how many threads.
This hook puts that line under each such figure, in the page's language, and fails the
build when a page shows a figure no pinned run produced, so a figure measured on some
other machine at build time can never pass for the chapter's illustration.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from mkdocs.exceptions import PluginError

# A paragraph holding one image of docs/assets/figures/.
FIGURE_PARAGRAPH = re.compile(
    r'<p>(?:(?!</p>).)*?<img [^>]*src="[^"]*assets/figures/([a-z0-9-]+)\.png"[^>]*>.*?</p>',
    re.S,
)

CAPTION = {
    "en": "Measured {date_utc} UTC on {machine} (load average {load_average} when it "
    "started), {threads_en}, by notebook {number}'s pinned run (<code>{command}</code>); "
    "its workload is seeded.",
    "zh": "测量于 {date_utc} UTC，{machine}（开始时 load average 为 {load_average}），"
    "{threads} 个线程，来自 notebook {number} 的固定运行（<code>{command}</code>）；"
    "工作负载固定了随机种子。",
}

_by_figure: dict[str, dict] = {}


def on_config(config):
    provenance = Path(config["docs_dir"]) / "assets" / "figures" / "provenance.json"
    records = json.loads(provenance.read_text()) if provenance.exists() else {}
    _by_figure.clear()
    for notebook, record in records.items():
        for figure in record["figures"]:
            threads_en = "one thread" if record["threads"] == 1 else f"{record['threads']} threads"
            _by_figure[figure] = {
                **record,
                "number": str(int(notebook[:2])),
                "threads_en": threads_en,
            }
    return config


def on_page_content(html, page, config, files):
    language = "zh" if page.url.startswith("zh/") else "en"

    def with_caption(match: re.Match) -> str:
        record = _by_figure.get(match[1])
        if record is None:
            raise PluginError(
                f"{page.file.src_uri} shows assets/figures/{match[1]}.png, which no pinned "
                "notebook run produced: run `python notebooks/execute.py --pin NN` for the "
                "notebook whose cell is tagged figure-" + match[1]
            )
        caption = CAPTION[language].format(**record)
        return f'{match[0]}\n<p class="figure-provenance"><small>{caption}</small></p>'

    return FIGURE_PARAGRAPH.sub(with_caption, html)
