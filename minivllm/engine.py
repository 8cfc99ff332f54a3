"""`LLMEngine`: wires sequence state, the scheduler, the model runner and the sampler.

One `step()` = schedule, run the model once on the flattened batch, append the sampled
tokens, retire finished requests, report progress. Requests can be added or aborted
between any two steps; that is all "continuous batching" needs from the outside.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterable
from dataclasses import asdict

import torch

from minivllm.attention import get_backend
from minivllm.config import EngineConfig
from minivllm.detokenizer import Detokenizer
from minivllm.kv_cache_manager import KVCacheManager, cdiv
from minivllm.metrics import StepStats
from minivllm.model_runner import ModelRunner
from minivllm.models.loader import load_model, load_tokenizer
from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.sampling_params import RequestOutputKind, SamplingParams
from minivllm.scheduler import Scheduler, SchedulerOutput
from minivllm.sequence import FinishReason, Sequence, SequenceStatus
from minivllm.static_scheduler import StaticBatchScheduler

Prompt = str | dict  # text, or {"prompt_token_ids": [...]} like vLLM's TokensPrompt


class LLMEngine:
    """The engine loop, driven one `step()` at a time (vLLM's offline `LLMEngine`)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        device, dtype = config.torch_device, config.torch_dtype
        backend_cls = get_backend(config.attention_backend_name)
        backend_cls.check_supported(dtype, device)
        model_path = config.model
        if model_path is None:
            from minivllm.model_files import default_model_path

            model_path = default_model_path()
        self.model, hf_config = load_model(model_path, backend_cls(), dtype, device)
        self.tokenizer = load_tokenizer(model_path)
        self.eos_token_ids = _eos_token_ids(model_path, hf_config, self.tokenizer)
        model_config = self.model.config

        num_kv_blocks = config.num_kv_blocks or self._blocks_for_bytes(config.kv_cache_memory_bytes)
        capacity = num_kv_blocks * config.block_size
        max_model_len = config.max_model_len or min(model_config.max_position_embeddings, capacity)
        if max_model_len > model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's limit of "
                f"{model_config.max_position_embeddings} positions"
            )
        if max_model_len > capacity:
            raise ValueError(
                f"max_model_len={max_model_len} does not fit in the KV cache: num_kv_blocks="
                f"{num_kv_blocks} x block_size={config.block_size} = {capacity} tokens"
            )
        self.max_model_len = max_model_len
        self.num_kv_blocks = num_kv_blocks

        self.kv_cache_manager = KVCacheManager(
            num_kv_blocks, config.block_size, config.enable_prefix_caching
        )
        if config.scheduling_policy == "static":  # for comparison only: see static_scheduler.py
            self.scheduler = StaticBatchScheduler(
                self.kv_cache_manager, config.max_num_seqs, max_model_len
            )
        else:
            self.scheduler = Scheduler(
                self.kv_cache_manager, config.max_num_seqs, config.max_num_batched_tokens
            )
        self.model_runner = ModelRunner(self.model, num_kv_blocks, config.block_size, dtype, device)
        self.requests: dict[str, Sequence] = {}
        self.detokenizers: dict[str, Detokenizer] = {}
        self._seed_rng = random.Random(config.seed)  # seeds requests that bring no seed
        self.last_step: SchedulerOutput | None = None  # for walkthroughs and metrics
        self.step_log: list[StepStats] | None = None  # set to [] to record every step

    @classmethod
    def from_engine_args(cls, config: EngineConfig) -> LLMEngine:
        return cls(config)

    def _blocks_for_bytes(self, num_bytes: int) -> int:
        c = self.model.config
        element_size = torch.empty((), dtype=self.config.torch_dtype).element_size()
        bytes_per_block = 2 * c.num_layers * self.config.block_size * c.num_kv_heads * c.head_dim
        return max(1, num_bytes // (bytes_per_block * element_size))

    # --- requests in -------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request. Bad input raises ValueError here; nothing is queued then."""
        request_id = str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in flight")
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        text, token_ids = self._tokenize(prompt)
        self._check_prompt(token_ids)
        generator = None
        if not params.greedy:
            seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
            generator = torch.Generator(device=self.model_runner.device).manual_seed(seed)
        seq = Sequence(request_id, token_ids, params, text, arrival_time, generator)
        self.requests[request_id] = seq
        self.detokenizers[request_id] = Detokenizer(self.tokenizer, params)
        self.scheduler.add(seq)

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass {'prompt_token_ids': [...]}")
            return prompt, self.tokenizer(prompt).input_ids
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        raise ValueError(
            f"a prompt must be a str or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}"
        )

    def _check_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("prompt is empty (0 tokens)")
        vocab_size = self.model.config.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
        if bad:
            raise ValueError(
                f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})"
            )
        # The pool first: when max_model_len is the cache's capacity (the default), this
        # names the real limit, blocks needed against blocks in the pool.
        blocks_needed = cdiv(len(token_ids), self.config.block_size)
        if blocks_needed > self.num_kv_blocks:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens and needs {blocks_needed} KV blocks of "
                f"{self.config.block_size} tokens, but the cache has only "
                f"num_kv_blocks={self.num_kv_blocks}"
            )
        if len(token_ids) > self.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens, more than max_model_len={self.max_model_len}"
            )

    def abort_request(self, request_id: str | Iterable[str]) -> bool | list[bool]:
        """Stop requests in any state and free their blocks at once.

        Returns True per request that was in flight, False for an unknown or finished id
        (a no-op, as in vLLM)."""
        if not isinstance(request_id, str):
            return [self.abort_request(r) for r in request_id]
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.finish(seq, FinishReason.ABORT, time.perf_counter())
        self.detokenizers.pop(request_id)
        return True

    # --- the loop ------------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def step(self) -> list[RequestOutput]:
        """Schedule one batch, run it, and report every request that made progress."""
        start = time.perf_counter()
        scheduled = self.scheduler.schedule()
        self.last_step = scheduled
        if scheduled.is_empty:
            return []
        now = time.perf_counter()
        for seq in scheduled.seqs:
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = now
        sampled = self.model_runner.execute(scheduled)
        now = time.perf_counter()
        self.scheduler.update_computed(scheduled)

        outputs = []
        for seq in scheduled.seqs:
            if seq in sampled:
                seq.append_token(sampled[seq], now)
                self._check_stop(seq, now)
            output = self._make_output(seq)
            if output is not None:
                outputs.append(output)
            if seq.is_finished:
                del self.requests[seq.request_id]
                del self.detokenizers[seq.request_id]
        if self.step_log is not None:
            self.step_log.append(StepStats.capture(self, scheduled, start, time.perf_counter()))
        return outputs

    def _check_stop(self, seq: Sequence, now: float) -> None:
        params = seq.sampling_params
        token = seq.token_ids[-1]
        stop_string = self.detokenizers[seq.request_id].update(seq.output_token_ids)
        if seq.num_output_tokens >= params.min_tokens:
            if token in self.eos_token_ids and not params.ignore_eos:
                return self.scheduler.finish(seq, FinishReason.STOP, now)
            if token in params.stop_token_ids:
                return self.scheduler.finish(seq, FinishReason.STOP, now, stop_reason=token)
            if stop_string is not None:
                return self.scheduler.finish(seq, FinishReason.STOP, now, stop_reason=stop_string)
        if params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
            return self.scheduler.finish(seq, FinishReason.LENGTH, now)
        if seq.num_tokens >= self.max_model_len:
            return self.scheduler.finish(seq, FinishReason.LENGTH, now)

    def _make_output(self, seq: Sequence) -> RequestOutput | None:
        kind = seq.sampling_params.output_kind
        finished = seq.is_finished
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        detokenizer = self.detokenizers[seq.request_id]
        if kind is RequestOutputKind.DELTA:
            text, token_ids = detokenizer.take_delta(seq.output_token_ids, finished)
        else:
            text, token_ids = detokenizer.stable_text(finished), seq.output_token_ids
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=token_ids,
            finish_reason=seq.finish_reason.value if seq.finish_reason else None,
            stop_reason=seq.stop_reason,
        )
        return RequestOutput(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            metrics=seq.metrics,
            num_cached_tokens=seq.num_cached_tokens,
        )

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix and the hit-rate counters (like vLLM's), e.g. between
        benchmark runs. Returns False, doing nothing, while requests are in flight."""
        return self.kv_cache_manager.reset_prefix_cache()

    # --- introspection -------------------------------------------------------------------

    def stats(self) -> dict:
        """A snapshot of the engine's queues and KV pool, e.g. for a progress display."""
        prefix_cache = self.kv_cache_manager.prefix_cache_stats
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": sum(s.status is SequenceStatus.WAITING for s in self.scheduler.waiting),
            "num_preempted": sum(
                s.status is SequenceStatus.PREEMPTED for s in self.scheduler.waiting
            ),
            "num_free_blocks": self.kv_cache_manager.num_free_blocks,
            "num_kv_blocks": self.num_kv_blocks,
            "num_preemptions_total": self.scheduler.num_preemptions,
            # Prefix caching: tokens looked up at each admission (a readmission after a
            # preemption too), and of those, found in the cache instead of computed.
            "prefix_cache_query_tokens": prefix_cache.num_queried_tokens,
            "prefix_cache_hit_tokens": prefix_cache.num_hit_tokens,
            "prefix_cache_hit_rate": prefix_cache.hit_rate,
            "config": asdict(self.config),
        }


def _eos_token_ids(model_path, hf_config, tokenizer) -> frozenset[int]:
    """End-of-sequence ids from the generation config (may be several) and the tokenizer."""
    from transformers import GenerationConfig

    ids: set[int] = set()
    try:
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:
        eos = getattr(hf_config, "eos_token_id", None)
    if eos is not None:
        ids.update(eos if isinstance(eos, list) else [eos])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
