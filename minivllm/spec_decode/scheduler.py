"""The scheduler with speculative decoding: a `Scheduler` policy by subclass, as
`AsyncScheduler` is (vLLM keeps its scheduling policies the same way).

A decode may carry draft tokens: the budget and blocks left over once every real token is
placed (`Scheduler._schedule_leftover`) extend decodes to ``1 + num_drafts`` tokens, and
`update_from_output` rolls ``num_computed_tokens`` back past the rejected ones. The base
scheduler knows nothing of drafts.
"""

from __future__ import annotations

import time

from minivllm.kv_cache_manager import KVCacheManager
from minivllm.outputs import ModelRunnerOutput
from minivllm.scheduler import Scheduler
from minivllm.scheduler_output import SchedulerOutput
from minivllm.sequence import Sequence
from minivllm.spec_decode.ngram_proposer import NgramProposer
from minivllm.spec_decode.stats import SpecDecodingStats


class SpecDecodeScheduler(Scheduler):
    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        clock=time.perf_counter,
        max_model_len: int | None = None,
        proposer: NgramProposer | None = None,
    ) -> None:
        """``proposer`` makes the drafts; ``max_model_len`` caps them."""
        assert proposer is not None and max_model_len is not None
        super().__init__(kv_cache_manager, max_num_seqs, max_num_batched_tokens, clock)
        self.max_model_len = max_model_len
        self.proposer = proposer
        self.spec_decoding_stats = SpecDecodingStats(proposer.k)

    @classmethod
    def from_config(cls, config, kv_cache_manager, max_model_len, clock) -> Scheduler:
        spec = config.speculative_config
        proposer = NgramProposer(
            spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max
        )
        return cls(
            kv_cache_manager, config.max_num_seqs, config.max_num_batched_tokens, clock,
            max_model_len, proposer,
        )  # fmt: skip

    def _schedule_leftover(self, out: SchedulerOutput, budget: int) -> None:
        """Extend scheduled decodes with draft tokens, oldest first, out of what is left of
        the budget and the pool once every real token is placed. Drafts are optional work:
        they never preempt anyone, never delay an admission, and are dropped first when
        the pool is tight (vLLM schedules them with the running request, before waiting
        ones; here they come last, so the pool decides simply)."""
        for seq in list(out.scheduled_seqs):
            if out.is_prefill[seq.request_id] or not _may_draft(seq):
                continue
            # What is left of the budget; and each draft can become one more output token:
            # stop at max_tokens and at max_model_len (its last position is never computed).
            max_drafts = min(budget, self.max_model_len - 1 - seq.num_tokens)
            if seq.sampling_params.max_tokens is not None:
                max_drafts = min(
                    max_drafts, seq.sampling_params.max_tokens - 1 - seq.num_output_tokens
                )
            drafts = self.proposer.propose(seq.token_ids, max_drafts)  # none if max_drafts < 1
            if not drafts:
                continue
            num_new = out.num_scheduled_tokens[seq.request_id] + len(drafts)
            if not self.kv_cache_manager.allocate_slots(seq, num_new):
                continue  # no room in the pool: this request decodes one token, as usual
            out.add_draft_tokens(seq, drafts)
            budget -= len(drafts)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> None:
        """Of ``d`` drafts, the first ``len(sampled) - 1`` were accepted; the rejected
        ones' keys and values are garbage. ``num_computed_tokens`` stops before them (their
        slots are overwritten when those positions are computed again), the blocks that
        held nothing else go back to the pool, and the blocks filled by accepted drafts are
        registered (prefix caching): they joined the known tokens only with this output."""
        super().update_from_output(scheduler_output, model_runner_output)
        drafts_of = scheduler_output.scheduled_spec_decode_tokens
        for seq in scheduler_output.scheduled_seqs if drafts_of else ():
            drafts = drafts_of.get(seq.request_id)
            if not drafts:
                continue
            num_accepted = len(model_runner_output.sampled_token_ids[seq.request_id]) - 1
            seq.num_computed_tokens -= len(drafts) - num_accepted
            self.spec_decoding_stats.observe_draft(len(drafts), num_accepted)
            self.kv_cache_manager.free_surplus_blocks(seq)
            self.kv_cache_manager.cache_full_blocks(seq)


def _may_draft(seq: Sequence) -> bool:
    """Whether drafts can be verified for ``seq`` with the target distribution exact:
    not while ``min_tokens`` still bans EOS and stop tokens (that mask depends on the
    position), and not with ``min_p`` or penalties (which depend on the tokens before
    each draft; vLLM leaves them out too). Nor for a request that asked for ``logprobs``:
    it decodes one token a step, so each token's logprobs come from the one row that
    sampled it."""
    params = seq.sampling_params
    return (
        seq.num_output_tokens >= params.min_tokens
        and params.min_p == 0
        and not params.has_penalties
        and params.logprobs is None
    )
