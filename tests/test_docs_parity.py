"""The two languages of the docs say the same thing, and no page says something the code
or the measurements contradict. Read from the sources, without building the site:

- each Chinese page (NAME.zh.md) shows the same figures and shared tables as its English
  page and has as many `##` sections; a Chinese twin of a table (snippets/NAME.zh.md)
  holds the same numbers, in the same order, and the same code names;
- no Chinese page sends its reader to the English page for content;
- the Chinese pages use the glossary's word for each concept (docs/snippets/
  glossary-word-choice.md), never a spelling it rejects;
- no page describes a feature that exists as missing;
- the numbers the home page and the results chapter's key-numbers box quote are the
  measured ones of the results tables.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SNIPPETS = DOCS / "snippets"
ZH_PAGES = sorted(p for p in DOCS.rglob("*.zh.md") if SNIPPETS not in p.parents)
ZH_SNIPPETS = sorted(SNIPPETS.glob("*.zh.md"))
ALL_PAGES = sorted(p for p in DOCS.rglob("*.md") if SNIPPETS not in p.parents)

# Pages another change owns (the architecture page is rewritten with the engine core),
# known to fail a check until it lands. Remove an entry once its page passes: the marks
# are strict, so a page that passes while listed fails the run and says so.
# architecture.zh.md: "block table" in prose (块表) and 反分词 (detokenize).
AWAITING_CHAPTERS_1_TO_5: set[tuple[str, str]] = set()

IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)|<img[^>]*\bsrc=\"([^\"]+)\"")
SNIPPET = re.compile(r'^--8<-- "([^"]+)"', re.M)
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
NUMBER = re.compile(r"\d+(?:\.\d+)?")
CODE_SPAN = re.compile(r"`[^`\n]+`")
CJK = r"\u4e00-\u9fff"


def rel(page: Path) -> str:
    return page.relative_to(DOCS).as_posix()


def english_of(page: Path) -> Path:
    return page.with_name(page.name.replace(".zh.md", ".md"))


def params(check: str, pages: list[Path]) -> list:
    """One pytest param per page, xfail (strict) where AWAITING_CHAPTERS_1_TO_5 says so."""
    out = []
    for page in pages:
        marks = []
        if (check, rel(page)) in AWAITING_CHAPTERS_1_TO_5:
            marks = [pytest.mark.xfail(strict=True, reason="owned by a parallel change")]
        out.append(pytest.param(page, id=rel(page), marks=marks))
    return out


def without_code(text: str) -> str:
    return FENCE.sub("", text)


def prose(text: str) -> str:
    """What a reader reads as words: no code, HTML tags or comments, link targets, heading
    anchors or snippet lines (a snippet is checked on its own)."""
    text = re.sub(r"<!--.*?-->", "", without_code(text), flags=re.S)
    text = CODE_SPAN.sub(" ", text)
    text = re.sub(r"\]\([^)]*\)", "]", text)
    text = re.sub(r"<[^>\n]+>", " ", text)
    text = re.sub(r"\{#[^}]*\}", "", text)
    return SNIPPET.sub("", text)


def images(text: str) -> set[str]:
    """The figures a page shows; a Chinese copy (NAME.zh.svg) counts as its English one."""
    return {(a or b).replace(".zh.", ".") for a, b in IMAGE.findall(without_code(text))}


def snippets(text: str) -> set[str]:
    """The shared tables a page includes; a Chinese twin counts as its English table."""
    return {name.replace(".zh.md", ".md") for name in SNIPPET.findall(text)}


def sections(text: str) -> int:
    return len(re.findall(r"^## ", without_code(text), re.M))


# --- the same figures, tables and sections in both languages ------------------------


@pytest.mark.parametrize("page", params("figures and tables", ZH_PAGES))
def test_a_chinese_page_shows_the_figures_and_tables_of_its_english_page(page):
    english, chinese = english_of(page).read_text(), page.read_text()
    assert images(chinese) == images(english), (
        f"figures only in English: {sorted(images(english) - images(chinese))}; "
        f"only in Chinese: {sorted(images(chinese) - images(english))}"
    )
    assert snippets(chinese) == snippets(english), (
        f"tables only in English: {sorted(snippets(english) - snippets(chinese))}; "
        f"only in Chinese: {sorted(snippets(chinese) - snippets(english))}"
    )


@pytest.mark.parametrize("page", params("sections", ZH_PAGES))
def test_a_chinese_page_has_the_sections_of_its_english_page(page):
    assert sections(page.read_text()) == sections(english_of(page).read_text())


def table_rows(text: str) -> list[str]:
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    return [line for line in text.splitlines() if line.startswith("|")]


@pytest.mark.parametrize("twin", ZH_SNIPPETS, ids=lambda p: p.name)
def test_a_chinese_table_has_the_numbers_and_code_names_of_its_english_twin(twin):
    english = table_rows(english_of(twin).read_text())
    chinese = table_rows(twin.read_text())
    assert len(chinese) == len(english), "a different number of rows"
    for en_row, zh_row in zip(english, chinese, strict=True):
        assert NUMBER.findall(zh_row) == NUMBER.findall(en_row), (en_row, zh_row)
        assert sorted(CODE_SPAN.findall(zh_row)) == sorted(CODE_SPAN.findall(en_row)), (
            en_row,
            zh_row,
        )


@pytest.mark.parametrize("page", params("Chinese tables", ZH_PAGES))
def test_a_chinese_page_includes_the_chinese_twin_of_every_table_that_has_one(page):
    twins = {english_of(twin).name: twin.name for twin in ZH_SNIPPETS}
    english = SNIPPET.findall(english_of(page).read_text())
    chinese = SNIPPET.findall(page.read_text())
    missing = [twins[name] for name in english if name in twins and twins[name] not in chinese]
    assert not missing, f"{rel(page)} includes the English table, not its twin: {missing}"


# --- no Chinese page sends its reader to English ---------------------------------------

SEND_TO_ENGLISH = re.compile(
    r"(见|参见|详见|参考|请看)英文|英文版本页|英文(版)?页面|see the English page", re.I
)


LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", params("no English for content", ZH_PAGES + ZH_SNIPPETS))
def test_no_chinese_page_sends_the_reader_to_the_english_page(page):
    text = page.read_text()
    found = SEND_TO_ENGLISH.findall(prose(text))
    assert not found, f"{rel(page)} sends the reader to English: {found}"
    # A relative link that climbs out of docs/ lands on the English site's copy of a page
    # (the Chinese site is docs/ served under /zh/).
    base = DOCS if page.parent == SNIPPETS else page.parent
    for target in LINK.findall(without_code(text)):
        if re.match(r"[a-z]+:|#", target):
            continue
        resolved = (base / target.split("#")[0]).resolve()
        assert DOCS.resolve() in [resolved, *resolved.parents], f"{rel(page)} links to {target}"


# --- one word per concept on the Chinese pages -----------------------------------------


@dataclasses.dataclass(frozen=True)
class WordChoice:
    concept: str
    preferred: tuple[str, ...]
    rejected: tuple[str, ...]


@functools.cache
def word_choices() -> tuple[WordChoice, ...]:
    rows = table_rows((SNIPPETS / "glossary-word-choice.md").read_text())[2:]
    choices = []
    for row in rows:
        concept, preferred, rejected = (cell.strip() for cell in row.strip("|").split("|"))
        choices.append(
            WordChoice(
                concept,
                tuple(re.findall(r"`([^`]+)`", preferred)),
                tuple(re.findall(r"`([^`]+)`", rejected)),
            )
        )
    return tuple(choices)


# Full-width punctuation and forms (，。：（）、“” …): a word next to one is inside a
# Chinese sentence as much as a word next to a Chinese character.
FULL_WIDTH = r"\u3000-\u303f\uff00-\uffef\u201c\u201d"


def cells_as_clauses(text: str) -> str:
    """A Chinese table (one with a Chinese character in any row) read as sentences: its
    cell borders become full-width commas, so an English word alone in a cell of a
    Chinese table ("| decode |") counts as written in Chinese."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        j = i
        while j < len(lines) and lines[j].startswith("|"):
            j += 1
        if j > i and any(re.search(f"[{CJK}]", row) for row in lines[i:j]):
            lines[i:j] = [row.replace("|", "，") for row in lines[i:j]]
        i = max(j, i + 1)
    return "\n".join(lines)


def rejected_uses(text: str, choice: WordChoice) -> list[str]:
    """The rejected spellings of one concept in a Chinese text. The site's words that
    contain a rejected one (笔记本电脑 ⊃ 笔记本) are masked first. An English word counts
    only inside a Chinese sentence: touching a Chinese character, a space apart at most."""
    site_words = {word for c in word_choices() for word in c.preferred}
    # An English gloss in full-width parentheses (批次（batch）) names the term, as the
    # glossary does; a word next to one (engine（前端）) does not.
    text = re.sub(r"（[\x00-\x7f]+([，）])", r"（\1", text)
    found = []
    for word in choice.rejected:
        masked = text
        for longer in sorted((w for w in site_words if word in w and w != word), key=len)[::-1]:
            masked = masked.replace(longer, "\0")
        if word.isascii():
            near = CJK + FULL_WIDTH
            pattern = rf"(?:[{near}] ?\b{re.escape(word)}\b|\b{re.escape(word)}\b ?[{near}])"
        else:
            pattern = re.escape(word)
        found += [m.group(0) for m in re.finditer(pattern, masked)]
    return found


def test_the_word_choice_table_is_read():
    choices = word_choices()
    assert len(choices) >= 15
    assert all(c.preferred and c.rejected for c in choices)
    prefill = next(c for c in choices if c.concept == "prefill")
    assert rejected_uses("先做预填充，再把 prefill 块放进批次", prefill) == ["预填充", "把 prefill"]
    assert rejected_uses("分块 Prefill（chunked prefill）", prefill) == []
    engine = next(c for c in choices if c.concept == "engine")
    assert sorted(rejected_uses("Engine 从不调用；engine（前端）", engine)) == [
        "Engine 从",
        "；engine",
    ]
    decode = next(c for c in choices if c.concept == "decode")
    table = "| 运行中请求 | step |\n| 64 | decode | 5.26 |"
    assert rejected_uses(cells_as_clauses(table), decode) == ["， decode"]
    assert rejected_uses(cells_as_clauses("| requests |\n| decode |"), decode) == []
    assert rejected_uses("分块 Prefill（chunked prefill）；槽位（slot）", decode) == []
    laptop = next(c for c in choices if c.concept == "laptop")
    assert rejected_uses("笔记本电脑上的 Jupyter 笔记本", laptop) == []
    assert rejected_uses("在笔记本上跑", laptop) == ["笔记本"]


@pytest.mark.parametrize("page", params("word choice", ZH_PAGES + ZH_SNIPPETS))
def test_chinese_pages_use_the_glossarys_words(page):
    text = prose(page.read_text())
    if page.parent == SNIPPETS:  # a table: its cells are prose, its code names are not
        text = CODE_SPAN.sub(" ", page.read_text())
    if page.name != "glossary-table.zh.md":  # its English column is English on purpose
        text = cells_as_clauses(text)
    problems = {
        choice.concept: uses for choice in word_choices() if (uses := rejected_uses(text, choice))
    }
    assert not problems, f"{rel(page)}: spellings the glossary rejects: {problems}"


# --- no page calls an existing feature missing -----------------------------------------


@dataclasses.dataclass(frozen=True)
class Feature:
    name: str
    exists: bool
    claims_absent: tuple[str, ...]  # regular expressions


def _engine_config_fields() -> str:
    return (ROOT / "minivllm" / "config.py").read_text()


FEATURES = [
    Feature(
        "speculative decoding (minivllm/spec_decode/)",
        (ROOT / "minivllm" / "spec_decode").is_dir(),
        (
            r"speculative decoding[^.|\n]{0,40}\bnot yet\b",
            r"\bnot yet\b[^.|\n]{0,40}speculative decoding",
            r"—\s*\(not yet\)",
            r"\bno speculative decoding\b(?! beyond)",
            r"投机解码[^。|\n]{0,20}(还没有|尚未|没有实现|未实现)",
            r"(没有|不支持)投机解码",
        ),
    ),
    Feature(
        "an OpenAI-compatible server (`minivllm serve`, minivllm/entrypoints/)",
        (ROOT / "minivllm" / "entrypoints" / "openai").is_dir(),
        (
            r"\boffline (use )?only\b",
            r"\bonly offline\b",
            r"\bno (HTTP|OpenAI-compatible|online) server",
            r"只有离线",
            r"仅(支持)?离线",
            r"没有[^。\n]{0,8}(HTTP|在线)服务",
        ),
    ),
    Feature(
        "the GPU simulator (`minivllm simulate`, minivllm/simulator/)",
        (ROOT / "minivllm" / "simulator").is_dir(),
        (r"\bno (GPU )?simulator\b", r"没有(GPU )?模拟器"),
    ),
    Feature(
        "prefix caching (enable_prefix_caching)",
        "enable_prefix_caching" in _engine_config_fields(),
        (r"\bno prefix caching\b", r"(没有|不支持)前缀缓存"),
    ),
    Feature(
        "chunked prefill",
        "max_num_batched_tokens" in _engine_config_fields(),
        (r"\bno chunked prefill\b", r"(没有|不支持)分块 ?Prefill"),
    ),
    Feature(
        "chat (LLM.chat)",
        "def chat" in (ROOT / "minivllm" / "llm.py").read_text(),
        (r"\bno chat\b", r"(没有|不支持) ?chat"),
    ),
    Feature(
        "tensor parallelism in the engine (EngineConfig.tensor_parallel_size)",
        "tensor_parallel_size" in _engine_config_fields(),
        (r"\bno tensor (or pipeline )?parallelism\b", r"没有张量并行"),
    ),
]


def test_the_feature_list_knows_what_exists():
    assert [f.name for f in FEATURES if f.exists][:3] == [f.name for f in FEATURES[:3]]
    claim = next(f for f in FEATURES if f.name.startswith("speculative")).claims_absent
    assert any(re.search(p, "| 投机解码 | — (not yet) |", re.I) for p in claim)
    assert not any(
        re.search(p, "no speculative decoding beyond n-gram drafts", re.I) for p in claim
    )


@pytest.mark.parametrize("page", params("features", ALL_PAGES + sorted(SNIPPETS.glob("*.md"))))
def test_no_page_calls_an_existing_feature_missing(page):
    text = re.sub(r"\s+", " ", prose(page.read_text()))
    for feature in FEATURES:
        if not feature.exists:
            continue
        for pattern in feature.claims_absent:
            found = re.search(pattern, text, re.I)
            assert not found, f"{rel(page)} calls {feature.name} missing: {found.group(0)!r}"


# --- quoted numbers come from the measured tables ----------------------------------------

# A measured quantity in prose: a number (or a range a–b) with a unit a reader compares.
QUOTED = re.compile(r"(\d+(?:\.\d+)?)(?:\s*[–-]\s*(\d+(?:\.\d+)?))?\s*(×|%|倍)")
# The explainer's claims, quoted to compare with: its 2–4× throughput, its 30–70 % P99.
EXPLAINER_NUMBERS = {"2", "4", "30", "70"}


def measured_numbers(names: list[str]) -> tuple[set[str], list[float]]:
    """The numbers of these results tables, and their ratios (the × column)."""
    numbers: set[str] = set()
    ratios: list[float] = []
    for name in names:
        for row in table_rows((SNIPPETS / name).read_text()):
            numbers |= set(NUMBER.findall(row))
            ratios += [float(r) for r in re.findall(r"(\d+\.\d+)×", row)]
    return numbers, ratios


def unsupported(text: str, names: list[str], extra: frozenset[str] = frozenset()) -> list[str]:
    """Quoted numbers (with a unit, or on either side of an arrow) that are neither in the
    tables (or in ``extra``), nor a ratio of them as a change in per cent (0.72× is
    −28 %), nor the explainer's."""
    numbers, ratios = measured_numbers(names)
    numbers = numbers | extra
    changes = {str(round(abs(1 - r) * 100)) for r in ratios}
    bad = []
    for match in QUOTED.finditer(text):
        for number in filter(None, match.group(1, 2)):
            if number in numbers or number in EXPLAINER_NUMBERS:
                continue
            if match.group(3) == "%" and number in changes:
                continue
            bad.append(match.group(0))
    for match in CHANGE.finditer(text):
        bad += [match.group(0) for n in match.group(1, 2) if n not in numbers][:1]
    return bad


RESULTS_TABLES = sorted(p.name for p in SNIPPETS.glob("results-*.md") if ".zh." not in p.name)
# "a → b": a measured before and after, with or without a unit.
CHANGE = re.compile(r"(\d+(?:\.\d+)?)\s*(?:s|ms|%)?\s*→\s*(\d+(?:\.\d+)?)")


def measured_columns(text: str) -> list[str]:
    """The cells of every table column headed "measured" (实测): the explainer's
    comparison with minivllm's numbers, on the home page and in chapter 2."""
    cells = []
    lines = text.splitlines()
    for i, line in enumerate(lines[:-1]):
        is_header = line.startswith("|") and re.match(r"\|[\s|:-]+\|$", lines[i + 1])
        if not is_header or not re.search(r"measured|实测", line.strip("|").split("|")[-1]):
            continue
        for row in lines[i + 2 :]:
            if not row.startswith("|"):
                break
            cells.append(row.strip().strip("|").split("|")[-1])
    return cells


def admonitions(text: str) -> list[str]:
    """The boxes (`!!! kind "title"` and their indented body) of a page."""
    return re.findall(r"^[!?]{3}\+? .*\n(?:(?:    .*)?\n)*", without_code(text), re.M)


def test_the_number_check_accepts_derived_changes_and_rejects_others():
    assert unsupported("P99 −28 %, 1.38×, padding 44.9 %, 2.7 → 11.5", RESULTS_TABLES) == []
    assert unsupported("throughput 1.3× and 2.6×", RESULTS_TABLES) == ["1.3×", "2.6×"]
    assert unsupported("mean batch 2.7 → 12.5", RESULTS_TABLES) == ["2.7 → 12.5"]
    table = "| | a | measured |\n| --- | --- | --- |\n| x | y | 1 → 2 |\n\ntext"
    assert measured_columns(table) == [" 1 → 2 "]


@pytest.mark.parametrize(
    "page", params("quoted numbers", [DOCS / "index.md", DOCS / "index.zh.md"])
)
def test_the_home_pages_measured_numbers_come_from_the_results_tables(page):
    text = page.read_text()
    tables = [SNIPPETS / name for name in SNIPPET.findall(text) if name.startswith("home-")]
    assert tables, "the home page has no comparison table (snippets/home-*.md)"
    assert measured_columns(tables[0].read_text()), "its table has no measured column"
    quoted = "".join(admonitions(text))
    assert QUOTED.search(quoted), "the home page's boxes quote no measured number"
    # The interview answers and the card's sentence also quote the other measured tables
    # and the committed runs: every such number on the page comes from one of them.
    assert unsupported(prose(text), RESULTS_TABLES, committed_numbers()) == []


@pytest.mark.parametrize(
    "page", params("measured column", ALL_PAGES + sorted(SNIPPETS.glob("*.md")))
)
def test_a_measured_column_quotes_the_results_tables(page):
    for cell in measured_columns(page.read_text()):
        assert unsupported(cell, RESULTS_TABLES) == [], f"{rel(page)}: {cell}"


@pytest.mark.parametrize(
    "page",
    params("quoted numbers", [DOCS / "tutorial/results.md", DOCS / "tutorial/results.zh.md"]),
)
def test_the_results_key_numbers_come_from_its_tables(page):
    boxes = admonitions(page.read_text())
    assert boxes, f"{rel(page)} has no key-numbers box"
    first = boxes[0]
    assert QUOTED.search(first), f"{rel(page)}: the first box quotes no measured number"
    assert unsupported(first, RESULTS_TABLES) == []


# --- the numbers card: every number from the run it names ---------------------------------

CARD = SNIPPETS / "numbers-card.md"
RESULTS = DOCS / "assets" / "results"
NOTEBOOKS = DOCS / "notebooks"


def plain(text: str) -> str:
    """Thousands separators dropped (1,347.5 is 1347.5)."""
    return re.sub(r"(?<=\d),(?=\d{3})", "", text)


def derived(values: list[float]) -> set[str]:
    """How a page may quote a value: as it is, rounded to 0-2 decimals."""
    out = set()
    for v in values:
        out |= {f"{v:.0f}", f"{v:.1f}", f"{v:.2f}", plain(str(v))}
    return out


def json_numbers(path: Path) -> set[str]:
    """A committed run's numbers: every value, seconds also in milliseconds; a decode-step
    run also per generated token (ms / rows) and against one row (×)."""
    import json

    data = json.loads(path.read_text())
    values: list[float] = []

    def walk(node):
        if isinstance(node, dict):
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)
        elif isinstance(node, (int, float)) and not isinstance(node, bool):
            values.extend([node, node * 1000, node * 100])  # s as ms, a fraction as %

    walk(data)
    rows = [r for r in data.get("results", []) if isinstance(r, dict) and "rows" in r]
    if rows and "best_s" in rows[0]:
        one = next(r["best_s"] for r in rows if r["rows"] == 1)
        values += [r["best_s"] * 1000 / r["rows"] for r in rows]
        values += [r["best_s"] / one for r in rows]
    return derived(values)


def table_numbers(path: Path, row_ratios: bool = True) -> set[str]:
    """A results table's numbers, each ratio as a change in per cent (0.72× is −28 %), and
    the ratio of any two numbers of one row (96.4 against 29.2 is 3.30×)."""
    numbers: set[str] = set()
    for row in table_rows(plain(path.read_text())):
        found = [float(n) for n in NUMBER.findall(row)]
        numbers |= set(NUMBER.findall(row))
        numbers |= {str(round(abs(1 - float(r)) * 100)) for r in re.findall(r"(\d+\.\d+)[×x]", row)}
        if row_ratios:
            numbers |= derived([a / b for a in found for b in found if b])
    return numbers


def notebook_numbers(path: Path) -> set[str]:
    import nbformat

    notebook = nbformat.read(path, as_version=4)
    text = ""
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            text += str(output.get("text", "")) + str(output.get("data", {}).get("text/plain", ""))
    return set(NUMBER.findall(plain(text)))


def source_numbers(name: str) -> set[str]:
    if name.endswith(".json"):
        return json_numbers(RESULTS / name)
    if name.endswith(".ipynb"):
        return notebook_numbers(NOTEBOOKS / name)
    return table_numbers(SNIPPETS / name)


def card_rows() -> list[tuple[str, str, list[str]]]:
    rows = []
    for row in table_rows(CARD.read_text())[2:]:
        what, number, _, source = (cell.strip() for cell in row.strip().strip("|").split("|"))
        rows.append((what, number, re.findall(r"`([^`]+)`", source)))
    return rows


def test_the_numbers_card_is_read():
    rows = card_rows()
    assert len(rows) >= 8
    assert all(sources for _, _, sources in rows)
    assert "2.39" in table_numbers(SNIPPETS / "results-same-kv-memory.md")
    assert "58" in table_numbers(SNIPPETS / "results-same-kv-memory.md")  # 0.42×: −58 %
    decode = json_numbers(RESULTS / "decode-step-time-2026-12-03.json")
    assert {"26", "449", "4.1", "7.0", "1.6"} <= decode
    assert "4.2" not in decode  # 66.35 ms / 16 rows is 4.15 ms: 4.1, never 4.2


@pytest.mark.parametrize("row", card_rows(), ids=lambda r: r[0])
def test_every_number_on_the_card_comes_from_the_run_it_names(row):
    what, number, sources = row
    known = set().union(*(source_numbers(name) for name in sources))
    # Sizes of the runs (rows, requests) are given beside their numbers: also from the source.
    missing = [n for n in NUMBER.findall(plain(number)) if n not in known]
    assert not missing, f"{what}: {missing} are not in {sources}"


@functools.cache
def committed_numbers() -> frozenset[str]:
    """Every number of a measured table (docs/snippets/) or a committed run
    (docs/assets/results/*.json), with what `table_numbers` and `json_numbers` derive."""
    numbers: set[str] = set()
    for table in SNIPPETS.glob("*.md"):
        if ".zh." not in table.name:
            numbers |= table_numbers(table, row_ratios=False)
    for run in RESULTS.glob("*.json"):
        numbers |= json_numbers(run)
    return frozenset(numbers)


# --- the numbers of the prose, in both languages ----------------------------------------


def prose_numbers(text: str) -> set[str]:
    """The numbers a reader reads in a page's prose (tables, checked on their own, and
    code left out): thousands separators dropped, "2.7 million" and "270 万" both
    2700000, and a month's number (12 月) dropped, as English names the month."""
    text = re.sub(r"`[^`]+`", " ", without_code(text))  # code spans, across a line break too
    text = prose(text)
    text = re.sub(r"^\|.*$", "", text, flags=re.M)
    text = re.sub(r"(\d+) ?月", " ", plain(text))

    def scaled(factor: float):
        def value(m: re.Match) -> str:
            v = round(float(m.group(1)) * factor, 6)
            return str(int(v)) if v == int(v) else str(v)

        return value

    for word, factor in (("million", 1e6), ("billion", 1e9), ("万", 1e4), ("亿", 1e8)):
        text = re.sub(rf"(\d+(?:\.\d+)?)\s*{word}", scaled(factor), text)
    return set(NUMBER.findall(text))


def test_prose_numbers_are_normalised():
    assert prose_numbers("2.7 million chunks, 1,000 prompts") == {"2700000", "1000"}
    assert prose_numbers("270 万个 chunk，1,000 个 prompt") == {"2700000", "1000"}
    assert prose_numbers("2026 年 12 月 3 日") == prose_numbers("3 December 2026")
    assert prose_numbers("| 1 | 2 |\n`x = 3` text 4") == {"4"}


@pytest.mark.parametrize("page", params("prose numbers", ZH_PAGES))
def test_a_chinese_page_quotes_the_numbers_of_its_english_page(page):
    english = prose_numbers(english_of(page).read_text())
    chinese = prose_numbers(page.read_text())
    assert chinese == english, (
        f"only in English: {sorted(english - chinese)}; "
        f"only in Chinese: {sorted(chinese - english)}"
    )


# --- statements the code or the measurements contradict ----------------------------------

# Each: what was once written, and the patterns that find it again (prose, one line).
STALE_CLAIMS = {
    "a CPU step 'costs every row its FLOPs' (ch1: memory-bound to ~8-16 rows)": (
        r"CPU[^.]{0,60}every (token )?row[^.]{0,30}costs",
        r"on this CPU a step's time follows its token rows",
        r"CPU ?上[^。]{0,12}每一行[^。]{0,12}(都要|付出)",
        r"跟着它的 token 行数走（计算受限）",
    ),
    "static loses 'by less than 2×' (measured 1.38× and 2.39×)": (
        r"\bby less than\s*2\s*×",
        r"优势不到 ?2 ?(倍|×)",
    ),
    "the flat tensors 'rebuilt every step' (a persistent InputBatch)": (
        r"rebuilds the (flat )?(batch )?tensors every step",
        r"每一?步都?重建[^。]{0,10}张量",
    ),
    "each chunk 'with its own copy of its block table' (an immutable shared tuple)": (
        r"own copy of its block table",
        r"各自(持有)?一份块表的副本",
    ),
    "minivllm 'calls everything in one loop' in 'one process'": (
        r"calls everything in one loop",
        r"\*\*One process\.\*\*",
    ),
    "'vLLM's versions do much more (… speculative decoding …, distributed workers)'": (
        r"do much more \((?:[^)]*, )?(speculative decoding|distributed workers)\b(?! methods)",
    ),
    "API keys listed as vLLM-only (`minivllm serve --api-key`)": (
        r"(tool calls|structured output)[^|]{0,30}API keys?",
        r"\bno API keys?\b",
        r"工具调用[^|]{0,20}API key",
    ),
    "num_computed_tokens advances 'after the step ran' as if no scheduler did otherwise": (
        r"advances \| after the step ran \(\s*\) \|",
        r"何时前进 \| 这一步跑完之后（\s*） \|",
    ),
}


def test_the_stale_claims_are_found():
    found = {
        claim
        for claim, patterns in STALE_CLAIMS.items()
        for text in (
            "On a CPU every row of a step costs its matmul FLOPs.",
            "static batching loses to continuous batching by less than 2× here",
            "minivllm rebuilds the flat tensors every step",
            "vLLM's versions do much more (several groups, speculative decoding, workers)",
            "| serve | more routes (tool calls, structured output, API keys) |",
            "| when `num_computed_tokens` advances | after the step ran (`update_from_output`) | |",
        )
        if any(re.search(p, re.sub(r"\s+", " ", prose(text))) for p in patterns)
    }
    assert len(found) == 6, found
    more = STALE_CLAIMS[next(c for c in STALE_CLAIMS if "do much more" in c)]
    assert not re.search(more[0], "do much more (groups, more speculative decoding methods)")


@pytest.mark.parametrize("page", params("stale claims", ALL_PAGES + sorted(SNIPPETS.glob("*.md"))))
def test_no_page_repeats_a_stale_claim(page):
    text = re.sub(r"\s+", " ", prose(page.read_text()))
    for claim, patterns in STALE_CLAIMS.items():
        for pattern in patterns:
            found = re.search(pattern, text)
            assert not found, f"{rel(page)}: {claim}: {found.group(0)!r}"


# --- chapter 2 shows the loops that run ---------------------------------------------------

CHAPTER_2 = [DOCS / "tutorial/continuous-batching.md", DOCS / "tutorial/continuous-batching.zh.md"]


def code_lines(text: str) -> list[str]:
    """The statements of a Python block, comments and `...` dropped."""
    lines = []
    for line in text.splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()
        if line and not line.startswith("#") and line != "...":
            lines.append(line)
    return lines


@pytest.mark.parametrize("page", CHAPTER_2, ids=rel)
def test_chapter_2_shows_the_step_functions_the_engine_runs(page):
    """ch2 shows `step` and both step functions it chooses between, each line as it
    stands in engine.py (a signature may drop its annotations), and names both
    schedulers."""
    engine = (ROOT / "minivllm" / "engine.py").read_text()
    source = {line.strip() for line in engine.splitlines()}
    code = "\n".join(FENCE.findall(page.read_text()))
    shown = re.findall(r"^def (\w+)\(self", code, re.M)
    assert {"step", "_step_sync", "_step_async"} <= set(shown), f"{rel(page)} shows {shown}"
    for line in code_lines(code.replace("```python", "").replace("```", "")):
        if line.startswith("def "):
            name = re.match(r"def (\w+)", line).group(1)
            assert f"def {name}(self" in engine, f"{rel(page)}: no {name} in engine.py"
            continue
        assert line in source, f"{rel(page)}: {line!r} is not a line of engine.py"
    text = page.read_text()
    for name in ("Scheduler", "AsyncScheduler", "num_output_placeholders", "step_fn"):
        assert re.search(rf"`[^`]*\b{name}\b[^`]*`", text), f"{rel(page)} never names {name}"


def test_code_lines_drop_comments():
    assert code_lines("x = 1  # one\n    # two\n    ...\ny = 2") == ["x = 1", "y = 2"]


# --- links to a section land on it ---------------------------------------------------------


def anchors(page: Path, top: int = 1) -> set[str]:
    """The ids of a page's headings (of level ``top`` and below): {#explicit}, else the
    toc extension's slug."""
    ids = set()
    for line in without_code(page.read_text()).splitlines():
        heading = re.match(rf"#{{{top},6}} (.*)", line)
        if not heading:
            continue
        explicit = re.search(r"\{#([^}]+)\}", heading.group(1))
        if explicit:
            ids.add(explicit.group(1))
        else:
            slug = re.sub(r"[^\w\s-]", "", heading.group(1).strip().lower())
            ids.add(re.sub(r"[\s]+", "-", slug))
    return ids


@pytest.mark.parametrize("page", ALL_PAGES, ids=rel)
def test_every_link_to_a_section_finds_it(page):
    for target in LINK.findall(without_code(page.read_text())):
        path, _, anchor = target.partition("#")
        if not anchor or re.match(r"[a-z]+:", path) or not path.endswith(".md"):
            continue
        resolved = (page.parent / path).resolve()
        if not resolved.is_file():
            continue  # test_images_exist and mkdocs --strict see missing pages
        assert anchor in anchors(resolved), f"{rel(page)}: no #{anchor} in {path}"


# --- Chinese prose reads as Chinese ---------------------------------------------------------

# The zh chapters put the conclusion first, in short paragraphs and lists (a paragraph here
# is a block of prose or one list item; CJK characters counted). The index's one-paragraph
# abstract is one paragraph on purpose.
LONGEST_PARAGRAPH = 260


def zh_paragraphs(text: str) -> list[str]:
    paragraphs, after_abstract = [], False
    for block in re.split(r"\n\s*\n", without_code(text)):
        if not (after_abstract or re.match(r"\s*(\||<|!|--8<|#|\?\?\?)", block)):
            paragraphs += re.split(r"\n(?=\s*(?:[-*]|\d+\.) )", block)
        after_abstract = block.lstrip().startswith(("??? abstract", "!!! abstract"))
    return paragraphs


@pytest.mark.parametrize("page", params("paragraphs", ZH_PAGES))
def test_chinese_paragraphs_stay_short(page):
    lengths = [len(re.findall(f"[{CJK}]", p)) for p in zh_paragraphs(page.read_text())]
    assert max(lengths, default=0) <= LONGEST_PARAGRAPH, f"{rel(page)}: {max(lengths)} characters"


@pytest.mark.parametrize("page", params("quotes", ZH_PAGES + ZH_SNIPPETS))
def test_chinese_pages_quote_with_chinese_quotation_marks(page):
    lines = [
        line
        for line in prose(page.read_text()).splitlines()
        if not re.match(r"\s*[!?]{3}", line)  # an admonition's title is Markdown syntax
    ]
    found = re.findall(rf'"[^"\n]*[{CJK}][^"\n]*"', "\n".join(lines))
    assert not found, f"{rel(page)}: ASCII quotes around Chinese: {found}"


# --- the same sections, reached by the same links ------------------------------------------


@pytest.mark.parametrize("page", params("anchors", ZH_PAGES))
def test_a_chinese_page_has_the_section_anchors_of_its_english_page(page):
    """A link to a section (#id) and the language switcher land on the same section in
    both languages: each Chinese heading carries its English twin's id ({#id})."""
    english, chinese = anchors(english_of(page), top=2), anchors(page, top=2)
    assert english <= chinese, f"{rel(page)} lacks {sorted(english - chinese)}"


@pytest.mark.parametrize("page", params("figures in Chinese", ZH_PAGES))
def test_a_chinese_page_shows_the_chinese_drawing_where_there_is_one(page):
    for src in IMAGE.findall(without_code(page.read_text())):
        src = next(s for s in src if s)
        if src.endswith(".svg") and ".zh." not in src:
            twin = (page.parent / src.replace(".svg", ".zh.svg")).resolve()
            assert not twin.is_file(), f"{rel(page)} shows {src}, not its Chinese twin"


def test_every_drawn_diagram_has_a_chinese_twin():
    diagrams = DOCS / "assets" / "diagrams"
    for svg in diagrams.glob("*.svg"):
        if ".zh." not in svg.name:
            assert svg.with_name(svg.stem + ".zh.svg").is_file(), f"{svg.name} has no .zh.svg"


# --- one explanation of the CPU regime, one card of numbers -----------------------------------

CPU_REGIME = "static-batching.md#cpu-regime"
HEADLINE = re.compile(r"\b(1\.38|2\.39)\s*(×|倍)")


def test_chapter_1_teaches_the_cpu_regime():
    for page in (DOCS / "tutorial/static-batching.md", DOCS / "tutorial/static-batching.zh.md"):
        assert "cpu-regime" in anchors(page)


@pytest.mark.parametrize(
    "page",
    [
        DOCS / f"{name}{lang}.md"
        for name in (
            "index",
            "tutorial/paged-attention",
            "tutorial/results",
            "tutorial/what-a-gpu-would-do",
            "tutorial/speculative-decoding",
        )
        for lang in ("", ".zh")
    ],
    ids=rel,
)
def test_the_chapters_that_need_the_cpu_regime_link_to_it(page):
    assert CPU_REGIME in page.read_text(), f"{rel(page)} does not link to chapter 1's CPU regime"


@pytest.mark.parametrize("page", ALL_PAGES, ids=rel)
def test_a_page_that_quotes_the_headline_ratios_points_at_the_card(page):
    text = page.read_text()
    if not HEADLINE.search(prose(text)) or page.stem.startswith("results"):
        return  # chapter 5 holds the tables the card quotes
    assert "numbers-to-quote" in text or '"numbers-card' in text, (
        f"{rel(page)} quotes 1.38× / 2.39× without the numbers card"
    )


@pytest.mark.parametrize("page", ALL_PAGES, ids=rel)
def test_every_included_table_exists(page):
    """A snippet line names a file of docs/snippets/ by its bare name (the include's base
    path): a path or a missing file breaks the build."""
    for name in SNIPPET.findall(page.read_text()):
        assert (SNIPPETS / name).is_file(), f"{rel(page)} includes {name}: no docs/snippets/{name}"
