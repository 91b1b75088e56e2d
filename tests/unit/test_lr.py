"""runtime/lr.py: the learning-rate schedule as torch.optim.lr_scheduler defines it, as a
function of the step alone (a replayed, restored or moved layer gets the same rate)."""

from __future__ import annotations

import math

import pytest

from oobleck_elastic.config import LRScheduleConfig
from oobleck_elastic.runtime.lr import _rates, lr_factor


def spec(schedule: LRScheduleConfig, step: int, total: int) -> float:
    """The schedule as docs/configuration.md states it: linear warm-up to 1, then the decay to min_ratio
    at the last step."""
    if step < schedule.warmup_steps:
        return (step + 1) / schedule.warmup_steps
    if schedule.kind == "constant":
        return 1.0
    progress = min((step - schedule.warmup_steps) / max(total - schedule.warmup_steps, 1), 1.0)
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if schedule.kind == "cosine" else 1 - progress
    return schedule.min_ratio + (1 - schedule.min_ratio) * shape


@pytest.mark.parametrize("kind", ["constant", "cosine", "linear"])
@pytest.mark.parametrize("warmup", [0, 1, 4])
@pytest.mark.parametrize("min_ratio", [0.0, 0.1])
def test_torchs_schedulers_give_the_documented_schedule(kind, warmup, min_ratio):
    schedule = LRScheduleConfig(kind=kind, warmup_steps=warmup, min_ratio=min_ratio)
    for total in (1, 6, 200):
        for step in range(total + 2):
            assert lr_factor(schedule, step, total) == pytest.approx(spec(schedule, step, total), abs=1e-12)


def test_the_rate_of_a_step_does_not_depend_on_what_was_asked_before():
    schedule = LRScheduleConfig(kind="cosine", warmup_steps=3, min_ratio=0.05)
    late_first = [lr_factor(schedule, step, 500) for step in (400, 7, 0, 399)]
    _rates.cache_clear()  # a new worker (or a restored run) asks in its own order
    in_order = {step: lr_factor(schedule, step, 500) for step in range(401)}
    assert late_first == [in_order[step] for step in (400, 7, 0, 399)]
    assert lr_factor(schedule, 499, 500) > lr_factor(schedule, 500, 500) == pytest.approx(0.05)
    with pytest.raises(ValueError, match="step must be >= 0"):
        lr_factor(schedule, -1, 500)
