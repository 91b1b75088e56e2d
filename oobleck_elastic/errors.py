"""The package's exception hierarchy: every error a user can cause derives from OobleckError.

Entry points catch OobleckError and print its message without a traceback; anything else is a
bug and keeps its traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

__all__ = [
    "RunFailed",
    "OobleckError",
    "CheckpointDamaged",
    "ConfigError",
    "PlanningError",
    "InfeasibleBatchError",
    "LayersLostError",
    "ProfileError",
    "exit_status",
]


class OobleckError(Exception):
    """Base class of errors caused by input or by the environment, not by a bug."""


class RunFailed(OobleckError):
    """The run cannot go on: every worker would fail the same way (a step that keeps failing,
    no checkpoint to fall back to). The first worker to meet it tells the others and the
    launcher (`Side.publish_failure`)."""


class CheckpointDamaged(OobleckError):
    """A checkpoint's file does not match its checksum, or holds what oobleck_elastic never
    writes: no fallback takes that checkpoint again (runtime/checkpoint/)."""


class ConfigError(OobleckError, ValueError):
    """A job configuration or command-line value is wrong; the message names the field."""


class ProfileError(OobleckError):
    """A profile file is missing, unreadable or does not match the model being planned."""


class PlanningError(OobleckError):
    """No plan satisfies the constraints (memory, node counts, fault tolerance)."""


class InfeasibleBatchError(PlanningError):
    """The global batch cannot be split over the pipelines; names the nearest valid batch."""

    def __init__(self, message: str, *, nearest_valid: int | None) -> None:
        super().__init__(message)
        self.nearest_valid = nearest_valid


class LayersLostError(PlanningError):
    """More failures than the replicas cover: some layers have no surviving copy."""

    def __init__(self, layers: list[int]) -> None:
        self.layers = sorted(layers)
        shown = ", ".join(str(i) for i in self.layers[:20])
        more = "" if len(self.layers) <= 20 else f" (and {len(self.layers) - 20} more)"
        super().__init__(
            f"layers {shown}{more} have no surviving replica; in-memory recovery is impossible. "
            "Restore the latest checkpoint, or raise fault_tolerance so more replicas are kept."
        )


def exit_status(body: Callable[[], object]) -> int:
    """Runs an entry point's body: 0, or 2 with an OobleckError printed as one `error: ...`
    line on stderr (no traceback: the message says what to do)."""
    try:
        body()
    except OobleckError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
