"""From sampled token ids to what the user sees (vLLM's ``OutputProcessor``).

Appends each request's new tokens, decodes them, decides whether the request stops (EOS,
a stop token id or stop string, ``max_tokens``, ``max_model_len``) and builds the
`RequestOutput` its ``output_kind`` asks for, with the logprobs the request asked for
(the model runner computed them; here each token gets its text). The engine then tells
the scheduler which requests finished. This is the one place stops are decided: the
engine, the CLI and any server see the same text. (The sampler's part: EOS and stop ids
are masked before ``min_tokens``, see sampler.py.)
"""

from __future__ import annotations

from dataclasses import dataclass

from minivllm.detokenizer import Detokenizer
from minivllm.outputs import (
    CompletionOutput,
    ModelRunnerOutput,
    PromptLogprobs,
    RequestOutput,
    SampleLogprobs,
)
from minivllm.sampling_params import RequestOutputKind
from minivllm.sequence import FinishReason, Sequence
from minivllm.stats import TokenCounts


@dataclass
class StopDecision:
    reason: FinishReason
    stop_reason: str | int | None = None  # the stop string or stop token id that fired


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: frozenset[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.detokenizers: dict[str, Detokenizer] = {}
        # Each request's token ids that stop it once it has ``min_tokens`` outputs: its
        # stop token ids, and EOS unless it ignores EOS; one set lookup per token.
        self.stop_token_ids: dict[str, frozenset[int]] = {}
        # Of the requests that asked: one dict per output token, and per prompt token
        # (None for the first, which nothing predicts).
        self.logprobs: dict[str, SampleLogprobs] = {}
        self.prompt_logprobs: dict[str, PromptLogprobs] = {}
        # DELTA requests whose prompt logprobs went out (with their first output). Kept
        # until the request ends: a preempted request's recomputed prompt gives its rows
        # again, to be recognised as already kept, not sent twice.
        self.prompt_logprobs_sent: set[str] = set()

    def add_request(self, seq: Sequence) -> None:
        params = seq.sampling_params
        # No text asked for: a detokenizer without a tokenizer only counts the tokens.
        tokenizer = self.tokenizer if params.detokenize else None
        self.detokenizers[seq.request_id] = Detokenizer(tokenizer, params)
        eos = frozenset() if params.ignore_eos else self.eos_token_ids
        self.stop_token_ids[seq.request_id] = eos | frozenset(params.stop_token_ids)
        if seq.sampling_params.logprobs is not None:
            self.logprobs[seq.request_id] = []
        if seq.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs[seq.request_id] = [None]

    def abort_request(self, request_id: str) -> None:
        self.detokenizers.pop(request_id, None)
        self.stop_token_ids.pop(request_id, None)
        self.logprobs.pop(request_id, None)
        self.prompt_logprobs.pop(request_id, None)
        self.prompt_logprobs_sent.discard(request_id)

    def process(
        self, seq: Sequence, runner_output: ModelRunnerOutput, now: float, counts: TokenCounts
    ) -> StopDecision | None:
        """``seq``'s part of a step's output: its logprobs, then its new tokens up to the
        first stop. ``counts`` learns how many tokens it kept."""
        if runner_output.logprobs or runner_output.prompt_logprobs:
            self.record_logprobs(seq, runner_output)
        num_before = seq.num_output_tokens
        new_tokens = runner_output.sampled_token_ids.get(seq.request_id, ())
        stop = self.append_tokens(seq, new_tokens, now)
        counts.add(seq, seq.num_output_tokens - num_before)
        return stop

    def record_logprobs(self, seq: Sequence, runner_output: ModelRunnerOutput) -> None:
        """Keep this step's logprobs of ``seq``, if it asked, with each token's text. A
        prompt recomputed after a preemption gives rows already kept: they are skipped."""
        request_id = seq.request_id
        detokenize = seq.sampling_params.detokenize
        if request_id in runner_output.logprobs:
            rows = runner_output.logprobs[request_id]
            self.logprobs[request_id] += self._decoded(rows, detokenize)
        if request_id in runner_output.prompt_logprobs:
            start, rows = runner_output.prompt_logprobs[request_id]
            kept = self.prompt_logprobs[request_id]
            assert start <= len(kept), "prompt logprobs arrive in order"
            kept += self._decoded(rows[len(kept) - start :], detokenize)

    def _decoded(self, rows: SampleLogprobs, detokenize: bool) -> SampleLogprobs:
        """Each token's text on its own, as vLLM shows it (`convert_tokens_to_string`),
        unless the request asked for no text."""
        if self.tokenizer is not None and detokenize:
            for row in rows:
                for token_id, logprob in row.items():
                    token = self.tokenizer.convert_ids_to_tokens(token_id)
                    logprob.decoded_token = self.tokenizer.convert_tokens_to_string([token])
        return rows

    def append_tokens(self, seq: Sequence, token_ids: list[int], now: float) -> StopDecision | None:
        """Add the step's new tokens one at a time; the first stop ends the request and
        drops any tokens after it."""
        for token in token_ids:
            seq.append_token(token, now)
            stop = self._check_stop(seq)
            if stop is not None:
                return stop
        return None

    def _check_stop(self, seq: Sequence) -> StopDecision | None:
        """vLLM's order: nothing stops a request before ``min_tokens`` but a length limit;
        from there, EOS or a stop token id, else a stop string in the new text."""
        detokenizer = self.detokenizers[seq.request_id]
        stop = self._check_stop_token(seq)
        stop_string = detokenizer.update(seq.token_ids[-1], stopped_by_token=stop is not None)
        if stop is None and stop_string is None and self._reached_length(seq):
            stop = StopDecision(FinishReason.LENGTH)
        if stop is not None:
            # The text an unfinished last character held back comes out now: it may
            # complete a stop string too.
            stop_string = detokenizer.finish()
        if stop_string is not None:
            return StopDecision(FinishReason.STOP, stop_string)
        return stop

    def _reached_length(self, seq: Sequence) -> bool:
        max_tokens = seq.sampling_params.max_tokens
        if max_tokens is not None and seq.num_output_tokens >= max_tokens:
            return True
        return seq.num_tokens >= self.max_model_len

    def _check_stop_token(self, seq: Sequence) -> StopDecision | None:
        token = seq.token_ids[-1]
        if token not in self.stop_token_ids[seq.request_id]:
            return None  # most tokens: one set lookup
        params = seq.sampling_params
        if seq.num_output_tokens < params.min_tokens:
            return None
        if token in self.eos_token_ids and not params.ignore_eos:
            return StopDecision(FinishReason.STOP)
        return StopDecision(FinishReason.STOP, token)

    @staticmethod
    def failed_output(request_id: str, seq: Sequence | None, error: Exception) -> RequestOutput:
        """The last output of a request that failed inside a step: finished, with
        finish_reason "error" and what went wrong."""
        return RequestOutput(
            request_id=request_id,
            prompt=seq.prompt if seq is not None else None,
            prompt_token_ids=seq.prompt_token_ids if seq is not None else [],
            outputs=[CompletionOutput(0, "", [], finish_reason=FinishReason.ERROR.value)],
            finished=True,
            metrics=seq.metrics if seq is not None else None,
            error=f"{type(error).__name__}: {error}",
        )

    def make_output(self, seq: Sequence) -> RequestOutput | None:
        """What to report for ``seq`` after this step (None: nothing, for FINAL_ONLY until
        the end, and for DELTA after a step that gave it no token, e.g. a prefill chunk).
        A finished request's state is dropped here."""
        kind = seq.sampling_params.output_kind
        finished = seq.is_finished
        request_id = seq.request_id
        detokenizer = self.detokenizers[request_id]
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        nothing_new = not detokenizer.has_unstreamed_tokens(seq.num_output_tokens)
        if kind is RequestOutputKind.DELTA and not finished and nothing_new:
            return None
        if finished:
            del self.detokenizers[request_id]
            del self.stop_token_ids[request_id]
        if kind is RequestOutputKind.DELTA:
            text, token_ids = detokenizer.take_delta(seq.token_ids, seq.num_prompt_tokens, finished)
        else:
            text, token_ids = detokenizer.text_to_show(finished), seq.output_token_ids
        logprobs = prompt_logprobs = None  # most requests ask for neither
        if request_id in self.logprobs or request_id in self.prompt_logprobs:
            logprobs, prompt_logprobs = self._logprobs_to_report(seq, len(token_ids), finished)
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=token_ids,
            finish_reason=seq.finish_reason.value if seq.finish_reason else None,
            stop_reason=seq.stop_reason,
            logprobs=logprobs,
        )
        return RequestOutput(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            metrics=seq.metrics,
            num_cached_tokens=seq.num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
        )

    def _logprobs_to_report(
        self, seq: Sequence, num_tokens: int, finished: bool
    ) -> tuple[SampleLogprobs | None, PromptLogprobs | None]:
        """The dicts of the last ``num_tokens`` output tokens (all of them but DELTA's),
        and the prompt's: DELTA hands those out once, with the first output."""
        request_id = seq.request_id
        logprobs = self.logprobs.get(request_id)
        if logprobs is not None:
            # A stop may have dropped the step's tokens after it: they have no place.
            num_output_tokens = seq.num_output_tokens
            logprobs = logprobs[num_output_tokens - num_tokens : num_output_tokens]
        prompt_logprobs = self.prompt_logprobs.get(request_id)
        if seq.sampling_params.output_kind is RequestOutputKind.DELTA:
            if request_id in self.prompt_logprobs_sent:
                prompt_logprobs = None
            elif prompt_logprobs is not None:
                self.prompt_logprobs_sent.add(request_id)
        if finished:
            self.logprobs.pop(request_id, None)
            self.prompt_logprobs.pop(request_id, None)
            self.prompt_logprobs_sent.discard(request_id)
        return logprobs, prompt_logprobs
