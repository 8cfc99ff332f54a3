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
from minivllm.sampling_params import RequestOutputKind, SamplingParams

PAGE = Path(__file__).parent / "static" / "live.html"
TEXT_CHARS = 80  # the end of each prompt and output that the list keeps


def tail(text: str, num_chars: int) -> str:
    """The end of ``text``, with an ellipsis where its start was cut."""
    return text if len(text) <= num_chars else "\u2026" + text[-(num_chars - 1) :]


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
    stream: bool = False  # its outputs carry only their new tokens (DELTA)


class LiveRequests:
    """The last ``capacity`` requests, updated by the route handlers (event loop only)."""

    def __init__(self, start_time: float, capacity: int = 64, engine=None) -> None:
        self.start_time = start_time  # time.perf_counter() when the server started
        self.capacity = capacity
        self.requests: OrderedDict[str, LiveRequest] = OrderedDict()
        # The engine whose sequences `on_step` reads, on its thread: a plain request
        # reports nothing before it ends, but its row still counts its tokens.
        self.engine = engine

    def add(self, request_id: str, params: SamplingParams, prompt: str) -> None:
        now = time.perf_counter() - self.start_time
        stream = getattr(params, "output_kind", None) is RequestOutputKind.DELTA
        self.requests[request_id] = LiveRequest(
            request_id, now, params.max_tokens, prompt=tail(prompt, TEXT_CHARS), stream=stream
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
        # carries all of them (its count so far came from `on_step`).
        num_tokens = sum(len(c.token_ids) for c in output.outputs)  # n > 1
        if request.stream:
            request.num_output_tokens += num_tokens
        else:
            request.num_output_tokens = num_tokens
        request.output = tail(request.output + completion.text, TEXT_CHARS)
        request.status = completion.finish_reason or "running"

    def on_step(self, record, outputs) -> None:
        """Engine thread, after each step (an `AsyncLLM` step listener): a request the step
        computed is running, one it preempted waits again, so the list agrees with the
        queue counts above it even while a long prompt is prefilled over several steps.
        A plain (not streamed) running request's output tokens are counted here, from its
        sequences. The step lists sequences: an ``n > 1`` request's children and a beam
        search's beams are listed under the request they belong to. Only single attributes
        of a listed request are set, which is safe from that thread."""
        stats = record.stats
        num_tokens: dict[str, int] = {}
        for seq_id in (*stats.prefill_ids, *stats.decode_ids):
            request = self._listed(seq_id)
            if request is None:
                continue
            if request.status == "waiting":
                request.status = "running"
            seq = self.engine.scheduler.requests.get(seq_id) if self.engine else None
            if seq is not None and not request.stream:
                num_tokens[request.request_id] = (
                    num_tokens.get(request.request_id, 0) + seq.num_output_tokens
                )
        for request_id, count in num_tokens.items():
            request = self.requests[request_id]
            if request.status == "running":  # never over the final count
                request.num_output_tokens = max(request.num_output_tokens, count)
        for seq_id in stats.preempted_ids:
            request = self._listed(seq_id)
            if request is not None and request.status == "running":
                request.status = "waiting"

    def _listed(self, seq_id: str) -> LiveRequest | None:
        """The listed request a sequence belongs to: itself, or for a child (``i_ID``,
        vLLM's spelling) or a beam (``beamI_ID``) the request ``ID``."""
        request = self.requests.get(seq_id)
        if request is None and "_" in seq_id:
            request = self.requests.get(seq_id.split("_", 1)[1])
        return request

    def fail(self, request_id: str, status: str = "error") -> None:
        if request_id in self.requests and self.requests[request_id].status in (
            "waiting",
            "running",
        ):
            self.requests[request_id].status = status


def live_state(async_llm: AsyncLLM, live: LiveRequests, since: int, redact: bool = False) -> dict:
    """The JSON the page polls: steps numbered after ``since``, and the request list.
    ``redact`` (a server with ``--api-key``, a caller without it): every prompt and
    output is blank, and ``redacted`` says so; ids, timings and counts stay.

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
        "requests": [_request_json(r, redact) for r in list(live.requests.values())],
        "redacted": redact,
    }


def _request_json(request: LiveRequest, redact: bool) -> dict:
    row = asdict(request)
    if redact:
        row["prompt"] = row["output"] = ""
    return row


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
