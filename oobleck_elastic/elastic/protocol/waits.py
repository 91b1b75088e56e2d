"""Waiting on the store: every wait of the protocol polls through `wait_until`, with a deadline,
the store's poll interval and an error naming what was awaited. `Clocks` makes time injectable,
so the protocol runs on a fake store and a fake clock in tests."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from oobleck_elastic.errors import OobleckError

__all__ = ["Clocks", "WaitTimeout", "wait_until"]

T = TypeVar("T")


class WaitTimeout(OobleckError):
    """Something awaited on the store did not happen in time."""


@dataclass(frozen=True)
class Clocks:
    """The protocol's time: `clock` for intervals, `sleep` between polls, `wall` for what is
    written to the store for others to read (their clocks may differ; Note: [lease age])."""

    clock: Callable[[], float] = field(default=time.monotonic)
    sleep: Callable[[float], None] = field(default=time.sleep)
    wall: Callable[[], float] = field(default=time.time)


def wait_until(what: str, check: Callable[[], T | None], timeout: float, poll_s: float, *,
               poll_max_s: float | None = None, clock: Callable[[], float] = time.monotonic,
               sleep: Callable[[float], None] = time.sleep) -> T:
    """The first value of `check()` that is not None (or False), polled until `timeout`; then
    WaitTimeout naming `what` (say what should have happened). The pause between two polls
    starts at `poll_s` and grows by half each time up to `poll_max_s` (default: `poll_s`): what
    comes at once is seen at once, and a long wait (a slow peer, a joiner waiting to be
    admitted) does not spin on a CPU the workers still computing need."""
    deadline = clock() + timeout
    pause, longest = poll_s, max(poll_s, poll_max_s or poll_s)
    while True:
        value = check()
        if value is not None and value is not False:
            return value
        if clock() > deadline:
            raise WaitTimeout(f"timed out after {timeout:.0f} s waiting for {what}")
        sleep(pause)
        pause = min(longest, pause * 1.5)
