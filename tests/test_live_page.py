"""What the live page lists is true while requests run: a plain (not streamed) request
counts its output tokens as they are made (its one output comes only at the end), an
``n > 1`` request and a beam search are listed as running while their children or beams
run, and a cut prompt or output shows an ellipsis where its start was cut."""

from __future__ import annotations

from minivllm import BeamSearchParams, EngineConfig, LLMEngine, RequestOutputKind, SamplingParams
from minivllm.entrypoints.async_llm import StepRecord
from minivllm.entrypoints.live import TEXT_CHARS, LiveRequests, tail
from tests.helpers import ENGINE_OPTIONS


def test_plain_running_requests_count_their_tokens_as_they_are_made(tiny_llama_path):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_path), **ENGINE_OPTIONS))
    live = LiveRequests(start_time=0.0, engine=engine)
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    stream = SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    requests = {
        "cmpl-plain": plain,
        "cmpl-n2": SamplingParams(n=2, temperature=0, max_tokens=12, ignore_eos=True),
        "cmpl-stream": stream,
    }
    for request_id, params in requests.items():
        engine.add_request(request_id, "w1 w2 w3", params)
        live.add(request_id, params, "w1 w2 w3")
    engine.add_beam_search_request("cmpl-beams", "w4 w5", BeamSearchParams(2, 12, ignore_eos=True))
    live.add("cmpl-beams", SamplingParams(max_tokens=12), "w4 w5")
    seen_running = {request_id: [] for request_id in live.requests}
    index = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if engine.last_stats is not None:
            index += 1
            live.on_step(StepRecord(index, engine.last_stats), outputs)
        for output in outputs:
            live.update(output)
        for request_id, row in live.requests.items():
            if row.status == "running":
                seen_running[request_id].append(row.num_output_tokens)
    rows = live.requests
    # While running, a plain request's count rose step by step, up to its final count.
    for request_id in ("cmpl-plain", "cmpl-stream"):
        counts = seen_running[request_id]
        assert counts == sorted(counts) and max(counts) >= 10, (request_id, counts)
        assert rows[request_id].num_output_tokens == 12
    assert max(seen_running["cmpl-n2"]) >= 2 * 10, seen_running["cmpl-n2"]
    assert rows["cmpl-n2"].num_output_tokens == 2 * 12
    assert len(seen_running["cmpl-beams"]) >= 10  # listed as running while its beams ran
    assert {r.status for r in rows.values()} == {"length"}


def test_cut_texts_show_an_ellipsis():
    live = LiveRequests(start_time=0.0)
    long_prompt = "".join(f"w{i} " for i in range(100))
    live.add("a", SamplingParams(), long_prompt)
    live.add("b", SamplingParams(), "w1 w2")
    assert live.requests["a"].prompt == "\u2026" + long_prompt[-(TEXT_CHARS - 1) :]
    assert len(live.requests["a"].prompt) == TEXT_CHARS
    assert live.requests["b"].prompt == "w1 w2"  # short: whole, no ellipsis
    text = "x" * (TEXT_CHARS - 1)
    assert tail(text, TEXT_CHARS) == text
    assert (
        tail(tail(text + "yz", TEXT_CHARS) + "abc", TEXT_CHARS)
        == "\u2026" + (text + "yzabc")[-(TEXT_CHARS - 1) :]
    )


def test_the_server_reports_the_step_left_in_flight_when_it_goes_idle(tiny_llama_path):
    """Async scheduling leaves a step in flight after the last request finishes; an idle
    server reports it at once, so the next request's steps (the live timeline, the
    metrics) never carry the previous request."""
    import asyncio
    import time

    from minivllm.entrypoints.async_llm import AsyncLLM

    config = EngineConfig(model=str(tiny_llama_path), **ENGINE_OPTIONS | {"async_scheduling": True})
    async_llm = AsyncLLM(LLMEngine(config))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    async def run(request_id):
        return await (await async_llm.add_request(request_id, "w1 w2", params)).collect()

    try:
        asyncio.run(run("first"))
        deadline = time.monotonic() + 10
        while async_llm.engine.in_flight is not None:
            assert time.monotonic() < deadline, "the last step stayed in flight"
            time.sleep(0.01)
        time.sleep(0.2)  # its report is recorded just after the step returns
        seen = len(async_llm.recent_steps)
        asyncio.run(run("second"))
    finally:
        async_llm.shutdown()
    later = list(async_llm.recent_steps)[seen:]
    assert later and all(
        "first" not in (*r.stats.prefill_ids, *r.stats.decode_ids) for r in later
    ), [(r.stats.prefill_ids, r.stats.decode_ids) for r in later]
