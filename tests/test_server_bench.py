"""``minivllm bench --base-url``'s client (`run_http`) against a real `minivllm serve` on
127.0.0.1: every request of a seeded Poisson workload is sent, streamed and timed."""

from __future__ import annotations

import numpy as np
import pytest

from minivllm import EngineConfig, LLMEngine
from minivllm.bench import workloads
from minivllm.bench.http_client import RequestFailed, run_http
from minivllm.bench.workloads import LengthDistribution
from minivllm.entrypoints.openai.api_server import BackgroundServer

ENGINE_OPTIONS = dict(
    num_kv_blocks=128, block_size=4, max_num_seqs=8, max_num_batched_tokens=64
) | {"attention_backend": "torch"}


@pytest.fixture(scope="module")
def server(tiny_llama_path):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_path), **ENGINE_OPTIONS))
    with BackgroundServer(engine, model_name="tiny") as server:
        yield server


def _workload(n: int = 12):
    workload = workloads.synthetic(
        n,
        LengthDistribution.parse("uniform:4:40"),
        LengthDistribution.parse("uniform:2:12"),
        (3, 256),
        seed=0,
    )
    return workload.with_poisson_arrivals(50.0, seed=0)


def test_run_http_measures_every_request(server):
    workload = _workload()
    run = run_http(server.url, workload, max_concurrency=4, progress=False)

    by_id = {r.request_id: r for r in run.requests}
    assert set(by_id) == {r.request_id for r in workload.requests}
    for request in workload.requests:
        result = by_id[request.request_id]
        # ignore_eos + max_tokens: exactly the asked-for work, counted by the server.
        assert result.num_output_tokens == request.max_tokens
        assert result.num_prompt_tokens == len(request.prompt_token_ids)
        m = result.metrics
        # One SSE event per token, but none for a token with no text (a special token).
        assert 1 <= len(m.token_times) <= request.max_tokens
        assert 0 < m.ttft <= m.e2e_latency
        assert np.all(np.diff(m.token_times) >= 0)
        if request.max_tokens > 1:
            expected = (m.e2e_latency - m.ttft) / (request.max_tokens - 1)
            assert m.tpot == pytest.approx(expected)
    s = run.summary
    assert s.num_requests == len(workload.requests)
    assert s.num_output_tokens == workload.num_output_tokens
    assert 0 < s.ttft.p50 <= s.e2e_latency.p50 and s.output_throughput > 0
    assert s.itl.mean is not None and s.queue_time.mean is None  # a client can't see queueing


def test_run_http_reports_a_failing_server(server):
    workload = _workload(2)
    with pytest.raises(RequestFailed, match="404"):
        run_http(server.url, workload, progress=False, model="not-served")


def test_bench_command_with_base_url(server, tiny_llama_path, tmp_path, capsys):
    from minivllm.cli import main

    out = tmp_path / "http.json"
    argv = ["bench", "--base-url", server.url, "--model", str(tiny_llama_path)]
    argv += ["--num-prompts", "6", "--prompt-len", "uniform:4:20", "--output-len", "4"]
    argv += ["--request-rate", "100", "--max-concurrency", "3", "--no-progress"]
    assert main(argv + ["--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"server {server.url} over HTTP" in printed and "TTFT p50 (ms)" in printed
    import json

    data = json.loads(out.read_text())
    summary = data["runs"]["HTTP"]["summary"]
    assert summary["num_requests"] == 6 and summary["num_output_tokens"] == 6 * 4
    assert data["workload"]["max_concurrency"] == 3
