"""Beam search on the paged KV cache: beams share their past, as in PagedAttention.

A beam-search request keeps ``beam_width`` *beams*, each an ordinary `Sequence` in the
scheduler. Every step each beam computes its newest token and returns the log-probabilities
of its ``2 * beam_width`` most likely next tokens (the logprobs machinery, logprobs.py;
the token the sampler picks is ignored). Once every beam has reported, its
`BeamSearchGroup` picks the next beams exactly as transformers' ``generate(num_beams=k)``
does (``_beam_search`` in transformers 5.24; numbers in float32, as there):

1. candidates: every beam's top tokens, scored ``beam's cum_logprob + token's logprob``;
   the best ``2k`` over all beams, best first;
2. of those, the ones among the first ``k`` that end (EOS, or ``max_tokens`` reached)
   become finished hypotheses, scored ``cum_logprob / num_output_tokens ** length_penalty``;
   the ``k`` best hypotheses are kept;
3. the first ``k`` candidates that do not end are the next beams;
4. the search stops when no beam is left, or (transformers' default
   ``early_stopping=False``) when ``k`` hypotheses are kept and the best beam, scored
   as if it ended now, would not beat the worst of them.

A beam chosen by several candidates is *forked*; one chosen by none is dropped. That is
where paging pays off (Kwon et al., SOSP 2023, section 4.4): a fork takes its parent's
block table, every block one reference more, and nothing is copied until one of them
writes into the shared partial last block (copy-on-write, kv_cache_manager.py).

Where each part lives, and why. The group is on the *output* side: it reads a step's
results and decides, as the output processor decides stops for other requests, so a
beam's sampled token is never appended; the group appends the token it chose instead.
`BeamSearchGroups` wires the decision through (`after_step`, called by the engine through
the request-group protocol, request_groups.py): dropped beams
finish like any stopped request (their blocks go back), and each fork goes to the
scheduler (`Scheduler.fork_request`), which asks the KV cache manager to share the
blocks. Copies are decided only when a beam is scheduled to write, by the manager, and
travel to the model runner in the next step's `SchedulerOutput`. So data still flows one
way: the group never touches blocks, the scheduler never reads logprobs. The fork itself
is made when decided, not at the next `schedule`: sharing takes no block, so waiting
gains nothing, and meanwhile the child would be a request in no queue (for an abort or
the stats to trip over). What does wait for the next step is every copy.

A beam that has reported waits, computing nothing, until its siblings have too. A
preempted beam drops its block references like any preempted request (the blocks it
shared stay with its siblings) and is recomputed when readmitted; its shared full blocks
are found again through their hashes (beams are marked ``shares_prompt``). Aborting the
request finishes every beam.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from minivllm.outputs import (
    CompletionOutput,
    Logprob,
    ModelRunnerOutput,
    RequestOutput,
    SampleLogprobs,
)
from minivllm.sampling_params import (
    MAX_LOGPROBS,
    BeamSearchParams,
    RequestOutputKind,
    SamplingParams,
)
from minivllm.sequence import FinishReason, Sequence
from minivllm.stats import TokenCounts


@dataclass
class BeamSearchSequence:
    """One returned beam (vLLM's ``BeamSearchSequence``): ``tokens`` include the prompt;
    ``logprobs`` has one dict per output token (its step's candidates); ``text`` is the
    output without a final EOS.

    One difference from vLLM's offline ``LLM.beam_search``: there ``text`` decodes all of
    ``tokens``, so it starts with the prompt; here it is the output alone, the text the
    HTTP route's choices carry (as vLLM's server sends them). vLLM's offline text is
    ``tokenizer.decode(seq.tokens)``."""

    tokens: list[int]
    logprobs: SampleLogprobs = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """vLLM's ``BeamSearchOutput``: the ``beam_width`` best beams of one prompt, best
    first."""

    sequences: list[BeamSearchSequence]


def beam_request_id(request_id: str, index: int) -> str:
    return f"beam{index}_{request_id}"


def beams_to_keep(beam_width: int, num_eos_tokens: int) -> int:
    """Candidates kept per step (transformers'): enough that ``beam_width`` of them go on
    even if every EOS id of every beam is among them."""
    return max(2, 1 + num_eos_tokens) * beam_width


@dataclass
class Beam:
    """A live beam: its sequence in the scheduler and its score so far."""

    seq: Sequence
    cum_logprob: np.float32
    logprobs: SampleLogprobs


@dataclass
class Hypothesis:
    """A finished beam, with its length-penalized score."""

    score: np.float32
    token_ids: list[int]  # output tokens, the last one included
    cum_logprob: np.float32
    logprobs: SampleLogprobs
    finish_reason: str


@dataclass
class Candidate:
    score: np.float32  # the beam's cum_logprob + this token's logprob
    beam: Beam
    token_id: int
    row: dict[int, Logprob]


@dataclass
class BeamStep:
    """What one decision asks of the engine: beams that end, and forks to make (each
    child's tokens are its parent's plus its own next one)."""

    dropped: list[Sequence] = field(default_factory=list)
    forks: list[tuple[Sequence, Sequence]] = field(default_factory=list)


class BeamSearchGroup:
    """One beam-search request: its live beams, the rows they reported this round, and
    the best finished hypotheses."""

    def __init__(
        self,
        request_id: str,
        params: BeamSearchParams,
        first_beam: Sequence,
        eos_token_ids: frozenset[int],
        max_tokens: int,
    ) -> None:
        """``first_beam``: the prompt's sequence; ``max_tokens``: the request's, capped by
        the model's length."""
        self.request_id = request_id
        self.params = params
        self.eos_token_ids = frozenset() if params.ignore_eos else eos_token_ids
        self.max_tokens = max_tokens
        self.num_candidates = beams_to_keep(params.beam_width, len(eos_token_ids))
        self.prompt = first_beam.prompt
        self.prompt_token_ids = first_beam.prompt_token_ids
        self.beams = [Beam(first_beam, np.float32(0.0), [])]
        self.rows: dict[str, dict[int, Logprob]] = {}  # this round's, by beam id
        self.hypotheses: list[Hypothesis] = []  # best first, at most beam_width
        self.num_output_tokens = 0  # of every live beam
        self.finished = False
        self._num_beams_made = 1

    @staticmethod
    def sampling_params(params: BeamSearchParams, num_eos_tokens: int) -> SamplingParams:
        """What each beam asks of the engine: its top candidates' logprobs. The sampled
        token is not used, and the group decides when a beam ends."""
        return SamplingParams(
            temperature=0.0,
            max_tokens=None,
            ignore_eos=True,
            logprobs=beams_to_keep(params.beam_width, num_eos_tokens),
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    @property
    def beam_ids(self) -> list[str]:
        return [beam.seq.request_id for beam in self.beams]

    def record(self, seq: Sequence, row: dict[int, Logprob]) -> bool:
        """Keep ``seq``'s logprobs for its next token; False if it had reported this round
        already (a beam recomputed after preemption reports the same row again: the first
        is kept)."""
        if seq.request_id in self.rows:
            return False
        self.rows[seq.request_id] = row
        return True

    @property
    def ready(self) -> bool:
        """Whether every live beam has reported this round."""
        return len(self.rows) == len(self.beams)

    def step(self, now: float) -> BeamStep:
        """Decide the next beams from this round's rows (transformers' order, module
        docstring): append each surviving beam's token, fork beams chosen more than once,
        drop the rest. Sets ``finished`` when the search is over (every beam dropped)."""
        assert self.ready and not self.finished
        k = self.params.beam_width
        candidates = self._top_candidates()
        self.num_output_tokens += 1
        at_max_length = self.num_output_tokens >= self.max_tokens
        ends = [at_max_length or c.token_id in self.eos_token_ids for c in candidates]
        penalty = np.float32(self.num_output_tokens**self.params.length_penalty)
        for c in [c for c, end in zip(candidates[:k], ends) if end]:
            self._add_hypothesis(c, penalty)
        chosen = [c for c, end in zip(candidates, ends) if not end][:k]
        if chosen and self._cannot_improve(chosen[0].score / penalty):
            chosen = []
        self.rows = {}
        return self._next_beams(chosen, now)

    def _top_candidates(self) -> list[Candidate]:
        """The best ``num_candidates`` continuations over all beams, best first (ties:
        the earlier beam, then the smaller token id, as a top-k over beam * vocab)."""
        candidates = []
        for beam in self.beams:
            row = self.rows[beam.seq.request_id]
            # The row holds the sampled token and the top ones: the top ones are enough.
            top = sorted(row.items(), key=lambda item: -item[1].logprob)[: self.num_candidates]
            for token_id, logprob in top:
                score = beam.cum_logprob + np.float32(logprob.logprob)
                candidates.append(Candidate(score, beam, token_id, row))
        order = {id(beam): i for i, beam in enumerate(self.beams)}
        candidates.sort(key=lambda c: (-c.score, order[id(c.beam)], c.token_id))
        return candidates[: self.num_candidates]

    def _add_hypothesis(self, c: Candidate, penalty: np.float32) -> None:
        ended_by_eos = c.token_id in self.eos_token_ids
        self.hypotheses.append(
            Hypothesis(
                score=c.score / penalty,
                token_ids=c.beam.seq.output_token_ids + [c.token_id],
                cum_logprob=c.score,
                logprobs=c.beam.logprobs + [c.row],
                finish_reason="stop" if ended_by_eos else "length",
            )
        )
        # A stable sort: an older hypothesis stays ahead of an equal newer one.
        self.hypotheses.sort(key=lambda h: -h.score)
        del self.hypotheses[self.params.beam_width :]

    def _cannot_improve(self, best_running_score: np.float32) -> bool:
        """transformers' stop with ``early_stopping=False``: all ``beam_width`` hypotheses
        are kept and the best beam, ended now, would not beat the worst of them."""
        if len(self.hypotheses) < self.params.beam_width:
            return False
        return not best_running_score > self.hypotheses[-1].score

    def _next_beams(self, chosen: list[Candidate], now: float) -> BeamStep:
        """Turn the chosen candidates into beams: a parent's first candidate extends it,
        each further one forks it; a beam with no candidate is dropped."""
        decision = BeamStep()
        extensions: dict[int, tuple[Sequence, int]] = {}  # id(parent) -> (parent, token)
        next_beams = []
        for c in chosen:
            parent = c.beam.seq
            if id(parent) not in extensions:
                extensions[id(parent)] = (parent, c.token_id)
                seq = parent
            else:  # forked from the parent's tokens as they are: extensions come after
                seq = self._fork_sequence(parent, c.token_id, now)
                decision.forks.append((parent, seq))
            next_beams.append(Beam(seq, c.score, c.beam.logprobs + [c.row]))
        for parent, token_id in extensions.values():
            parent.append_token(token_id, now)
        decision.dropped = [b.seq for b in self.beams if id(b.seq) not in extensions]
        self.beams = next_beams
        self.finished = not next_beams
        return decision

    def _fork_sequence(self, parent: Sequence, token_id: int, now: float) -> Sequence:
        """A new beam: ``parent``'s tokens so far and ``token_id`` (blocks come later, from
        the scheduler)."""
        request_id = beam_request_id(self.request_id, self._num_beams_made)
        self._num_beams_made += 1
        child = Sequence(
            request_id, parent.prompt_token_ids, parent.sampling_params, parent.prompt,
            parent.metrics.arrival_time,
        )  # fmt: skip
        child.token_ids.extend(parent.output_token_ids)
        child.append_token(token_id, now)
        child.shares_prompt = parent.shares_prompt
        return child

    def make_output(self, tokenizer) -> RequestOutput:
        """The finished request: one completion per hypothesis, best first."""
        completions = []
        for i, h in enumerate(self.hypotheses):
            text_ids = h.token_ids[:-1] if h.finish_reason == "stop" else h.token_ids
            completions.append(
                CompletionOutput(
                    index=i,
                    text=tokenizer.decode(text_ids) if tokenizer is not None else "",
                    token_ids=h.token_ids,
                    finish_reason=h.finish_reason,
                    logprobs=h.logprobs,
                    cumulative_logprob=float(h.cum_logprob),
                )
            )
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=completions,
            finished=True,
        )


def to_beam_search_output(output: RequestOutput) -> BeamSearchOutput:
    """A finished beam-search request's `RequestOutput` in vLLM's `BeamSearchOutput` shape."""
    return BeamSearchOutput(
        [
            BeamSearchSequence(
                tokens=output.prompt_token_ids + c.token_ids,
                logprobs=c.logprobs or [],
                cum_logprob=c.cumulative_logprob,
                text=c.text,
                finish_reason=c.finish_reason,
            )
            for c in output.outputs
        ]
    )


class BeamSearchGroups:
    """The beam-search requests in flight, by request id and by beam id: the request
    groups of this kind for one engine (request_groups.py)."""

    to_beam_search_output = staticmethod(to_beam_search_output)

    def __init__(self, engine=None) -> None:
        self.engine = engine
        self.groups: dict[str, BeamSearchGroup] = {}
        self.group_of: dict[str, BeamSearchGroup] = {}  # beam id -> its request's group

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.groups

    def add(self, group: BeamSearchGroup) -> None:
        self.groups[group.request_id] = group
        self.group_of.update(dict.fromkeys(group.beam_ids, group))

    def pop(self, request_id: str) -> BeamSearchGroup | None:
        group = self.groups.pop(request_id, None)
        for beam_id in group.beam_ids if group else ():
            del self.group_of[beam_id]
        return group

    def update_beams(self, group: BeamSearchGroup, step: BeamStep) -> None:
        """After a decision: the dropped beams leave the index, the forks join it."""
        for seq in step.dropped:
            del self.group_of[seq.request_id]
        for _, child in step.forks:
            self.group_of[child.request_id] = group

    def add_request(self, request_id: str, prompt, params: BeamSearchParams, arrival_time) -> None:
        """Queue a beam-search request in the engine: its first beam, the prompt. Bad input
        raises ValueError here; nothing is queued then."""
        engine = self.engine
        config, eos_token_ids = engine.config, engine.model_info.eos_token_ids
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be BeamSearchParams, got {type(params).__name__}")
        if config.scheduling_policy != "continuous":
            raise ValueError("beam search needs the continuous scheduling policy")
        if params.beam_width > config.max_num_seqs:
            raise ValueError(
                f"beam_width={params.beam_width} is more than "
                f"max_num_seqs={config.max_num_seqs}: the beams run side by side"
            )
        num_logprobs = beams_to_keep(params.beam_width, len(eos_token_ids))
        if num_logprobs > MAX_LOGPROBS:
            raise ValueError(
                f"beam_width={params.beam_width} asks each beam for {num_logprobs} logprobs "
                f"with this model's {len(eos_token_ids)} EOS ids, more than {MAX_LOGPROBS}"
            )
        engine.check_new_request_id(request_id)
        first_id = beam_request_id(request_id, 0)
        if first_id in engine.scheduler.requests:
            raise ValueError(f"a beam id of request {request_id!r} is already in flight")
        arrival_time = engine.clock() if arrival_time is None else arrival_time
        sampling_params = BeamSearchGroup.sampling_params(params, len(eos_token_ids))
        seq = engine.input_processor.process(first_id, prompt, sampling_params, arrival_time)
        # Beams share blocks through forks; a preempted one finds its shared full blocks
        # again by their hashes (unless sharing is off: then nothing is shared).
        seq.shares_prompt = config.share_forked_blocks
        max_tokens = min(params.max_tokens, max(1, engine.max_model_len - seq.num_prompt_tokens))
        self.add(BeamSearchGroup(request_id, params, seq, eos_token_ids, max_tokens))
        engine.scheduler.add_request(seq)

    def consume(self, seq: Sequence, runner_output: ModelRunnerOutput, counts: TokenCounts) -> bool:
        """A beam's row goes to its group, which decides; its sampled token is not used."""
        group = self.group_of.get(seq.request_id)
        if group is None:
            return False
        rows = runner_output.logprobs.get(seq.request_id)
        if rows and group.record(seq, rows[0]):
            # One token generated for this beam (vLLM counts each beam's step as a
            # one-token request); the first row ends the prompt's prefill.
            counts.num_generation_tokens += 1
            if seq.num_output_tokens == 0:
                counts.num_prompt_tokens += seq.num_prompt_tokens
        return True

    def after_step(self, outputs: list[RequestOutput], now: float) -> list[RequestOutput]:
        """Each request whose beams have all reported picks its next beams; the scheduler
        finishes the dropped ones and makes the forks. The searches that are over report."""
        scheduler = self.engine.scheduler
        for group in [g for g in self.groups.values() if g.ready]:
            try:
                step = group.step(now)
            except Exception as e:  # this search fails alone (its beams are freed)
                seq = group.beams[0].seq if group.beams else None
                self.abort(group.request_id)
                outputs = outputs + [self.engine.fail_request(group.request_id, seq, e)]
                continue
            self.update_beams(group, step)
            if step.dropped:  # pruned: nobody reports them
                scheduler.finish_requests([s.request_id for s in step.dropped], FinishReason.ABORT)
            for parent, child in step.forks:
                scheduler.fork_request(parent, child)
            if group.finished:
                self.pop(group.request_id)
                outputs = outputs + [group.make_output(self.engine.model_info.tokenizer)]
        return outputs

    def abort(self, request_id: str) -> bool | None:
        """Abort a search: every live beam. A beam's own id is not a request (False)."""
        group = self.pop(request_id)
        if group is not None:
            self.engine.scheduler.finish_requests(group.beam_ids, FinishReason.ABORT)
            return True
        return False if request_id in self.group_of else None

    def owner(self, request_id: str) -> str | None:
        group = self.group_of.get(request_id)
        return group.request_id if group is not None else None

    @property
    def in_lockstep(self) -> bool:
        """Beams are chosen from a step's logprobs: the next step waits for them."""
        return bool(self.groups)
