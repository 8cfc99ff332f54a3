"""What ``minivllm serve`` says on its console, like ``vllm serve``: a start-up summary
(model, dtype, KV cache, attention backend, how many requests fit) and, while requests
run, one stats line every few seconds (vLLM's ``LoggingStatLogger``)::

    Avg prompt throughput: 412.3 tokens/s, Avg generation throughput: 57.1 tokens/s,
    Running: 8 reqs, Waiting: 3 reqs, GPU KV cache usage: 41.2%, Prefix cache hit rate: 12.5%

The name "GPU KV cache usage" is vLLM's, kept so that log scrapers match; on a CPU it is
the KV pool in host memory.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from minivllm.engine import LLMEngine
from minivllm.entrypoints.async_llm import AsyncLLM, StepRecord
from minivllm.outputs import RequestOutput
from minivllm.stats import StepStats

logger = logging.getLogger("minivllm.serve")

LOG_INTERVAL_S = 10.0  # vLLM's VLLM_LOG_STATS_INTERVAL default


@dataclass
class StepCounts:
    """What the stats line reads off one step."""

    num_prompt_tokens: int  # prompts whose prefill completed this step (vLLM's count)
    num_generation_tokens: int  # output tokens the requests kept this step
    num_running: int
    num_waiting: int  # preempted ones included, as vLLM's "Waiting"
    kv_cache_usage: float  # fraction of the KV blocks in use
    prefix_cache_hit_rate: float  # since the engine started (or the cache's last reset)
    spec_decode_line: str | None  # vLLM's "SpecDecoding metrics: ..." or None when off


def read_step(stats: StepStats) -> StepCounts:
    """The one place the stats line reads the engine: its per-step snapshot."""
    spec = stats.spec_decoding
    return StepCounts(
        num_prompt_tokens=stats.num_prompt_tokens,
        num_generation_tokens=stats.num_generation_tokens,
        num_running=stats.num_running,
        num_waiting=stats.num_waiting + stats.num_preempted,
        kv_cache_usage=stats.num_kv_blocks_used / max(stats.num_kv_blocks, 1),
        prefix_cache_hit_rate=stats.prefix_cache.hit_rate,
        # As vLLM's logger: no line until something was drafted.
        spec_decode_line=spec.log_line() if spec is not None and spec.num_drafts else None,
    )


def weights_line(quantization, model_config) -> str:
    from minivllm.quantization import weights_line as line

    return line(quantization, model_config)


def startup_summary(engine: LLMEngine, model_name: str, url: str) -> list[str]:
    """The lines ``minivllm serve`` logs once the model is loaded."""
    config = engine.config
    capacity = engine.num_kv_blocks * config.block_size
    dtype = str(config.torch_dtype).removeprefix("torch.")
    lines = [
        f"Model: {model_name} ({config.model or 'bundled checkpoint'}), dtype {dtype}, "
        f"device {config.torch_device}, attention backend {config.attention_backend_name}",
        weights_line(config.quantization, engine.model_config),
        f"KV cache: {engine.num_kv_blocks} blocks of {config.block_size} tokens = "
        f"{capacity:,} tokens; max_model_len {engine.max_model_len:,}",
        f"Maximum concurrency for {engine.max_model_len:,} tokens per request: "
        f"{capacity / engine.max_model_len:.2f}x (up to {config.max_num_seqs} requests a "
        f"step, {config.max_num_batched_tokens} tokens a step)",
        f"Scheduling: {config.scheduling_policy}, prefix caching "
        f"{'on' if config.enable_prefix_caching else 'off'}, speculative decoding "
        f"{_speculative(config)}",
        f"Live page: {url}/  (OpenAI API under {url}/v1, metrics at {url}/metrics)",
    ]
    return lines


def _speculative(config) -> str:
    spec = config.speculative_config
    if spec is None:
        return "off"
    return f"{spec.method}, {spec.num_speculative_tokens} tokens"


class LoggingStatLogger:
    """Logs the stats line at most every ``interval_s`` seconds, after a step (an idle
    server stays quiet). Throughputs are averages over the time since the last line, or,
    after a pause longer than the interval, since the step that ended it: idle time does
    not dilute them."""

    def __init__(self, async_llm: AsyncLLM, interval_s: float = LOG_INTERVAL_S, log=None):
        self._interval_s = interval_s
        self._log = log or logger.info
        self._last_time = self._last_step_time = time.monotonic()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        async_llm.step_listeners.append(self.on_step)

    def on_step(self, record: StepRecord, outputs: list[RequestOutput]) -> None:
        """Engine thread, after each step."""
        now = time.monotonic()
        if now - self._last_step_time > self._interval_s:  # the first step after a pause
            self._last_time = now - (record.stats.end_time - record.stats.start_time)
        self._last_step_time = now
        counts = read_step(record.stats)
        self._prompt_tokens += counts.num_prompt_tokens
        self._generation_tokens += counts.num_generation_tokens
        if now - self._last_time >= self._interval_s:
            for line in self.lines(counts, now - self._last_time):
                self._log(line)
            self._last_time = now
            self._prompt_tokens = self._generation_tokens = 0

    def lines(self, counts: StepCounts, elapsed_s: float) -> list[str]:
        lines = [
            f"Avg prompt throughput: {self._prompt_tokens / elapsed_s:.1f} tokens/s, "
            f"Avg generation throughput: {self._generation_tokens / elapsed_s:.1f} tokens/s, "
            f"Running: {counts.num_running} reqs, Waiting: {counts.num_waiting} reqs, "
            f"GPU KV cache usage: {counts.kv_cache_usage:.1%}, "
            f"Prefix cache hit rate: {counts.prefix_cache_hit_rate:.1%}"
        ]
        if counts.spec_decode_line is not None:
            lines.append(counts.spec_decode_line)
        return lines
