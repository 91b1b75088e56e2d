"""The recovery-cost model of our runtime, with constants fitted to its own metrics logs.

Note: [recovery cost]
    A node failure costs our runtime, from the kill to the first step of the next generation:
    the part of the interrupted step already done (lost: the step is replayed), then

        detect + teardown + agree + reinit + transfer + rebuild

    where every term but `transfer` is a constant fitted from the `phases_s` of the recovery
    records in metrics logs (monitoring/run_report.py writes them) and `transfer` is the
    actual reconfiguration plan's bytes over the configured inter-node bandwidth: transfers run
    in parallel, so the slowest worker (the most bytes sent or received by one worker) sets it.
    The replayed step is an ordinary step of the new layout. A join is admitted at a step
    boundary (nothing is lost) and costs teardown + agree + reinit + transfer + rebuild.
    More failures than replicas fall back to the newest checkpoint: detect + teardown + agree +
    `restore`, and the steps since the checkpoint are run again.

    `step_overhead_s` is what a step costs beyond the cost model's iteration time (the commit
    in the store, logging, checkpoint writes averaged over the steps, and whatever else of the
    step the model misses): the mean gap between consecutive step records
    minus the cost model's time for that generation's layout. Fitting it needs the job's
    profile and planner settings; without them it stays 0.

    Each constant is the median over the records (the mean for the step overhead), so one slow
    recovery on a loaded machine does not set it.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass

from oobleck_elastic.errors import ConfigError
from oobleck_elastic.monitoring.metrics import read_records
from oobleck_elastic.planning.reconfigure import Transfer

__all__ = ["RecoveryConstants", "PHASES", "default_constants", "fit_constants", "load_constants",
           "read_metrics", "transfer_seconds", "DEFAULT_CONSTANTS_PATH"]

PHASES = ("detect", "teardown", "agree", "reinit", "rebuild", "restore")
DEFAULT_CONSTANTS_PATH = os.path.join(os.path.dirname(__file__), "measured_constants.json")


@dataclass(frozen=True, kw_only=True)
class RecoveryConstants:
    """Seconds each fixed phase of a recovery takes (Note: [recovery cost])."""

    detect_s: float
    """From the failure to a survivor's step failing."""
    teardown_s: float
    """Closing the failed generation."""
    agree_s: float
    """Roll call and the compare-and-set of the next generation."""
    reinit_s: float
    """New process groups."""
    rebuild_s: float
    """Stages and schedules of the new layout."""
    restore_s: float
    """Reading the newest checkpoint after more failures than replicas."""
    step_overhead_s: float = 0.0
    """Per step, beyond the cost model's iteration time."""
    source: str = "unspecified"
    """Where the constants come from (files, records, the command that fitted them)."""
    in_memory_records: int = 0
    restore_records: int = 0
    step_records: int = 0

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if name.endswith("_s") and not value >= 0:
                raise ConfigError(f"recovery constant {name} must be >= 0 s, got {value}")

    def in_memory_s(self, transfer_s: float, *, detect: bool = True) -> float:
        return (self.detect_s if detect else 0.0) + self.teardown_s + self.agree_s + self.reinit_s \
            + transfer_s + self.rebuild_s

    def fallback_s(self) -> float:
        return self.detect_s + self.teardown_s + self.agree_s + self.restore_s

    def describe(self) -> str:
        phases = ", ".join(f"{name} {getattr(self, name + '_s'):.3f} s" for name in PHASES)
        return (f"recovery constants: {phases}, step overhead {self.step_overhead_s:.3f} s "
                f"(from {self.in_memory_records} in-memory recoveries, {self.restore_records} checkpoint "
                f"restores, {self.step_records} steps; source: {self.source})")

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(asdict(self), f, indent=1)
            f.write("\n")


def load_constants(path: str) -> RecoveryConstants:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return RecoveryConstants(**data)
    except FileNotFoundError as exc:
        raise ConfigError(f"--constants {path!r}: no such file; write one with --fit METRICS.jsonl") from exc
    except (json.JSONDecodeError, TypeError) as exc:
        raise ConfigError(f"--constants {path!r} is not a constants file written by --fit: {exc}") from exc


def default_constants() -> RecoveryConstants:
    """The constants fitted to this project's measured runs (measured_constants.json)."""
    return load_constants(DEFAULT_CONSTANTS_PATH)


def read_metrics(path: str) -> list[dict]:
    """The records of one metrics log; a ConfigError names a missing file or a line that is not JSON."""
    try:
        return read_records(path)
    except FileNotFoundError:
        raise ConfigError(f"--fit {path!r}: no such metrics log (a run writes it at monitoring.metrics_path)") from None
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


StepModel = Callable[[dict], float | None]
"""Seconds the cost model gives one step of a generation record, None when it cannot tell."""


def _step_gaps(records: Sequence[dict], model: StepModel) -> list[float]:
    """Gap between consecutive step records minus the cost model's time for their layout; the
    first step of a generation (a replay after a recovery) is left out."""
    predicted: float | None = None
    gaps, previous = [], None
    for rec in records:
        if rec.get("event") == "generation":
            predicted, previous = model(rec), None
            continue
        if "step" not in rec or "event" in rec:
            if rec.get("event") in ("recovery", "resumed"):
                previous = None
            continue
        if previous is not None and predicted is not None and rec["step"] == previous["step"] + 1:
            gaps.append(rec["time"] - previous["time"] - predicted)
        previous = rec
    return gaps


def fit_constants(paths: Iterable[str], step_model: StepModel | Sequence[StepModel | None] | None = None,
                  source: str = "") -> RecoveryConstants:
    """Constants from the recovery (and, with `step_model`, step) records of metrics logs;
    `step_model` is one for every log or a list with one per log (each run's own profile)."""
    paths = list(paths)
    models = list(step_model) if isinstance(step_model, Sequence) else [step_model] * len(paths)
    if len(models) != len(paths):
        raise ValueError(f"{len(models)} step models for {len(paths)} metrics logs")
    phases: dict[str, list[float]] = {name: [] for name in PHASES}
    in_memory = restores = 0
    gaps: list[float] = []
    for path, model in zip(paths, models):
        records = read_metrics(path)
        for rec in records:
            if rec.get("event") != "recovery" or not rec.get("lost"):
                continue  # joins are not failures: nothing to detect
            measured = rec.get("phases_s", {})
            restored = rec.get("restored_from") is not None
            restores += restored
            in_memory += not restored
            for name in PHASES:
                if name in measured and (name != "restore" or restored):
                    phases[name].append(float(measured[name]))
        if model is not None:
            gaps += _step_gaps(records, model)
    if not in_memory:
        raise ConfigError(f"no recovery record with a lost node in {', '.join(paths)}: run a job with failures "
                          "(e.g. OOBLECK_FAULT=node=1,step=8,phase=backward) and fit its metrics log")
    return RecoveryConstants(
        **{f"{name}_s": _median(values) for name, values in phases.items()},
        step_overhead_s=max(0.0, statistics.fmean(gaps)) if gaps else 0.0,
        source=source or "fitted from " + ", ".join(paths), in_memory_records=in_memory,
        restore_records=restores, step_records=len(gaps))


def transfer_seconds(transfers: Sequence[Transfer], bandwidth_gbps: float) -> float:
    """The transfer phase of a plan: the busiest worker's bytes (sent or received) over the
    bandwidth in GB/s (Note: [recovery cost])."""
    if not transfers:
        return 0.0
    load: dict[tuple[str, object], int] = {}
    for t in transfers:
        load[("out", t.src)] = load.get(("out", t.src), 0) + t.bytes
        load[("in", t.dst)] = load.get(("in", t.dst), 0) + t.bytes
    return max(load.values()) / (bandwidth_gbps * 1e9)
