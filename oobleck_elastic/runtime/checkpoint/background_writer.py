"""One checkpoint write at a time, in a thread beside training: what lets a checkpoint cost a
step only its copy to host memory (runtime/checkpoint/layout.py Note: [checkpoint format])."""

from __future__ import annotations

import logging
import threading

from oobleck_elastic.errors import OobleckError

__all__ = ["BackgroundWriter"]

logger = logging.getLogger(__name__)


class BackgroundWriter:
    """Runs one checkpoint write at a time in a thread, off the training step. `wait()` before
    the next one (and before the process ends) bounds how far behind the disk may fall."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def submit(self, write, timeout: float) -> None:
        self.wait(timeout)
        self._thread = threading.Thread(target=self._run, args=(write,), name=f"oobleck-checkpoint-{self.name}",
                                        daemon=True)
        self._thread.start()

    def _run(self, write) -> None:
        try:
            write()
        except BaseException as exc:  # kept for wait(): training goes on, the checkpoint is not published
            self.error = exc
            logger.error("[%s] writing a checkpoint failed; it is not published: %s", self.name,
                         str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__)

    def wait(self, timeout: float) -> BaseException | None:
        """Waits for the write under way; returns (and forgets) the error of the last one."""
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise OobleckError(f"[{self.name}] a checkpoint write has not finished after {timeout:.0f} s; "
                                   "is checkpoint.dir on a slow or hung file system?")
            self._thread = None
        error, self.error = self.error, None
        return error
