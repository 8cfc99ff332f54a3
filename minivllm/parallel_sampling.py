"""Parallel sampling: ``n`` samples of one prompt (vLLM v1's ``ParentRequest``).

A request with ``SamplingParams(n=k)`` is not one sequence. `ParentRequests` fans it out into
``k`` child requests, each an ordinary ``n = 1`` sequence with its own random generator
(``seed + i`` for child ``i`` when a seed is given, so child ``i`` samples exactly what a
lone request with that seed would), and gathers their outputs back into one
`RequestOutput` whose ``outputs[i]`` is child ``i``'s. The scheduler never hears of
parents: children are admitted, preempted and finished like any other request. The
engine reaches this module only through the request-group protocol (request_groups.py).

The children share the prompt's KV blocks through the prefix cache: the scheduler
registers a block's hash as soon as a step that computes it is scheduled, so a sibling
admitted in the same step already finds it (kv_cache_manager.py). Children are marked
``shares_prompt``, which lets them hash and share blocks even when prefix caching is off.
"""

from __future__ import annotations

from dataclasses import replace

from minivllm.outputs import CompletionOutput, ModelRunnerOutput, RequestOutput
from minivllm.sampling_params import RequestOutputKind, SamplingParams
from minivllm.sequence import Sequence
from minivllm.stats import TokenCounts


def child_request_id(parent_id: str, index: int) -> str:
    return f"{index}_{parent_id}"  # vLLM's spelling


class ParentRequest:
    """One ``n > 1`` request: the ids and parameters of its children, and what each child
    reported last, to be handed out as one `RequestOutput`."""

    def __init__(self, request_id: str, sampling_params: SamplingParams) -> None:
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.child_ids = [child_request_id(request_id, i) for i in range(sampling_params.n)]
        self.index_of = {child_id: i for i, child_id in enumerate(self.child_ids)}
        self.latest: list[CompletionOutput | None] = [None] * sampling_params.n
        self.new: dict[int, CompletionOutput] = {}  # reported this step (DELTA)
        self.unfinished = set(self.child_ids)
        self.first_output: RequestOutput | None = None  # its prompt and metrics speak for all

    def child_params(self, index: int) -> SamplingParams:
        seed = self.sampling_params.seed
        return replace(self.sampling_params, n=1, seed=None if seed is None else seed + index)

    def record(self, output: RequestOutput) -> None:
        """Keep what one child reported this step, under its index."""
        index = self.index_of[output.request_id]
        completion = replace(output.outputs[0], index=index)
        self.latest[index] = self.new[index] = completion
        if output.finished:
            self.unfinished.discard(output.request_id)
        if self.first_output is None or index == 0:
            self.first_output = output

    @property
    def finished(self) -> bool:
        return not self.unfinished

    def make_output(self) -> RequestOutput | None:
        """This step's report: FINAL_ONLY, all ``n`` completions once every child finished;
        CUMULATIVE, all ``n`` as they stand (empty for a child with nothing yet); DELTA,
        only the children that produced something this step."""
        kind = self.sampling_params.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not self.finished:
            return None
        if kind is RequestOutputKind.DELTA:
            completions = [self.new[i] for i in sorted(self.new)]
        else:
            completions = [c or CompletionOutput(i, "", []) for i, c in enumerate(self.latest)]
        self.new = {}
        first = self.first_output
        return RequestOutput(
            request_id=self.request_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=completions,
            finished=self.finished,
            metrics=first.metrics,
            num_cached_tokens=first.num_cached_tokens,
            prompt_logprobs=first.prompt_logprobs,
        )


class ParentRequests:
    """The ``n > 1`` requests in flight, by parent id and by child id: the request groups
    of this kind for one engine (request_groups.py)."""

    def __init__(self, engine=None) -> None:
        self.engine = engine
        self.parents: dict[str, ParentRequest] = {}
        self.parent_of: dict[str, ParentRequest] = {}  # child id -> its parent

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.parents

    def add_request(self, request_id: str, prompt, params: SamplingParams, arrival_time) -> None:
        """Fan a new ``n > 1`` request out into ``n`` child requests, queued in the engine.
        Bad input raises ValueError here; nothing is queued then."""
        engine = self.engine
        if params.n > engine.config.max_num_seqs:
            raise ValueError(
                f"n={params.n} is more than max_num_seqs={engine.config.max_num_seqs}: the n "
                "samples of a prompt are meant to run side by side, sharing its blocks"
            )
        parent = ParentRequest(request_id, params)
        if any(c in engine.scheduler.requests for c in parent.child_ids):
            raise ValueError(f"a child id of request {request_id!r} is already in flight")
        seqs = [
            engine.input_processor.process(child_id, prompt, parent.child_params(i), arrival_time)
            for i, child_id in enumerate(parent.child_ids)
        ]
        self.add(parent)
        for seq in seqs:
            seq.shares_prompt = True  # siblings share even without caching
            engine.add_sequence(seq)

    def consume(self, seq: Sequence, runner_output: ModelRunnerOutput, counts: TokenCounts) -> bool:
        return False  # a child's row is an ordinary request's

    def after_step(self, outputs: list[RequestOutput], now: float) -> list[RequestOutput]:
        return self.gather(outputs)

    def abort(self, request_id: str) -> bool | None:
        """Abort a parent: every child still in flight."""
        parent = self.pop(request_id)
        if parent is None:
            return None  # a child id is a request of its own
        return any([self.engine.abort_request(c) for c in parent.child_ids])

    def owner(self, request_id: str) -> str | None:
        parent = self.parent_of.get(request_id)
        return parent.request_id if parent is not None else None

    @property
    def in_lockstep(self) -> bool:
        return False

    def add(self, parent: ParentRequest) -> None:
        self.parents[parent.request_id] = parent
        for child_id in parent.child_ids:
            self.parent_of[child_id] = parent

    def pop(self, request_id: str) -> ParentRequest | None:
        """Forget a parent (finished or aborted); returns it, or None for an unknown id."""
        parent = self.parents.pop(request_id, None)
        for child_id in parent.child_ids if parent else ():
            del self.parent_of[child_id]
        return parent

    def gather(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Replace the children's outputs of one step by one output per parent, at the
        place of its first child's; outputs of ``n = 1`` requests pass through."""
        if not self.parents:
            return outputs  # no n > 1 request in flight: nothing to look up
        gathered: list[RequestOutput | ParentRequest] = []
        seen: set[str] = set()
        for output in outputs:
            parent = self.parent_of.get(output.request_id)
            if parent is None:
                gathered.append(output)
                continue
            if parent.request_id not in seen:
                seen.add(parent.request_id)
                gathered.append(parent)
            parent.record(output)
        result = []
        for item in gathered:
            if isinstance(item, ParentRequest):
                if item.finished:
                    self.pop(item.request_id)
                item = item.make_output()
            if item is not None:
                result.append(item)
        return result
