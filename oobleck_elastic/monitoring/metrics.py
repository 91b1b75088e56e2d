"""Where a run reports itself: a machine-readable JSONL log and TensorBoard, behind one small
interface so the trainer does not care which are on.

Records are plain dicts. Step records carry `step`; others carry `event` ("generation",
"final", ...). Only one worker (global rank 0) writes.
"""

from __future__ import annotations

import abc
import json
import logging
import os
from collections.abc import Sequence
from typing import Any

__all__ = ["MetricsSink", "JsonlSink", "MultiSink", "read_records"]

logger = logging.getLogger(__name__)


class MetricsSink(abc.ABC):
    @abc.abstractmethod
    def write(self, record: dict[str, Any]) -> None:
        """Records one step or event."""

    @abc.abstractmethod
    def close(self) -> None:
        """Flushes and releases files."""


class JsonlSink(MetricsSink):
    """One JSON object per line, flushed per record so a killed run keeps what it logged."""

    def __init__(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        self.dropped = _drop_torn_tail(path)
        if self.dropped:
            logger.warning("metrics log %s ended in a record cut short (%d bytes: its writer was killed "
                           "mid-write); dropped it before appending", path, self.dropped)
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _drop_torn_tail(path: str) -> int:
    """Cuts a last line left without its newline (a writer killed mid-record: a rank 0 that
    died, before the next rank 0 appends to the same log) and returns its bytes. Appended
    to, it would glue the new writer's first record to the torn one and make both unreadable;
    it never was a whole record."""
    try:
        f = open(path, "rb+")  # noqa: SIM115 (closed below)
    except FileNotFoundError:
        return 0
    with f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return 0
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return 0
        keep, end = 0, size
        while end > 0:  # back to the last newline, a block at a time
            start = max(0, end - 65536)
            f.seek(start)
            newline = f.read(end - start).rfind(b"\n")
            if newline >= 0:
                keep = start + newline + 1
                break
            end = start
        f.truncate(keep)
        return size - keep


class MultiSink(MetricsSink):
    def __init__(self, sinks: Sequence[MetricsSink]) -> None:
        self.sinks = list(sinks)

    def write(self, record: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.write(record)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def read_records(path: str, *, missing_ok: bool = False) -> list[dict[str, Any]]:
    """The records of a JSONL metrics log (JsonlSink's), in order. A missing file is [] with
    `missing_ok` (a run that never logged), else FileNotFoundError. A last line cut short (the
    writer killed mid-write) is left out; any other line that is not JSON is a ValueError
    naming it."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except FileNotFoundError:
        if missing_ok:
            return []
        raise
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if number == len(lines):  # no newline after it: the write was cut short
                break
            raise ValueError(f"{path}:{number} is not a JSON record ({exc.msg}); is this a metrics log?") from exc
    return records
