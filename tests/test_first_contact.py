"""What a vLLM user meets first: settings that know nothing of the command line, `--help`
with every default, vLLM's defaults (prefix caching on), a thread setting, the bundled
model under its Hub id, and `minivllm serve`'s console, `--api-key` and `/ping`."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from minivllm import LLM, EngineConfig, LLMEngine, SamplingParams
from minivllm.cli import build_parser, main
from minivllm.entrypoints import cli_args
from minivllm.models import model_files

PACKAGE = Path(__file__).resolve().parent.parent / "minivllm"
# The engine core: everything but the ways in (entrypoints, cli), the benchmark and the
# simulator, which sit on top of it.
NOT_CORE = ("entrypoints", "bench", "simulator", "cli.py")
FORBIDDEN = ("minivllm.bench", "minivllm.entrypoints", "minivllm.cli", "minivllm.simulator")


def _core_modules() -> list[Path]:
    return [
        path
        for path in sorted(PACKAGE.rglob("*.py"))
        if not path.relative_to(PACKAGE).parts[0].startswith(NOT_CORE)
    ]


def _imported_names(path: Path) -> set[str]:
    """Every module ``path`` imports, at the top or inside a function (not the ones under
    ``if TYPE_CHECKING:``, which never run)."""
    tree = ast.parse(path.read_text())
    type_only = {
        id(child)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
        for child in ast.walk(node)
    }
    names = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def test_the_core_imports_nothing_above_it():
    modules = _core_modules()
    assert PACKAGE / "config.py" in modules and PACKAGE / "scheduler.py" in modules
    offenders = {
        str(path.relative_to(PACKAGE)): sorted(
            name
            for name in _imported_names(path)
            if name == "argparse" or name.startswith(FORBIDDEN)
        )
        for path in modules
    }
    assert {path: names for path, names in offenders.items() if names} == {}


# The engine core: the files one plain request passes through, plus settings and loading.
# Each feature plugs in beside it at one seam (docs/architecture.md), so the core imports
# none of them: a policy is loaded by its class's name (`EngineConfig.scheduler_cls`), a
# request group by its kind (request_groups.py), the multi-process executor by its name.
CORE = [
    "sequence", "block_allocator", "kv_cache_manager", "scheduler_output", "scheduler",
    "scheduler_interface", "model_runner", "input_batch", "executor", "sampler", "logprobs",
    "outputs", "output_processor", "detokenizer", "input_processor", "engine", "llm",
    "sampling_params", "config", "model_info", "utils", "stats", "request_groups",
    "models/config", "models/llama", "models/linear", "models/loader", "models/model_files",
    "attention/backend", "attention/torch_backend", "attention/registry",
]  # fmt: skip
FEATURES = (
    "minivllm.spec_decode", "minivllm.beam_search", "minivllm.parallel_sampling",
    "minivllm.async_scheduler", "minivllm.multiproc_executor", "minivllm.static_scheduler",
    "minivllm.worker",
)  # fmt: skip


def test_the_core_imports_no_feature():
    offenders = {
        name: sorted(n for n in _imported_names(PACKAGE / f"{name}.py") if n.startswith(FEATURES))
        for name in CORE
    }
    assert {name: names for name, names in offenders.items() if names} == {}


def test_importing_the_package_loads_no_feature():
    """The same, at run time: ``import minivllm`` and the core modules load nothing above
    the core and no feature until a request or a setting needs it."""
    modules = ", ".join(f"minivllm.{name.replace('/', '.')}" for name in CORE)
    code = f"import sys, minivllm, {modules}; print(sorted(sys.modules))"
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert "minivllm.scheduler" in loaded
    assert [m for m in FEATURES + FORBIDDEN if f"'{m}" in loaded] == []


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports: every import, at the top, inside a
    function or under ``if TYPE_CHECKING:`` (a reader follows those too). ``from a import b``
    names module ``a.b`` when there is one, else ``a`` (its ``__init__.py`` for a package)."""
    modules = {_module_name(path): path for path in PACKAGE.rglob("*.py")}

    def owner(name: str) -> str | None:  # the longest prefix that is one of our modules
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {owner(alias.name) for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from .x import y
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets |= {owner(f"{base}.{alias.name}") for alias in node.names}
        graph[name] = targets - {None, name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


def test_the_circle_check_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _circles(graph) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_the_package_imports_in_no_circle():
    """Modules import one another one way only, so the package reads bottom up
    (docs/architecture.md): no circle, not even through a type-only import."""
    graph = _import_graph()
    assert {"minivllm.engine", "minivllm.models.llama", "minivllm.spec_decode"} <= graph.keys()
    # Edges are found: a plain import, and one under TYPE_CHECKING.
    assert "minivllm.models.arithmetic" in graph["minivllm.models.parallel_layers"]
    assert "minivllm.models.config" in graph["minivllm.models.arithmetic"]
    assert _circles(graph) == []


# --- the command line --------------------------------------------------------------------


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def test_every_engine_field_is_a_flag_of_every_command_that_takes_it():
    """A new EngineConfig field becomes ``--field-name`` with no other edit; what is
    command-line only lives in cli_args, not in the field's metadata."""
    generate = _subparsers()["generate"]
    options = {s for a in generate._actions for s in a.option_strings}
    for field in dataclasses.fields(EngineConfig):
        assert "--" + field.name.replace("_", "-") in options
        assert set(field.metadata) <= {"help"}, field.name
        assert field.metadata.get("help"), f"{field.name} has no help"
    assert set(cli_args.ENGINE_FLAG_OPTIONS) <= {f.name for f in dataclasses.fields(EngineConfig)}


@pytest.mark.parametrize("command", ["generate", "bench", "simulate", "serve"])
def test_help_shows_every_default_and_names_only_real_flags(command, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # one line per option: no flag cut in two
    parser = _subparsers()[command]
    text = parser.format_help()
    options = {s for a in parser._actions for s in a.option_strings}
    for action in parser._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS:
            continue
        if isinstance(action, argparse._HelpAction):
            continue
        formatted = parser._get_formatter()._format_action(action)
        assert "(default: " in formatted, f"{command} {action.option_strings[0]}: {formatted!r}"
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]+", text))
    assert named <= options, f"{command} --help names flags it lacks: {named - options}"


def test_engine_flags_parse_to_the_config():
    args = _subparsers()["generate"].parse_args(
        ["hi", "--kv-cache-memory", "64MiB", "--policy", "continuous", "--seed", "-3",
         "--speculative-config", '{"num_speculative_tokens": 2}', "--no-enable-prefix-caching"]
    )  # fmt: skip
    config = cli_args.engine_config_from_args(args)
    assert config.kv_cache_memory_bytes == 64 << 20
    assert (config.seed, config.enable_prefix_caching) == (-3, False)
    assert config.speculative_config.num_speculative_tokens == 2
    static = cli_args.engine_config_from_args(
        _subparsers()["generate"].parse_args(["hi", "--policy", "static"])
    )
    assert (static.scheduling_policy, static.enable_prefix_caching) == ("static", False)


@pytest.mark.parametrize(
    "flag", [["--kv-cache-memory", "lots"], ["--block-size", "0"], ["--seed", str(2**64)]]
)
def test_a_bad_engine_flag_is_argparses_error(flag, capsys):
    assert main(["generate", "hi", *flag]) == 2
    assert f"argument {flag[0]}" in capsys.readouterr().err


# --- vLLM's defaults -----------------------------------------------------------------------


def test_prefix_caching_is_on_by_default_except_under_static_batching():
    assert EngineConfig().enable_prefix_caching is True
    assert EngineConfig(scheduling_policy="static").enable_prefix_caching is False
    assert EngineConfig(enable_prefix_caching=False).enable_prefix_caching is False
    with pytest.raises(ValueError, match="prefix caching needs"):
        EngineConfig(scheduling_policy="static", enable_prefix_caching=True)
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        EngineConfig(enable_prefix_caching="yes")


def test_num_threads_sets_torchs_threads_before_the_engine(monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    with pytest.raises(ValueError, match="block_size"):
        LLM(num_threads=1, block_size=0)
    assert calls == [1]
    for bad in (0, -1, True, 1.5, "2"):
        with pytest.raises(ValueError, match="num_threads must be a positive int"):
            LLM(num_threads=bad)
    assert calls == [1]


def test_generate_threads_flag(tiny_llama_path, monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    argv = ["generate", "w5 w6", "--model", str(tiny_llama_path), "--max-tokens", "2"]
    assert main([*argv, "--threads", "1", "--attention-backend", "torch"]) == 0
    assert calls == [1]
    assert main([*argv, "--threads", "0"]) == 2


def test_generate_says_answers_print_as_they_finish(tiny_llama_path, capsys):
    argv = ["generate", "w5 w6", "w7", "--model", str(tiny_llama_path), "--max-tokens", "2"]
    assert main([*argv, "--attention-backend", "torch"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("(the prompts run as one batch; each answer prints when it finishes)")
    assert out.count("--- [") == 2


def test_generate_reports_speculative_acceptance(tiny_llama_path, capsys):
    spec = '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}'
    argv = ["generate", "w5 w6 w5 w6 w5", "--model", str(tiny_llama_path), "--max-tokens", "8"]
    assert main([*argv, "--attention-backend", "torch", "--speculative-config", spec]) == 0
    out = capsys.readouterr().out
    # A mean acceptance length only when something was drafted (this prompt drafts
    # nothing on the random model), never "0.00" as if measured.
    assert "SpecDecoding metrics: " in out, out
    drafted = not re.search(r"Drafted: 0 tokens", out)
    assert drafted == bool(re.search(r"Mean acceptance length: \d+\.\d\d", out)), out
    assert main([*argv, "--attention-backend", "torch"]) == 0
    assert "SpecDecoding" not in capsys.readouterr().out


# --- the model by its Hub id ---------------------------------------------------------------


def test_the_bundled_model_answers_to_its_hub_id(monkeypatch, tmp_path):
    monkeypatch.setattr(model_files, "default_model_path", lambda: tmp_path)
    assert model_files.resolve_model_path(None) == tmp_path
    assert model_files.resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct") == tmp_path
    assert model_files.resolve_model_path(str(tmp_path)) == tmp_path


def test_another_hub_id_is_refused_with_how_to_fetch_it():
    with pytest.raises(ValueError) as error:
        model_files.resolve_model_path("meta-llama/Llama-3.2-1B")
    message = str(error.value)
    assert "'meta-llama/Llama-3.2-1B'" in message
    assert "`hf download meta-llama/Llama-3.2-1B --local-dir" in message
    # The suggested command exists (huggingface_hub's CLI is `hf`; `huggingface-cli` is
    # its deprecated name, gone from recent versions).
    assert (Path(sys.executable).parent / "hf").is_file() or shutil.which("hf")
    assert "--model ./Llama-3.2-1B" in message
    # Any other path is the loader's to check (it names what is missing).
    assert model_files.resolve_model_path("./nowhere/at/all") == Path("nowhere/at/all")


# --- minivllm serve ------------------------------------------------------------------------

ENGINE_OPTIONS = dict(
    num_kv_blocks=64, block_size=4, max_num_batched_tokens=64, attention_backend="torch"
)


@pytest.fixture(scope="module")
def engine(tiny_llama_path):
    return LLMEngine(EngineConfig(model=str(tiny_llama_path), **ENGINE_OPTIONS))


class _Server:
    """`build_app` with an API key, on 127.0.0.1 and a free port, on a thread."""

    def __init__(self, engine: LLMEngine, api_key: str) -> None:
        import uvicorn

        from minivllm.entrypoints.async_llm import AsyncLLM
        from minivllm.entrypoints.openai.api_server import build_app

        self.async_llm = AsyncLLM(engine)
        app = build_app(self.async_llm, "tiny", api_key=api_key)
        self.socket = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.socket.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True
        )

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive()
            time.sleep(0.01)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(30)
        self.socket.close()
        self.async_llm.shutdown()


def test_api_key_guards_only_the_openai_routes(engine):
    pytest.importorskip("fastapi")
    body = {"model": "tiny", "prompt": "w1 w2", "max_tokens": 2}
    with _Server(engine, api_key="sesame") as server, httpx.Client(base_url=server.url) as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
            reply = http.post("/v1/completions", json=body, headers=headers)
            assert reply.status_code == 401
            error = reply.json()["error"]
            assert error["code"] == 401 and error["type"] == "AuthenticationError"
            assert "API key" in error["message"]
        assert http.get("/v1/models").status_code == 401
        ok = http.post("/v1/completions", json=body, headers={"Authorization": "Bearer sesame"})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
        for open_route in ("/health", "/ping", "/metrics", "/", "/live/state", "/version"):
            assert http.get(open_route).status_code == 200, open_route
        # The live page's data holds other clients' prompts and outputs: blank without the
        # key (ids and counts stay), whole with it.
        secret = {**body, "prompt": "my secret password w1"}
        http.post("/v1/completions", json=secret, headers={"Authorization": "Bearer sesame"})
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            state = http.get("/live/state", headers=headers)
            assert state.json()["redacted"] is True
            assert "secret" not in state.text and '"w1' not in state.text, state.text
            assert {r["num_output_tokens"] for r in state.json()["requests"]} == {2}
        state = http.get("/live/state", headers={"Authorization": "Bearer sesame"}).json()
        assert state["redacted"] is False
        assert [r["prompt"] for r in state["requests"]][-1] == "my secret password w1"
        # vLLM's tokenizer routes are outside /v1, so open too (as vLLM leaves them).
        assert http.post("/tokenize", json={"prompt": "w1 w2"}).json()["count"] == 2
        assert http.post("/detokenize", json={"tokens": [4]}).json()["prompt"] == "w1"


def test_startup_summary_and_stats_line(engine):
    pytest.importorskip("fastapi")
    from minivllm.entrypoints.async_llm import AsyncLLM
    from minivllm.entrypoints.stats_logger import LoggingStatLogger, startup_summary

    summary = "\n".join(startup_summary(engine, "tiny", "http://127.0.0.1:8000"))
    capacity = engine.num_kv_blocks * engine.config.block_size
    assert f"{engine.num_kv_blocks} blocks of 4 tokens = {capacity:,} tokens" in summary
    assert "dtype float32" in summary and "attention backend torch" in summary
    assert f"{capacity / engine.max_model_len:.2f}x" in summary
    assert "Live page: http://127.0.0.1:8000/" in summary and "prefix caching on" in summary

    lines: list[str] = []
    async_llm = AsyncLLM(engine)
    LoggingStatLogger(async_llm, interval_s=0.0, log=lines.append)
    try:
        import asyncio

        async def one_request():
            params = SamplingParams(max_tokens=3, ignore_eos=True)
            async for _ in async_llm.generate("r0", "w1 w2 w3 w4 w5", params):
                pass

        asyncio.run(one_request())
    finally:
        async_llm.shutdown()
    pattern = (
        r"Avg prompt throughput: [\d.]+ tokens/s, Avg generation throughput: [\d.]+ tokens/s, "
        r"Running: \d+ reqs, Waiting: \d+ reqs, GPU KV cache usage: [\d.]+%, "
        r"Prefix cache hit rate: [\d.]+%"
    )
    assert lines and all(re.fullmatch(pattern, line) for line in lines), lines
    assert any(not line.startswith("Avg prompt throughput: 0.0") for line in lines)


# --- output details ------------------------------------------------------------------------


def _summary(throughput: float, engine_counters: bool):
    from minivllm.bench.metrics import LatencyStats, RunSummary

    latency = LatencyStats.of([0.1, 0.2])
    counters = dict(num_steps=10, padding_waste=0.0, mean_batch_size=2.0, max_batch_size=3)
    return RunSummary(
        num_requests=2, duration=1.0, num_prompt_tokens=8, num_output_tokens=4,
        request_throughput=2.0, output_throughput=throughput, total_token_throughput=12.0,
        queue_time=latency, ttft=latency, tpot=latency, itl=latency, e2e_latency=latency,
        **(counters if engine_counters else {}),
    )  # fmt: skip


def test_bench_table_says_which_way_is_better_and_drops_unmeasured_rows():
    from minivllm.bench.report import format_table
    from minivllm.bench.runner import BenchRun

    runs = [
        BenchRun(name, _summary(throughput, True), [], 0.0)
        for name, throughput in (("static", 4.0), ("continuous", 6.0))
    ]
    rows = {line.split("  ")[0]: line.split() for line in format_table(runs).splitlines()[2:]}
    assert rows["output tokens/s"][-2:] == ["1.50x", "higher"]
    assert rows["duration (s)"][-1] == "lower" and rows["engine steps"][-1] == "1.00x"
    assert "model GFLOP/s (useful work)" not in rows  # no run counted FLOPs
    # A server benchmarked over HTTP: no engine counters, so no rows of "-".
    http_run = [BenchRun("server", _summary(4.0, False), [], 0.0)]
    table = format_table(http_run)
    assert "padding waste" not in table and "engine steps" not in table
    assert all(line.split()[-1] != "-" for line in table.splitlines()[2:]), table


def test_the_live_list_agrees_with_the_queue_counts():
    from minivllm.entrypoints.async_llm import StepRecord
    from minivllm.entrypoints.live import LiveRequests
    from minivllm.stats import StepStats

    live = LiveRequests(start_time=0.0)
    for request_id in ("a", "b", "c"):
        live.add(request_id, SamplingParams(max_tokens=4), "w1")

    def step(prefill=(), decode=(), preempted=()):
        stats = StepStats(0.0, 1.0, 8, 1, 0, 2, 1, 0, 4, 9, list(prefill), list(decode),
                          [], list(preempted))  # fmt: skip
        live.on_step(StepRecord(1, stats), [])

    step(prefill=["a"])  # a long prompt's first chunk: no output yet, but running
    assert [r.status for r in live.requests.values()] == ["running", "waiting", "waiting"]
    step(decode=["a"], prefill=["b"], preempted=["a"])
    assert [r.status for r in live.requests.values()] == ["waiting", "running", "waiting"]
    live.requests["b"].status = "stop"
    step(decode=["b"])  # a late step never revives a finished request
    assert live.requests["b"].status == "stop"


def test_make_demo_installs_only_what_the_demo_runs():
    import tomllib

    root = PACKAGE.parent
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    demo = " ".join(extras["demo"])
    for heavy in ("mkdocs", "jupyter", "nbclient", "mutmut", "nvidia", "pytest", "fastapi"):
        assert heavy not in demo and all(
            heavy not in r for e in ("gguf", "bench") for r in extras[e]
        )
    makefile = (root / "Makefile").read_text()
    demo_recipe = makefile.split("$(DEMO_INSTALLED): pyproject.toml", 1)[1].split("\n\n", 1)[0]
    assert 'pip install -q -e ".[demo]"' in demo_recipe
    assert re.search(r"^\$\(MODEL_STAMP\): \$\(DEMO_INSTALLED\)$", makefile, re.M)
    assert re.search(r"^demo: \$\(MODEL_STAMP\)$", makefile, re.M)


# --- the docs site from a fresh clone -------------------------------------------------------

DOCS = PACKAGE.parent / "docs"


def test_every_chapter_figure_from_a_notebook_is_a_labelled_pinned_run():
    import json

    provenance = json.loads((DOCS / "assets" / "figures" / "provenance.json").read_text())
    pinned = {name for record in provenance.values() for name in record["figures"]}
    for record in provenance.values():
        assert record["threads"] == 1 and record["machine"] and record["date_utc"]
        assert isinstance(record["load_average"], float)
    shown = {
        name
        for page in DOCS.rglob("*.md")
        for name in re.findall(r"assets/figures/([a-z0-9-]+)\.png", page.read_text())
    }
    assert shown and shown <= pinned, f"figures with no pinned run: {shown - pinned}"
    for name in pinned:
        assert (DOCS / "assets" / "figures" / f"{name}.png").is_file(), name
    sources = "".join(p.read_text() for p in (PACKAGE.parent / "notebooks").glob("[0-9]*.py"))
    assert all(f'"figure-{name}"' in sources for name in pinned)  # a cell still draws it


def test_every_notebook_has_a_pinned_executed_copy_without_errors():
    import nbformat

    sources = sorted((PACKAGE.parent / "notebooks").glob("[0-9][0-9]_*.py"))
    assert sources
    for source in sources:
        notebook = nbformat.read(DOCS / "notebooks" / f"{source.stem}.ipynb", as_version=4)
        code = [cell for cell in notebook.cells if cell.cell_type == "code"]
        assert all(cell.get("execution_count") for cell in code), f"{source.stem}: not run"
        outputs = [output for cell in code for output in cell.get("outputs", [])]
        assert not [o for o in outputs if o.get("output_type") == "error"], source.stem
