"""What the runtime can run: `check_supported` refuses a job configuration that parses but that
the runtime does not execute, with a message saying what to set instead.

Entry points call it before any worker starts (the launcher, `python -m oobleck_elastic.train`);
each Trainer calls it again, for scripts that build workers without an entry point.
"""

from __future__ import annotations

from oobleck_elastic.config import JobConfig
from oobleck_elastic.errors import ConfigError

__all__ = ["check_supported"]


def check_supported(cfg: JobConfig) -> None:
    """Raises ConfigError for configurations the runtime cannot run."""
    if cfg.planner.wide:
        raise ConfigError("planner.wide plans stages that span several workers, which the runtime does "
                          "not execute (it is for dry runs: python -m oobleck_elastic.plan --wide); "
                          "set planner.wide=false to train")
