"""`LLM`: the offline, batch-in / batch-out entry point (vLLM's `LLM` class)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from tqdm import tqdm  # plain text bar: works in terminals and notebooks alike

from minivllm.chat import chat_prompt
from minivllm.config import EngineConfig
from minivllm.engine import LLMEngine
from minivllm.input_processor import Prompt
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

if TYPE_CHECKING:  # beam search is a request group, loaded when used (request_groups.py)
    from minivllm.beam_search import BeamSearchOutput


class LLM:
    """Generate text for a batch of prompts with continuous batching.

    ``LLM()`` loads the bundled SmolLM2-135M-Instruct; ``LLM(model="path")`` any local
    Llama / Mistral / Qwen2 / Qwen3 checkpoint. Keyword options are `EngineConfig`'s
    (``block_size``, ``num_kv_blocks``, ``max_num_seqs``, ``max_num_batched_tokens``,
    ``max_model_len``, ``attention_backend``, ``dtype``, ``device``, ``seed``,
    ``tensor_parallel_size``, ``quantization``, ...). ``quantization="int8"`` or ``"gguf"``
    holds the weights in fewer bytes (docs/tutorial/quantization.md).
    ``tensor_parallel_size=2`` splits the model across two worker processes; `close()`
    stops them (so do garbage collection and interpreter exit).

    ``num_threads`` sets torch's CPU threads for the whole process (``torch.set_num_threads``;
    default: torch's, one per core). On a CPU shared with other busy processes, 1 is often
    much faster: several threads wait on each other at every small op.
    """

    def __init__(self, model: str | None = None, num_threads: int | None = None, **options):
        if num_threads is not None:
            if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
                raise ValueError(f"num_threads must be a positive int, got {num_threads!r}")
            torch.set_num_threads(num_threads)
        self.llm_engine = LLMEngine(EngineConfig(model=model, **options))
        self._request_counter = 0

    def get_tokenizer(self):
        return self.llm_engine.get_tokenizer()

    def close(self) -> None:
        """Stop the engine's worker processes (tensor parallelism); a no-op otherwise."""
        self.llm_engine.close()

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the prompts' order.

        ``sampling_params`` is one `SamplingParams` for all prompts or one per prompt. All
        prompts are validated before any is queued, so a bad one leaves nothing behind."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(
                f"got {len(sampling_params)} SamplingParams for {len(prompts)} prompts"
            )
        engine = self.llm_engine
        request_ids = []
        try:
            for prompt, params in zip(prompts, sampling_params):
                request_id = f"{self._request_counter}"
                self._request_counter += 1
                if params.output_kind is not RequestOutputKind.FINAL_ONLY:
                    params = _replace_kind(params, RequestOutputKind.FINAL_ONLY)
                engine.add_request(request_id, prompt, params)
                request_ids.append(request_id)
        except Exception:
            engine.abort_request(request_ids)
            raise
        return self._run_engine(request_ids, use_tqdm)

    def beam_search(
        self,
        prompts: Prompt | list[Prompt],
        params: BeamSearchParams,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """Beam search for every prompt (vLLM's `LLM.beam_search`); outputs come back in
        the prompts' order, each with its ``beam_width`` best beams, best first. The beams
        share their common past in the KV cache (beam_search.py). All prompts are checked
        before any is queued."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be BeamSearchParams, got {type(params).__name__}")
        engine = self.llm_engine
        request_ids = []
        try:
            for prompt in prompts:
                request_id = f"{self._request_counter}"
                self._request_counter += 1
                engine.add_beam_search_request(request_id, prompt, params)
                request_ids.append(request_id)
        except Exception:
            engine.abort_request(request_ids)
            raise
        convert = engine.request_groups["beam_search"].to_beam_search_output
        return [convert(o) for o in self._run_engine(request_ids, use_tqdm)]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, formatted with the
        tokenizer's chat template (``[{"role": "user", "content": "..."}]``)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [chat_prompt(self.get_tokenizer(), c) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm) as bar:
            try:
                while engine.has_unfinished_requests():
                    for output in engine.step():
                        if output.finished:
                            finished[output.request_id] = output
                            bar.update(1)
            except BaseException:  # a step raised (a worker died), or Ctrl-C: nothing of
                # this call stays queued for the next one; n > 1 and beam-search requests
                # go as whole groups, by the ids the caller gave
                engine.abort_request([r for r in request_ids if r not in finished])
                raise
        return [finished[r] for r in request_ids]


def _replace_kind(params: SamplingParams, kind: RequestOutputKind) -> SamplingParams:
    from dataclasses import replace

    return replace(params, output_kind=kind)
