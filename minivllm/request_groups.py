"""Requests that are several sequences on the output side: ``n > 1`` samples of a prompt
(parallel_sampling.py) and beam search (beam_search.py).

The scheduler and the model runner never hear of groups: each member is an ordinary
request. Only the engine's output side does, through this one small protocol, called a
fixed number of times per step: once per sequence with a row (`consume`: the group takes
it, or the output processor does as for any request), once after the step (`after_step`:
drops, forks, gathering the members' outputs), and on an abort. A kind of group is loaded
by its qualified name the first time a request needs it, so the engine imports none.
"""

from __future__ import annotations

from typing import Protocol

from minivllm.outputs import ModelRunnerOutput, RequestOutput
from minivllm.sequence import Sequence
from minivllm.stats import TokenCounts
from minivllm.utils import resolve_obj_by_qualname

# The kinds of group, by the name the engine asks for.
KINDS = {
    "parallel_sampling": "minivllm.parallel_sampling.ParentRequests",
    "beam_search": "minivllm.beam_search.BeamSearchGroups",
}


class RequestGroups(Protocol):
    """Every group of one kind in flight, for one engine."""

    def __contains__(self, request_id: str) -> bool:
        """Whether ``request_id`` is a group's own id (not a member's)."""

    def consume(self, seq: Sequence, runner_output: ModelRunnerOutput, counts: TokenCounts) -> bool:
        """Whether ``seq`` is a member whose row the group takes (then nobody else looks)."""

    def after_step(self, outputs: list[RequestOutput], now: float) -> list[RequestOutput]:
        """The step's outputs, with the groups' decisions made: members' outputs gathered
        into their group's, finished groups reported."""

    def abort(self, request_id: str) -> bool | None:
        """Abort a group: True if it was in flight, False for a member's id (not a request
        of its own), None if the id is none of this kind's."""

    def owner(self, request_id: str) -> str | None:
        """The id of the group whose member ``request_id`` is, or None."""

    @property
    def in_lockstep(self) -> bool:
        """Whether the next step needs this one's output to be scheduled (no overlap)."""


class RequestGroupSet:
    """The engine's groups, of every kind used so far (created on first use)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.kinds: dict[str, RequestGroups] = {}

    def __getitem__(self, kind: str) -> RequestGroups:
        if kind not in self.kinds:
            self.kinds[kind] = resolve_obj_by_qualname(KINDS[kind])(self.engine)
        return self.kinds[kind]

    def __contains__(self, request_id: str) -> bool:
        return any(request_id in groups for groups in self.kinds.values())

    def consume(self, seq: Sequence, runner_output: ModelRunnerOutput, counts: TokenCounts) -> bool:
        if not self.kinds:  # no group was ever asked for: every row is a plain request's
            return False
        return any(g.consume(seq, runner_output, counts) for g in self.kinds.values())

    def after_step(self, outputs: list[RequestOutput], now: float) -> list[RequestOutput]:
        for groups in self.kinds.values():
            outputs = groups.after_step(outputs, now)
        return outputs

    def owner(self, request_id: str) -> str:
        """The id a caller waits on for ``request_id``: its group's, or its own."""
        for groups in self.kinds.values():
            owner = groups.owner(request_id)
            if owner is not None:
                return owner
        return request_id

    def abort(self, request_id: str) -> bool | None:
        for groups in self.kinds.values():
            aborted = groups.abort(request_id)
            if aborted is not None:
                return aborted
        return None

    @property
    def in_lockstep(self) -> bool:
        return any(groups.in_lockstep for groups in self.kinds.values())
