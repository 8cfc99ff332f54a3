"""The reading path of one plain decode step (benchmarks/reading_path.py, shown on the
architecture page) names functions that exist and that the step really runs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import reading_path  # noqa: E402

from minivllm import LLM, SamplingParams  # noqa: E402


def test_every_step_on_the_path_exists_and_a_rename_fails_the_script(monkeypatch):
    rows = reading_path.measure()
    assert len({file for file, _, _ in rows}) == len(reading_path.PATH)
    assert all(lines > 0 for _, _, lines in rows)
    monkeypatch.setattr(reading_path, "PATH", [("engine.py", ["LLMEngine.no_such_step"])])
    with pytest.raises(SystemExit, match="no LLMEngine.no_such_step"):
        reading_path.measure()


def test_a_plain_decode_step_on_a_cpu_calls_the_functions_on_the_path(tiny_llama_path):
    """Profile the last decode step of a request on the default engine (it takes a new
    block and finishes): every method the path lists is called (classes are read whole;
    `LLM._run_engine` is the loop around the step)."""
    llm = LLM(model=str(tiny_llama_path), num_kv_blocks=64, block_size=4, attention_backend="torch")
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    engine.add_request("0", {"prompt_token_ids": [1, 2, 3, 4]}, params)
    engine.step()  # the prefill: one full block
    called: set[str] = set()

    def trace(frame, event, arg):
        if event == "call":
            code = frame.f_code
            called.add(f"{Path(code.co_filename).name}:{code.co_qualname}")

    sys.setprofile(trace)
    try:
        engine.step()  # one decode
    finally:
        sys.setprofile(None)
    listed = {
        f"{Path(file).name}:{name}"
        for file, names in reading_path.PATH
        for name in names
        if "." in name and not name.startswith("LLM.")
    }
    assert listed - called == set()
    assert not engine.has_unfinished_requests()
