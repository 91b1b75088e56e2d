"""Where a run reports itself: a machine-readable JSONL log and TensorBoard, behind one small
interface so the trainer does not care which are on.

Records are plain dicts. Step records carry `step`; others carry `event` ("generation",
"final", ...). Only one worker (global rank 0) writes.
"""

from __future__ import annotations

import abc
import json
import os
from collections.abc import Sequence
from typing import Any

__all__ = ["MetricsSink", "JsonlSink", "MultiSink"]


class MetricsSink(abc.ABC):
    @abc.abstractmethod
    def write(self, record: dict[str, Any]) -> None:
        """Records one step or event."""

    def close(self) -> None:
        """Flushes and releases files."""


class JsonlSink(MetricsSink):
    """One JSON object per line, flushed per record so a killed run keeps what it logged."""

    def __init__(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class MultiSink(MetricsSink):
    def __init__(self, sinks: Sequence[MetricsSink]) -> None:
        self.sinks = list(sinks)

    def write(self, record: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.write(record)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
