"""A node's workers forked by its worker starter (launcher/zygote.py) instead of exec'd: torch's
agent sees them as it sees exec'd ones (torch's SubprocessContext: pids, exit codes, log files,
the closing signal then SIGKILL), but none of them imports torch again.

`--start-method fork` (the launcher's default; `forkserver` is taken as the same) starts the
workers of a Python training script this way; `spawn`, or a worker program that is not Python
(`--no-python`), starts them as torchrun does, a new interpreter each.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from typing import Any

from torch.distributed.elastic.multiprocessing.api import PContext, SubprocessContext

from oobleck_elastic.elastic.process import worker_name
from oobleck_elastic.launcher.zygote import ForkedProcess, Zygote

__all__ = ["FORK_METHODS", "ForkedWorkers", "forks", "starting_through"]

FORK_METHODS = ("fork", "forkserver")


def forks(start_method: str, entrypoint: Callable | str | None) -> bool:
    """Whether workers of `entrypoint` started with `start_method` are forked (a Python program)."""
    return start_method in FORK_METHODS and entrypoint == sys.executable


class _Forked:
    """What SubprocessContext uses of torch's SubprocessHandler, for a forked worker."""

    def __init__(self, proc: ForkedProcess, local_rank: int) -> None:
        self.proc, self.local_rank_id = proc, local_rank

    def close(self, death_sig: signal.Signals | None = None) -> None:
        """Signals the worker's session (the worker and what it started), as torch does."""
        try:
            os.killpg(self.proc.pid, death_sig or signal.SIGTERM)
        except ProcessLookupError:  # it has just exited
            pass


class ForkedWorkers(SubprocessContext):
    """torch's context of exec'd workers, with each worker forked by `starter`."""

    def __init__(self, starter: Zygote, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.starter = starter

    def _start(self) -> None:
        if self.subprocess_handlers:
            raise ValueError("the workers were started already")
        for local_rank in range(self.nprocs):
            env = {**os.environ, **self.envs[local_rank]}  # as torch's handler: the agent's, plus the worker's
            node = env.get("OOBLECK_NODE_ID", "x")
            proc = self.starter.start([str(a) for a in self.args[local_rank]], env, self.stdouts[local_rank] or None,
                                      self.stderrs[local_rank] or None, name=worker_name(node, local_rank),
                                      die_with_starter=True)
            self.subprocess_handlers[local_rank] = _Forked(proc, local_rank)  # type: ignore[assignment]


def starting_through(starter: Zygote):
    """torch's `start_processes` (the agent's only way to start workers) with a Python program's
    workers forked by `starter`; anything else is started by torch as before."""
    from torch.distributed.elastic.multiprocessing import start_processes

    def start(**kwargs: Any) -> PContext:
        if not forks("fork", kwargs.get("entrypoint")) or kwargs.get("numa_options") is not None:
            return start_processes(**kwargs)  # NUMA binding wraps an exec'd command
        kwargs.pop("start_method", None)
        kwargs.pop("numa_options", None)
        context = ForkedWorkers(starter, **kwargs)
        try:
            context.start()
        except Exception:
            context.close()
            raise
        return context

    return start
