"""The fault hook: how fault injection (testing/faults.py, built by the elastic layer) reaches the
points where a failure is injected, in the runtime and in the run. Each point calls the hook
with its phase and the step it belongs to; a run that injects nothing is given `NO_FAULTS`.

The step of a phase inside the runtime (a step's forward, a build's transfer) is the trainer's
`fault_step`: the step this worker computes or computed last, or, before its first step, the
start step of the first generation it builds. So a fault at the build of step K fires in the
generation built after a failure of step K, and in a resumed run's first generation at K."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

__all__ = ["FaultHook", "NO_FAULTS", "PhaseHook", "no_phase"]

PhaseHook = Callable[[str], None]
"""The hook inside the runtime (a generation, its stages, the transfers): the trainer binds the
step (Trainer.fault_step), so these call it with the phase alone."""


class FaultHook(Protocol):
    def __call__(self, phase: str, step: int) -> None: ...


class _NoFaults:
    def __call__(self, phase: str, step: int) -> None:
        return None

    def __repr__(self) -> str:
        return "NO_FAULTS"


NO_FAULTS: FaultHook = _NoFaults()


def no_phase(phase: str) -> None:
    """The phase hook of a generation or transfer run without a trainer's (tests)."""
    return None
