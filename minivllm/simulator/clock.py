"""Simulated time: a number that only moves when told to.

The engine reads time only through the ``clock()`` it was given, so with a `SimClock`
every timestamp it stamps (arrival, first scheduled, each token, finished) is simulated
time. The executor advances the clock by each step's predicted duration; the driver
jumps it to the next arrival when the engine has nothing to do. Nothing ever sleeps.
"""

from __future__ import annotations


class SimClock:
    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        assert seconds >= 0, "time only moves forward"
        self.now += seconds

    def jump_to(self, time: float) -> None:
        self.now = max(self.now, time)
