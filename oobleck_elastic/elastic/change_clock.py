"""Timing a change of membership (a recovery, an admission), from the first sign of it to the
first step of the generation it ends in: the generation it left, the seconds of each phase
(teardown, agree, transfer, restore, ...), and when this worker's step failed."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

__all__ = ["Change", "ChangeClock"]


@dataclass(frozen=True)
class Change:
    """A change, timed: what the reporter records of it."""

    first_generation: int
    """The generation the change left (a failure may take several to get through)."""
    phases: dict[str, float]
    total_s: float
    failed_at: float | None
    """Wall time this worker's step failed (None: an admission, or a failure seen elsewhere)."""


@dataclass
class ChangeClock:
    _first_generation: int | None = None
    _phases: dict[str, float] = field(default_factory=dict)
    _started: float = 0.0
    failed_at: float | None = None

    @property
    def running(self) -> bool:
        return self._first_generation is not None

    def step_failed(self) -> None:
        self.failed_at = time.time()

    def begin(self, generation: int, started: float | None = None, *, fresh: bool = False) -> bool:
        """Starts timing a change from `generation` unless one is already under way (a failure
        before the last change finished: one change); `fresh` starts anew whatever is under
        way (an admission). Whether this call started it."""
        if self.running and not fresh:
            return False
        self._first_generation, self._phases = generation, {}
        self._started = time.perf_counter() if started is None else started
        if fresh:
            self.failed_at = None
        return True

    def add(self, phases: dict[str, float]) -> None:
        """Adds seconds to phases of the change under way (a retried build adds up); nothing if none is."""
        if self.running:
            for name, seconds in phases.items():
                self._phases[name] = self._phases.get(name, 0.0) + seconds

    def finish(self) -> Change | None:
        """The change under way, now that its generation is built; None if none was."""
        if self._first_generation is None:
            return None
        change = Change(self._first_generation, dict(self._phases), time.perf_counter() - self._started,
                        self.failed_at)
        self._first_generation, self._phases = None, {}
        return change
