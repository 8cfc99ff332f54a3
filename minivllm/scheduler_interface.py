"""The interface every scheduling policy implements (vLLM: ``SchedulerInterface``).

The engine talks to a scheduler only through these methods, so the continuous
`Scheduler` and the `StaticBatchScheduler` it is measured against are interchangeable.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from minivllm.outputs import ModelRunnerOutput
from minivllm.scheduler_output import SchedulerOutput
from minivllm.sequence import FinishReason, Sequence


class SchedulerInterface(Protocol):
    requests: dict[str, Sequence]  # every unfinished request, by id
    waiting: Iterable[Sequence]  # not holding KV blocks: new, or preempted
    running: list[Sequence]  # holding KV blocks
    num_preemptions: int  # since the engine started
    num_waiting_preempted: int  # of ``waiting``, those preempted, kept count of as they move

    @classmethod
    def from_config(cls, config, kv_cache_manager, max_model_len: int, clock):
        """Build the policy from the engine's settings (`EngineConfig.scheduler_cls`)."""

    def add_request(self, seq: Sequence) -> None:
        """Queue a new request."""

    def schedule(self) -> SchedulerOutput:
        """Decide what the next step computes, taking KV blocks for it."""

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> None:
        """After the step ran: the scheduled tokens' keys and values are in the cache."""

    def finish_requests(
        self, request_ids: str | Iterable[str], reason: FinishReason, stop_reason=None
    ) -> None:
        """Retire requests (stopped, or aborted in any state) and free their blocks."""

    def has_unfinished_requests(self) -> bool: ...
