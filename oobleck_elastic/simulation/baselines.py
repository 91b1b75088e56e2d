"""The systems our runtime is compared with, as cost models whose constants are parameters.

Each baseline trains on the same hardware with layouts from the same planner (so the
comparison isolates how each system reacts to a membership change, not how well it splits a
model), and differs in what a change costs:

* `RestartBaseline` (Varuna-like, Athlur et al., "Varuna: Scalable, Low-cost Training of
  Massive Deep Learning Models", EuroSys 2022): every change, a failure or a join, stops the
  whole job, which restarts on the live nodes with a fresh layout from the newest checkpoint;
  the work since that checkpoint is lost. It checkpoints every `checkpoint_interval_s` of
  training, each write stalling training for `checkpoint_write_s`. Not bound to f + 1 replicas:
  it uses the fastest layout with one or more pipelines.
* `RedundantBaseline` (Bamboo-like, Thorpe et al., "Bamboo: Making Preemptible Instances
  Resilient for Affordable Training of Large DNNs", NSDI 2023): every worker also runs its
  successor's layers (redundant computation), so a single failure fails over to the shadow
  without losing work, at the price of a slower step (`slowdown`) and `memory_factor` times the
  model state per worker: a model that does not fit that cannot run at all. A failure costs
  `failover_s`; a second failure before the redundancy is rebuilt (`reprotect_s` later) falls
  back to a restart from the checkpoint like the restart baseline.
* `TorchrunBaseline` (stock `torchrun --max-restarts`): any change, a join included, restarts
  every worker (`restart_s`: 10.6 s from the kill to the next step, the project's latest
  measurement with benchmarks/recovery.py for the GPT example on 5 local nodes; the README's
  table quotes earlier runs at 15.5-18.9 s; most of it is torchrun's rendezvous and process
  start) plus reading the checkpoint (`checkpoint_read_s`), and loses the work since the
  newest checkpoint, written every `checkpoint_interval_s`.

Note: [baseline constants]
    The defaults below are stated where they come from. The papers describe the mechanisms
    (restart from a checkpoint; redundant computation doubling a worker's layers); the
    numbers they report depend on their clusters and were not re-measured here, so the
    defaults marked "assumed" are round values chosen for a 2023-era GPU cluster and storage,
    not published constants. Every one is a command-line parameter: set them to your
    cluster's figures.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from oobleck_elastic.errors import ConfigError

__all__ = ["RestartBaseline", "RedundantBaseline", "TorchrunBaseline", "Baselines", "SOURCES"]


def _check_non_negative(obj: object) -> None:
    for name, value in asdict(obj).items():
        if isinstance(value, (int, float)) and not value >= 0:
            raise ConfigError(f"{type(obj).__name__}.{name} must be >= 0, got {value}")


@dataclass(frozen=True, kw_only=True)
class RestartBaseline:
    """Varuna-like: restart from the newest checkpoint on every change."""

    restart_s: float = 300.0
    """Stopping every worker, starting the job again on the live nodes, re-planning and reading
    the checkpoint (assumed: 5 min)."""
    checkpoint_interval_s: float = 1800.0
    """Training time between checkpoints (assumed: 30 min)."""
    checkpoint_write_s: float = 60.0
    """Training stall per checkpoint (assumed: 1 min for a multi-GB model to shared storage)."""

    def __post_init__(self) -> None:
        _check_non_negative(self)


@dataclass(frozen=True, kw_only=True)
class RedundantBaseline:
    """Bamboo-like: redundant computation of the successor's layers."""

    slowdown: float = 0.5
    """Extra step time from the redundant forward and backward passes that pipeline bubbles do
    not hide (assumed: +50%)."""
    memory_factor: float = 2.0
    """Model state per worker relative to no redundancy: its own layers plus its successor's
    (2x, from the design)."""
    failover_s: float = 30.0
    """Switching to the shadow and re-planning after one failure (assumed: 30 s)."""
    reprotect_s: float = 120.0
    """Time until the redundancy covers the new layout again (assumed: 2 min)."""
    restart_s: float = 300.0
    """A restart when redundancy cannot cover a failure (assumed: as RestartBaseline)."""
    checkpoint_interval_s: float = 1800.0
    """Training time between checkpoints (assumed: as RestartBaseline)."""
    checkpoint_write_s: float = 60.0
    """Training stall per checkpoint (assumed: as RestartBaseline)."""

    def __post_init__(self) -> None:
        _check_non_negative(self)
        if self.memory_factor < 1:
            raise ConfigError(f"RedundantBaseline.memory_factor must be >= 1, got {self.memory_factor}")


@dataclass(frozen=True, kw_only=True)
class TorchrunBaseline:
    """Stock torchrun: restart every worker from the newest checkpoint."""

    restart_s: float = 10.6
    """Kill to next step of a restart, measured here (benchmarks/recovery.py, 5 local nodes)."""
    checkpoint_read_s: float = 60.0
    """Reading the checkpoint after a restart (assumed: 1 min for a multi-GB model; the local
    measurement's model is tiny)."""
    checkpoint_interval_s: float = 1800.0
    """Training time between checkpoints (assumed: 30 min)."""
    checkpoint_write_s: float = 60.0
    """Training stall per checkpoint (assumed: 1 min)."""

    def __post_init__(self) -> None:
        _check_non_negative(self)


@dataclass(frozen=True, kw_only=True)
class Baselines:
    restart: RestartBaseline = RestartBaseline()
    redundant: RedundantBaseline = RedundantBaseline()
    torchrun: TorchrunBaseline = TorchrunBaseline()


SOURCES = {
    "oobleck": "this project's planner and runtime; recovery constants fitted to its metrics logs",
    "restart": "Varuna-like restart from checkpoint (Athlur et al., EuroSys 2022); constants assumed",
    "redundant": "Bamboo-like redundant computation (Thorpe et al., NSDI 2023); constants assumed",
    "torchrun": "stock torchrun restart; restart_s measured here (benchmarks/recovery.py)",
}
