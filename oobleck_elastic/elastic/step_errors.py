"""What a failure in a worker means: a peer's failure that the run recovers from (a failed step or
build), this worker's own device failing, or the run having to stop; and the error as the text
a recovery record keeps.

Note: [failed build]
    Whatever is raised while a generation is built (its default group bootstrapping through
    the store, its subgroups, the layer transfers, a restore, the built barrier) is a failed
    build, recovered like a failed step: not only gloo's and torch's TCPStore's RuntimeErrors,
    since torch's etcd-backed c10d store times out with LookupError and python-etcd raises
    errors of its own. A joiner SIGKILLed while the generation admitting it bootstrapped (stock
    torchrun on etcd) left every member waiting for its keys; each failed with `LookupError:
    Timeout while waiting for keys in EtcdStore`, and the job was lost with nobody left to
    recover it. An OobleckError stays fatal: each means this worker or the whole run must stop,
    and building again cannot help. Fenced: this worker is out of the run and must leave its
    state alone (execute() makes it FencedOut). RunFailed: the run cannot go on, and tells the
    others. StoreUnreachable: the membership store is gone past its outage timeout, so no
    recovery could agree on anything. A checkpoint that does not load (damaged, gone, another
    run's) is not fatal: the trainer raises CheckpointUnreadable, the step is marked damaged,
    and the next fallback takes the one before it (runtime/checkpoint/manifest.py Note: [newest
    checkpoint]). A bug that fails every build with every node alive is a failed build too,
    yet cannot loop: its recoveries are replays (planning/recovery.py is_replay), and the
    controller gives up after MAX_REPLAYS_WITHOUT_LOSS of them with the last error whole
    (GiveUp, elastic/controller.py).
"""

from __future__ import annotations

import traceback

import torch

from oobleck_elastic.config import JobConfig
from oobleck_elastic.elastic.protocol import StepAborted
from oobleck_elastic.errors import OobleckError, RunFailed

__all__ = ["CheckpointMissing", "DeviceFailed", "STEP_ERRORS", "cause_of", "device_error"]

STEP_ERRORS = (RuntimeError, StepAborted)  # gloo errors are RuntimeErrors


class CheckpointMissing(RuntimeError):
    """The checkpoint the run ends with is not published (elastic/ending.py)."""


class DeviceFailed(OobleckError):
    """This worker's GPU failed (a CUDA error leaves its context unusable): the worker ends,
    and its node is lost like any other."""


def device_error(exc: BaseException, cfg: JobConfig, step: int) -> OobleckError | None:
    """What a step's error means when it is this worker's own device, not a peer: running out
    of memory fails the run (a replay would run out again, as would every worker of the same
    plan), a CUDA error ends this worker; None for anything else (a peer's failure)."""
    first = str(exc).splitlines()[0][:200] if str(exc) else ""
    if isinstance(exc, torch.OutOfMemoryError):
        return RunFailed(f"a worker ran out of memory in step {step} ({first}); the plan assumed "
                         f"planner.memory_per_worker={cfg.planner.memory_per_worker} bytes a worker: set it to "
                         "what a worker really has free, or use a smaller train.microbatch_size")
    if isinstance(exc, torch.AcceleratorError):
        return DeviceFailed(f"this worker's device failed in step {step} ({first}); the worker ends and its "
                            "node is recovered from like a lost one")
    return None


def cause_of(exc: BaseException, during: str = "") -> tuple[str, str]:
    """(one line, the whole error as text): text holds no frame, so nothing of a dead
    generation stays referenced by it."""
    line = f"{type(exc).__name__}{during}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    return line, "".join(traceback.format_exception(exc))
