"""Failure traces: when nodes leave and join a job, as values the simulator replays.

A trace is a start size and a time-ordered list of events `(time_s, "add" | "remove", node)`.
Three sources:

* `fixed_trace`: the Oobleck paper's shrinking cluster (Table 2): start with N nodes and
  remove one every interval until `end_nodes` are left; the trace lasts one more interval, so
  every size from N down to `end_nodes` trains for one interval.
* `poisson_trace`: preemptions at exponential gaps with a given mean (the spot-instance
  studies the paper cites measured a mean of 7.7 min on EC2 and 10.3 min on GCP); each
  preempted node can be replaced by a fresh one after a fixed delay.
* `load_csv`: a spot-trace file with one event a line, `time,kind,node` (time in seconds or a
  duration such as `90s`, kind `add` or `remove`), `#` comments and an optional header line.

Node ids in a trace are the job's node ids: 0..N-1 at the start, new ids for nodes that join.
A removal without a node id (`node` = None) lets the simulator pick a live node with its seed.
"""

from __future__ import annotations

import csv
import math
import os
import random
import re
from dataclasses import dataclass, replace

from oobleck_elastic.errors import ConfigError

__all__ = ["SPOT_MEANS", "TraceEvent", "Trace", "parse_duration", "fixed_trace", "poisson_trace", "load_csv",
           "trace_from_spec"]

SPOT_MEANS = {"ec2": 7.7 * 60, "gcp": 10.3 * 60}
"""Mean seconds between preemptions of the spot traces the paper cites (`poisson:ec2`)."""

_UNITS = {"": 1.0, "s": 1.0, "sec": 1.0, "min": 60.0, "m": 60.0, "h": 3600.0, "hr": 3600.0, "d": 86400.0}
_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-z]*)\s*$")


def parse_duration(text: str | float, what: str = "duration") -> float:
    """Seconds from `90`, `90s`, `10min`, `1.5h` or `2d`; a ConfigError names `what` otherwise."""
    if isinstance(text, (int, float)):
        value, unit = float(text), ""
    else:
        match = _DURATION.match(str(text).lower())
        if not match or match.group(2) not in _UNITS:
            if str(text).strip().startswith("-"):
                raise ConfigError(f"{what} must not be negative, got {text!r}")
            raise ConfigError(f"{what} {text!r} is not a duration: write seconds or a number with a unit "
                              f"(s, min, h, d), e.g. 90s, 10min, 6h")
        value, unit = float(match.group(1)), match.group(2)
    if value < 0 or not math.isfinite(value):
        raise ConfigError(f"{what} must be a finite non-negative duration, got {text!r}")
    return value * _UNITS[unit]


@dataclass(frozen=True, kw_only=True)
class TraceEvent:
    """One membership change."""

    time_s: float
    kind: str
    """"add" or "remove"."""
    node: int | None = None
    """The node that leaves or joins; None: the simulator picks (a live node, or a new id)."""

    def __post_init__(self) -> None:
        if self.kind not in ("add", "remove"):
            raise ConfigError(f"trace event kind must be 'add' or 'remove', got {self.kind!r}")
        if self.time_s < 0 or not math.isfinite(self.time_s):
            raise ConfigError(f"trace event time must be a finite time >= 0 s, got {self.time_s}")
        if self.node is not None and self.node < 0:
            raise ConfigError(f"trace event node ids are >= 0, got {self.node}")


@dataclass(frozen=True, kw_only=True)
class Trace:
    """A start size and what happens to it, for `duration_s` seconds."""

    name: str
    nodes: int
    """Nodes at time 0 (ids 0..nodes-1)."""
    events: tuple[TraceEvent, ...]
    duration_s: float

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ConfigError(f"a trace starts with at least 1 node, got {self.nodes}")
        times = [e.time_s for e in self.events]
        if times != sorted(times):
            raise ConfigError(f"trace {self.name!r}: events must be in time order")
        if self.duration_s <= 0:
            raise ConfigError(f"trace {self.name!r} lasts {self.duration_s} s; it must last > 0 s")


def _label(seconds: float) -> str:
    for unit, size in (("h", 3600.0), ("min", 60.0)):
        if seconds >= size and float(seconds / size).is_integer():
            return f"{int(seconds / size)}{unit}"
    return f"{seconds:g}s"


def fixed_trace(interval_s: float, *, nodes: int = 30, end_nodes: int = 15) -> Trace:
    """One removal every `interval_s` from `nodes` down to `end_nodes` (the paper's Table 2)."""
    if interval_s <= 0:
        raise ConfigError(f"the fixed trace's interval must be > 0 s, got {interval_s:g}")
    if not 1 <= end_nodes <= nodes:
        raise ConfigError(f"a fixed trace shrinks from {nodes} to {end_nodes} nodes: need 1 <= end <= start")
    removals = nodes - end_nodes
    events = tuple(TraceEvent(time_s=(i + 1) * interval_s, kind="remove") for i in range(removals))
    return Trace(name=f"fixed:{_label(interval_s)}", nodes=nodes, events=events,
                 duration_s=(removals + 1) * interval_s)


def poisson_trace(mean_s: float, *, nodes: int, events: int, replace_after_s: float = 0.0,
                  seed: int = 0) -> Trace:
    """`events` preemptions at exponential gaps of mean `mean_s`; with `replace_after_s` > 0 each
    preempted node is replaced by a new one that long after (its joins are extra events). The
    trace lasts until one mean gap after the last event."""
    if mean_s <= 0:
        raise ConfigError(f"the Poisson trace's mean interval must be > 0 s, got {mean_s:g}")
    if events < 0:
        raise ConfigError(f"--events must be >= 0, got {events}")
    rng = random.Random(seed)
    out: list[TraceEvent] = []
    t = 0.0
    next_id = nodes
    for _ in range(events):
        t += rng.expovariate(1.0 / mean_s)
        out.append(TraceEvent(time_s=t, kind="remove"))
        if replace_after_s > 0:
            out.append(TraceEvent(time_s=t + replace_after_s, kind="add", node=next_id))
            next_id += 1
    out.sort(key=lambda e: (e.time_s, e.kind != "remove"))
    end = max([e.time_s for e in out], default=0.0) + mean_s
    return Trace(name=f"poisson:{_label(mean_s)}", nodes=nodes, events=tuple(out), duration_s=end)


def load_csv(path: str, *, nodes: int, duration_s: float | None = None) -> Trace:
    """A spot trace from a CSV file of `time,kind,node` lines (see the module docstring)."""
    if not os.path.isfile(path):
        raise ConfigError(f"--trace {path!r}: no such file; give a CSV of time,kind,node lines, "
                          "or fixed:INTERVAL or poisson:MEAN")
    events = []
    with open(path, newline="", encoding="utf-8") as f:
        for number, row in enumerate(csv.reader(f), start=1):
            cells = [c.strip() for c in row]
            if not cells or not any(cells) or cells[0].startswith("#"):
                continue
            if number == 1 and cells[0].lower() == "time":
                continue
            events.append(_csv_event(path, number, cells))
    events.sort(key=lambda e: e.time_s)
    end = duration_s if duration_s is not None else max([e.time_s for e in events], default=0.0) * 1.05 or 1.0
    return Trace(name=os.path.basename(path), nodes=nodes, events=tuple(events), duration_s=end)


def _csv_event(path: str, number: int, cells: list[str]) -> TraceEvent:
    where = f"{path}:{number}"
    if len(cells) not in (2, 3):
        raise ConfigError(f"{where}: expected time,kind[,node] (e.g. 600,remove,3), got {','.join(cells)!r}")
    time_s = parse_duration(cells[0], f"{where}: time")
    kind = cells[1].lower()
    if kind not in ("add", "remove"):
        raise ConfigError(f"{where}: kind must be add or remove, got {cells[1]!r}")
    node = None
    if len(cells) == 3 and cells[2]:
        if not cells[2].isdigit():
            raise ConfigError(f"{where}: node must be a non-negative integer id, got {cells[2]!r}")
        node = int(cells[2])
    return TraceEvent(time_s=time_s, kind=kind, node=node)


def trace_from_spec(spec: str, *, nodes: int, events: int, replace_after_s: float, seed: int,
                    end_nodes: int | None = None) -> Trace:
    """`fixed:INTERVAL`, `poisson:MEAN` (`poisson:ec2` and `poisson:gcp`: 7.7 and 10.3 min) or a
    CSV file path (the --trace option)."""
    kind, sep, arg = spec.partition(":")
    if sep and kind == "fixed":
        trace = fixed_trace(parse_duration(arg, "--trace fixed: interval"), nodes=nodes,
                            end_nodes=end_nodes if end_nodes is not None else max(1, nodes // 2))
        return replace(trace, name=spec)
    if sep and kind == "poisson":
        mean = SPOT_MEANS.get(arg.lower()) or parse_duration(arg, "--trace poisson: mean")
        trace = poisson_trace(mean, nodes=nodes, events=events,
                              replace_after_s=replace_after_s, seed=seed)
        return replace(trace, name=spec)
    if os.path.isfile(spec):
        return load_csv(spec, nodes=nodes)
    if sep:
        raise ConfigError(f"--trace {spec!r}: unknown trace kind {kind!r}; use fixed:INTERVAL (e.g. fixed:10min), "
                          "poisson:MEAN (e.g. poisson:7.7min) or a CSV file of time,kind,node lines")
    return load_csv(spec, nodes=nodes)
