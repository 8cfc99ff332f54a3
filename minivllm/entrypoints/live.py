"""What the live page at ``/`` shows: the engine's recent steps (who was in each one,
prefill or decode, KV blocks, queues) and the recent requests, as one JSON document that
the page polls from ``/live/state``. The page itself is ``static/live.html``."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path

from minivllm.entrypoints.async_llm import AsyncLLM
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams

PAGE = Path(__file__).parent / "static" / "live.html"


@dataclass
class LiveRequest:
    """One request as the page lists it."""

    request_id: str
    arrival: float  # seconds since the server started
    max_tokens: int | None
    status: str = "waiting"  # waiting, running, stop, length, abort, error
    prompt: str = ""
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    output: str = ""


class LiveRequests:
    """The last ``capacity`` requests, updated by the route handlers (event loop only)."""

    def __init__(self, start_time: float, capacity: int = 64) -> None:
        self.start_time = start_time  # time.perf_counter() when the server started
        self.capacity = capacity
        self.requests: OrderedDict[str, LiveRequest] = OrderedDict()

    def add(self, request_id: str, params: SamplingParams, prompt: str) -> None:
        now = time.perf_counter() - self.start_time
        self.requests[request_id] = LiveRequest(
            request_id, now, params.max_tokens, prompt=prompt[-80:]
        )
        while len(self.requests) > self.capacity:
            self.requests.popitem(last=False)

    def update(self, output: RequestOutput) -> None:
        request = self.requests.get(output.request_id)
        if request is None:
            return
        completion = output.outputs[0]
        request.num_prompt_tokens = len(output.prompt_token_ids)
        # A stream's outputs carry only their new tokens; a plain request's one output
        # carries all of them: adding them up counts right either way.
        request.num_output_tokens += sum(len(c.token_ids) for c in output.outputs)  # n > 1
        request.output = (request.output + completion.text)[-80:]
        request.status = completion.finish_reason or "running"

    def on_step(self, record, outputs) -> None:
        """Engine thread, after each step (an `AsyncLLM` step listener): a request the step
        computed is running, one it preempted waits again, so the list agrees with the
        queue counts above it even while a long prompt is prefilled over several steps.
        Only one attribute of a listed request is set, which is safe from that thread."""
        stats = record.stats
        for request_id in (*stats.prefill_ids, *stats.decode_ids):
            request = self.requests.get(request_id)
            if request is not None and request.status == "waiting":
                request.status = "running"
        for request_id in stats.preempted_ids:
            request = self.requests.get(request_id)
            if request is not None and request.status == "running":
                request.status = "waiting"

    def fail(self, request_id: str, status: str = "error") -> None:
        if request_id in self.requests and self.requests[request_id].status in (
            "waiting",
            "running",
        ):
            self.requests[request_id].status = status


def live_state(async_llm: AsyncLLM, live: LiveRequests, since: int) -> dict:
    """The JSON the page polls: steps numbered after ``since``, and the request list.

    Read from the event loop while the engine thread runs: `recent_steps` is a deque that
    only grows at its end (copying it is safe), and each `StepStats` is complete before it
    is appended."""
    steps = [record for record in list(async_llm.recent_steps) if record.index > since]
    return {
        "num_kv_blocks": async_llm.engine.num_kv_blocks,
        "max_num_seqs": async_llm.engine.config.max_num_seqs,
        "scheduling_policy": async_llm.engine.config.scheduling_policy,
        "num_steps": async_llm.num_steps,
        "steps": [_step_json(record.index, record.stats, live.start_time) for record in steps],
        "requests": [asdict(r) for r in live.requests.values()],
    }


def _step_json(index: int, stats, start_time: float) -> dict:
    return {
        "index": index,
        "start": round(stats.start_time - start_time, 4),
        "end": round(stats.end_time - start_time, 4),
        "prefill_ids": stats.prefill_ids,
        "decode_ids": stats.decode_ids,
        "preempted_ids": stats.preempted_ids,
        "num_prefill_tokens": stats.num_prefill_tokens,
        "num_decode_tokens": stats.num_decode_tokens,
        "num_padding_tokens": stats.num_padding_tokens,
        "num_running": stats.num_running,
        "num_waiting": stats.num_waiting,
        "num_preempted": stats.num_preempted,
        "num_kv_blocks_used": stats.num_kv_blocks_used,
    }
