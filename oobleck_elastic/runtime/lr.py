"""The learning-rate schedule of a run (train.lr_schedule), as torch.optim.lr_scheduler defines
it: linear warm-up (`LinearLR`), then `CosineAnnealingLR`, `LinearLR` decay or a constant.

torch's schedulers are stateful: each `step()` moves the rate of the optimizer it wraps. Here
the optimizers belong to layers that move between workers and generations, and a replayed or
restored step must get the same rate as the first time, so the rate must be a function of the
step alone. So the schedulers run once, on a one-parameter optimizer with lr 1.0, and their
rates are kept: `lr_factor(schedule, k, total)` is the factor of optimizer step k, the same on
every worker whatever happened before (the table grows as the run does).
"""

from __future__ import annotations

import functools

import torch
from torch.optim.lr_scheduler import ConstantLR, CosineAnnealingLR, LinearLR, LRScheduler

from oobleck_elastic.config import LRScheduleConfig

__all__ = ["lr_factor"]


class _Rates:
    """The factors of one schedule, computed by stepping torch's schedulers as far as asked."""

    def __init__(self, schedule: LRScheduleConfig, total_steps: int) -> None:
        self.warmup = schedule.warmup_steps
        self.rates: list[float] = []
        warmup = self._scheduler(lambda opt: LinearLR(opt, start_factor=1.0 / self.warmup, end_factor=1.0,
                                                      total_iters=self.warmup - 1)) if self.warmup else None
        span = max(total_steps - self.warmup, 1)
        self.last = self.warmup + span  # the decay's end: later steps (past the run) keep its rate
        if schedule.kind == "cosine":
            decay = self._scheduler(lambda opt: CosineAnnealingLR(opt, T_max=span, eta_min=schedule.min_ratio))
        elif schedule.kind == "linear":
            decay = self._scheduler(lambda opt: LinearLR(opt, start_factor=1.0, end_factor=schedule.min_ratio,
                                                         total_iters=span))
        else:
            decay = self._scheduler(lambda opt: ConstantLR(opt, factor=1.0, total_iters=0))
        self.phases = [s for s in (warmup, decay) if s is not None]

    @staticmethod
    def _scheduler(make) -> LRScheduler:
        return make(torch.optim.SGD([torch.nn.Parameter(torch.zeros(()))], lr=1.0))

    def factor(self, step: int) -> float:
        step = min(step, self.last)
        while len(self.rates) <= step:
            phase = self.phases[0] if len(self.rates) < self.warmup else self.phases[-1]
            if self.rates and len(self.rates) != self.warmup:  # each phase starts at its initial rate
                phase.optimizer.step()  # no gradient: moves nothing, but torch wants it before the scheduler's
                phase.step()
            self.rates.append(float(phase.get_last_lr()[0]))
        return self.rates[step]


@functools.lru_cache(maxsize=16)
def _rates(schedule: LRScheduleConfig, total_steps: int) -> _Rates:
    return _Rates(schedule, total_steps)


def lr_factor(schedule: LRScheduleConfig, step: int, total_steps: int) -> float:
    """Multiplier of the optimizer's lr at optimizer step `step` (0-based) of `total_steps`."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return _rates(schedule, total_steps).factor(step)
