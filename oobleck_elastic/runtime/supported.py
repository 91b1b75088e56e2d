"""What the runtime can run: `check_supported` refuses a job configuration that parses but that
the runtime does not execute, with a message saying what to set instead; `optimizer_class` is
the one place that looks `train.optimizer` up in torch.optim (config does not import torch).

Entry points call it before any worker starts (the launcher, `python -m oobleck_elastic.train`);
each Trainer calls it again, for scripts that build workers without an entry point.
"""

from __future__ import annotations

import inspect

import torch

from oobleck_elastic.config import JobConfig, OptimizerConfig
from oobleck_elastic.config.parse import did_you_mean
from oobleck_elastic.errors import ConfigError

__all__ = ["check_supported", "optimizer_class"]


def _optimizer_names() -> list[str]:
    return sorted(n for n in dir(torch.optim) if n != "Optimizer" and isinstance(getattr(torch.optim, n), type)
                  and issubclass(getattr(torch.optim, n), torch.optim.Optimizer))


def optimizer_class(optimizer: OptimizerConfig) -> type[torch.optim.Optimizer]:
    """The torch.optim class `optimizer.name` names, once its keyword arguments are checked
    against the class's constructor; ConfigError naming the field and what is accepted."""
    cls = getattr(torch.optim, optimizer.name, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        names = _optimizer_names()
        raise ConfigError(f"train.optimizer.name {optimizer.name!r} is not a torch.optim optimizer"
                          f"{did_you_mean(optimizer.name, names)}; accepted: {', '.join(names)}")
    accepted = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "params")]
    for key in optimizer.kwargs:
        if key not in accepted:
            raise ConfigError(f"train.optimizer.{key} is not an argument of torch.optim.{optimizer.name}"
                              f"{did_you_mean(key, accepted)}; accepted: {', '.join(accepted)}")
    return cls


def check_supported(cfg: JobConfig) -> None:
    """Raises ConfigError for configurations the runtime cannot run."""
    optimizer_class(cfg.train.optimizer)
    if cfg.planner.wide:
        raise ConfigError("planner.wide plans stages that span several workers, which the runtime does "
                          "not execute (it is for dry runs: python -m oobleck_elastic.plan --wide); "
                          "set planner.wide=false to train")
    if cfg.train.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"train.device is cuda but torch {torch.__version__} sees no CUDA device; "
                          "set train.device=auto (CUDA when available, else the CPU) or cpu")
