"""Seconds per step of a repeated piece of work (a work unit's records, a stage's steps): a
`StepClock` is charged, at each lap, the time since its previous lap. `NO_CLOCK` records
nothing, for callers that do not time."""
from __future__ import annotations

import time
from collections import defaultdict


class StepClock:
    """Seconds per step, summed over every lap of it: `lap(step)` charges the time since the
    previous lap (or `start`, or the clock's making) to `step`."""

    def __init__(self) -> None:
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self._last = time.perf_counter()

    def start(self) -> None:
        self._last = time.perf_counter()

    def lap(self, step: str) -> None:
        now = time.perf_counter()
        self.seconds[step] += now - self._last
        self._last = now

    def rounded(self) -> dict[str, float]:
        return {step: round(s, 6) for step, s in self.seconds.items()}


class NoClock(StepClock):
    """A clock that records nothing."""

    def lap(self, step: str) -> None:
        pass


NO_CLOCK = NoClock()
