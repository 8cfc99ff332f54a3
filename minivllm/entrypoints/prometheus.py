"""Prometheus metrics with vLLM's names (``vllm:...``), so vLLM dashboards and scrapers
work unchanged against ``minivllm serve``'s ``/metrics``.

Updated on the engine thread after every step (`AsyncLLM.step_listeners`), from the
step's `StepStats` snapshot alone: queue gauges and KV usage; the token counters, counted
per request as vLLM does (a request's whole prompt once, cached tokens included, when its
prefill completes, never again after a preemption; every output token kept, in the step
that made it, so an aborted request's tokens count too, streamed or not); preemptions; and
the prefix-cache and spec-decode counters, as the growth of the snapshot's totals. From
each output: its TTFT (with the first token), ITLs (for later ones) and e2e latency (at
the finish), read off its `RequestMetrics`. prometheus_client adds ``_total`` to counter
names when scraped (``vllm:prompt_tokens_total``).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from minivllm.entrypoints.async_llm import AsyncLLM, StepRecord
from minivllm.kv_cache_manager import PrefixCacheStats
from minivllm.outputs import RequestOutput
from minivllm.spec_decode import SpecDecodingStats
from minivllm.stats import StepStats

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0]
TTFT_BUCKETS += [2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]
ITL_BUCKETS += [5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0]
E2E_BUCKETS += [60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
FINISH_REASONS = ("stop", "length", "abort", "error")  # vLLM's FinishReason strings


class ServerMetrics:
    """The metric objects, in their own registry (several servers can share a process)."""

    def __init__(self, async_llm: AsyncLLM, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self._labels = {"model_name": model_name, "engine": "0"}
        gauge, counter = self._labelled(Gauge), self._labelled(Counter)
        histogram = self._labelled(Histogram)

        self.num_running = gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.num_waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage = gauge("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use.")
        self.prompt_tokens = counter(
            "vllm:prompt_tokens", "Prompt tokens of requests whose prefill completed."
        )
        self.generation_tokens = counter("vllm:generation_tokens", "Output tokens generated.")
        self.preemptions = counter("vllm:num_preemptions", "Preemptions (by recompute).")
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_hits = counter(
            "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache."
        )
        success = self._counters_by(
            "vllm:request_success", "Finished requests, by finish reason.",
            "finished_reason", FINISH_REASONS,
        )  # fmt: skip
        self.request_success = dict(zip(FINISH_REASONS, success))
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", buckets=TTFT_BUCKETS
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Time between two output tokens.",
            buckets=ITL_BUCKETS,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Arrival to last token.", buckets=E2E_BUCKETS
        )
        engine = async_llm.engine
        self._spec_seen = engine.spec_decoding_stats
        if self._spec_seen is not None:  # speculative decoding is on
            self._spec_seen = self._spec_seen.copy()
            self._make_spec_decode_counters()
        self._prefix_seen = PrefixCacheStats()  # already counted (the engine's are zero)
        self._engine = engine
        async_llm.step_listeners.append(self.on_step)
        async_llm.abort_listeners.append(self.on_abort)
        async_llm.error_listeners.append(self.on_error)

    def on_step(self, record: StepRecord, outputs: list[RequestOutput]) -> None:
        """Engine thread, after each step."""
        step = record.stats
        self._set_gauges(step)
        self.prompt_tokens.inc(step.num_prompt_tokens)
        self.generation_tokens.inc(step.num_generation_tokens)
        self.preemptions.inc(len(step.preempted_ids))
        for output in outputs:
            self._observe_latencies(output)
            if output.finished:
                self._on_finished(output)
        self._count_prefix_cache(step.prefix_cache)
        if step.spec_decoding is not None:
            self._count_spec_decode(step.spec_decoding)

    def on_abort(self, request_id: str) -> None:
        """Engine thread, between steps: the queues and the pool just changed."""
        self.request_success["abort"].inc()
        self._set_gauges(self._engine.make_stats())

    def on_error(self, request_id: str) -> None:
        """Engine thread: a request ended with an error (the engine died, or this request
        failed alone)."""
        self.request_success["error"].inc()

    def _set_gauges(self, stats: StepStats) -> None:
        self.num_running.set(stats.num_running)
        self.num_waiting.set(stats.num_waiting + stats.num_preempted)
        self.kv_cache_usage.set(stats.kv_cache_usage)

    def _observe_latencies(self, output: RequestOutput) -> None:
        """Observe TTFT with the first new token and an ITL for each later one, as they
        happen (as vLLM does, once per step)."""
        # A stream's (DELTA) output carries only the new tokens; a plain request's
        # (FINAL_ONLY) one carries all of them, once: both are "the tokens not yet seen".
        num_new = len(output.outputs[0].token_ids)
        metrics = output.metrics
        if metrics is None or num_new == 0:
            return
        times = metrics.token_times
        first_new = len(times) - num_new
        if first_new == 0 and metrics.ttft is not None:
            self.ttft.observe(metrics.ttft)
        for i in range(max(first_new, 1), len(times)):
            self.itl.observe(times[i] - times[i - 1])

    def _on_finished(self, output: RequestOutput) -> None:
        reason = output.outputs[0].finish_reason or "stop"
        self.request_success[reason].inc()
        if output.metrics is not None and output.metrics.e2e_latency is not None:
            self.e2e.observe(output.metrics.e2e_latency)

    def _count_prefix_cache(self, totals: PrefixCacheStats) -> None:
        seen = self._prefix_seen
        if totals.num_queried_tokens < seen.num_queried_tokens:  # the cache was reset
            seen = PrefixCacheStats()
        self.prefix_queries.inc(totals.num_queried_tokens - seen.num_queried_tokens)
        self.prefix_hits.inc(totals.num_hit_tokens - seen.num_hit_tokens)
        self._prefix_seen = totals

    def _labelled(self, kind):
        """A maker of ``kind`` (Gauge, Counter, Histogram) metrics in this registry, with
        the server's labels filled in: ``make(name, doc, **options)``."""

        def make(name: str, doc: str, **options):
            metric = kind(name, doc, list(self._labels), registry=self.registry, **options)
            return metric.labels(**self._labels)

        return make

    def _counters_by(self, name: str, doc: str, label: str, values) -> list[Counter]:
        """One counter with an extra label, as one child per value (in order)."""
        counter = Counter(name, doc, [*self._labels, label], registry=self.registry)
        return [counter.labels(**self._labels, **{label: value}) for value in values]

    def _make_spec_decode_counters(self) -> None:
        counter = self._labelled(Counter)
        self.spec_drafts = counter(
            "vllm:spec_decode_num_drafts", "Verifications: requests that had drafts, per step."
        )
        self.spec_draft_tokens = counter(
            "vllm:spec_decode_num_draft_tokens", "Draft tokens proposed."
        )
        self.spec_accepted_tokens = counter(
            "vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted."
        )
        self.spec_accepted_per_pos = self._counters_by(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens, by position in the draft.",
            "position",
            [str(i) for i in range(self._spec_seen.num_spec_tokens)],
        )

    def _count_spec_decode(self, totals: SpecDecodingStats) -> None:
        new = totals - self._spec_seen
        self.spec_drafts.inc(new.num_drafts)
        self.spec_draft_tokens.inc(new.num_draft_tokens)
        self.spec_accepted_tokens.inc(new.num_accepted_tokens)
        for counter, n in zip(self.spec_accepted_per_pos, new.num_accepted_tokens_per_pos):
            counter.inc(n)
        self._spec_seen = totals
