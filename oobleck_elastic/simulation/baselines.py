"""The systems our runtime is compared with, as cost models whose constants are parameters.

Each baseline trains on the same hardware with layouts from the same planner (so the
comparison isolates how each system reacts to a membership change, not how well it splits a
model), and differs in what a change costs:

* `RestartBaseline` (Varuna-like, Athlur et al., "Varuna: Scalable, Low-cost Training of
  Massive Deep Learning Models", EuroSys 2022): every change, a failure or a join, stops the
  whole job, which restarts on the live nodes with a fresh layout from the newest checkpoint;
  the work since that checkpoint is lost. It checkpoints every `checkpoint_interval_s` of
  training (or every `checkpoint_interval_steps` steps), each write stalling training for
  `checkpoint_write_s`. Not bound to f + 1 replicas:
  it uses the fastest layout with one or more pipelines.
* `RedundantBaseline` (Bamboo-like, Thorpe et al., "Bamboo: Making Preemptible Instances
  Resilient for Affordable Training of Large DNNs", NSDI 2023): every worker also runs its
  successor's layers (redundant computation), so a single failure fails over to the shadow
  without losing work, at the price of a slower step (`slowdown`) and `memory_factor` times the
  model state per worker: a model that does not fit that cannot run at all. A failure costs
  `failover_s`; a second failure before the redundancy is rebuilt (`reprotect_s` later) falls
  back to a restart from the checkpoint like the restart baseline.
* `TorchrunBaseline` (stock `torchrun --max-restarts`): any change, a join included, restarts
  every worker (`restart_s`: 10.3 s from the kill to the next step, the project's latest
  measurement with benchmarks/recovery.py for the GPT example on 5 local nodes; most of it is
  torchrun's rendezvous and process start) plus reading the checkpoint (`checkpoint_read_s`),
  and loses the work since the newest checkpoint.

Note: [baseline constants]
    Every default says where it comes from. The Varuna-like and Bamboo-like defaults are the
    constants the Oobleck authors' own simulator uses for GPT-3 6.7B to produce the paper's
    Table 2 and Figure 9 (github.com/SymbioticLab/Oobleck, tools/simulator/
    varuna_simulator.py and bamboo_simulator.py, read at commit 103c477): their figures for the
    GPU cluster of the paper, not measured here. The papers themselves describe the mechanisms
    (restart from a checkpoint; redundant computation of the successor's layers). Values
    marked "assumed" have no published source. Every one is a command-line parameter
    (`--baseline restart.restart_s=...`): set them to your cluster's figures.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from oobleck_elastic.errors import ConfigError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = ["RestartBaseline", "RedundantBaseline", "TorchrunBaseline", "Baselines", "SOURCES"]


def _check_non_negative(obj: DataclassInstance) -> None:
    for name, value in asdict(obj).items():
        if isinstance(value, (int, float)) and not value >= 0:
            raise ConfigError(f"{type(obj).__name__}.{name} must be >= 0, got {value}")
    if getattr(obj, "checkpoint_interval_steps", 0) and getattr(obj, "checkpoint_interval_s", 0):
        raise ConfigError(f"{type(obj).__name__}: set checkpoint_interval_steps or checkpoint_interval_s, not both "
                          "(with checkpoint_interval_steps, also set checkpoint_interval_s=0)")


@dataclass(frozen=True, kw_only=True)
class RestartBaseline:
    """Varuna-like: restart from the newest checkpoint on every change."""

    restart_s: float = 701.0
    """Stopping every worker, starting the job again on the live nodes, re-planning and reading
    the checkpoint (the Oobleck artifact's Varuna restart for GPT-3 6.7B: 701 s)."""
    checkpoint_interval_s: float = 2550.0
    """Training time between checkpoints: the artifact's Varuna checkpoints every 10 iterations,
    and its GPT-3 6.7B iteration on 30 nodes takes 1024 / 4.02 samples/s = 255 s (the paper's
    Table 2), so 2550 s. In time, not steps, so that it holds at other scales."""
    checkpoint_interval_steps: int = 0
    """Steps between checkpoints instead (0: by time)."""
    checkpoint_write_s: float = 120.0
    """Training stall per checkpoint (the artifact's Varuna for GPT-3 6.7B: 120 s)."""

    def __post_init__(self) -> None:
        _check_non_negative(self)


@dataclass(frozen=True, kw_only=True)
class RedundantBaseline:
    """Bamboo-like: redundant computation of the successor's layers."""

    slowdown: float = 0.245
    """Extra step time from the redundant forward and backward passes that pipeline bubbles do
    not hide (the artifact's Bamboo keeps 80.29% of the throughput: 1 / 0.8029 - 1 = +24.5%)."""
    memory_factor: float = 2.0
    """Model state per worker relative to no redundancy: its own layers plus its successor's
    (2x, from the design)."""
    failover_s: float = 30.0
    """Switching to the shadow and re-planning after one failure (assumed: 30 s)."""
    reprotect_s: float = 120.0
    """Time until the redundancy covers the new layout again (assumed: 2 min)."""
    restart_s: float = 450.0
    """A restart when redundancy cannot cover a failure (the artifact's Bamboo restart for GPT-3
    6.7B: 450 s)."""
    checkpoint_interval_s: float = 2550.0
    """Training time between checkpoints (assumed: as RestartBaseline; the artifact's Bamboo
    does not model checkpoints)."""
    checkpoint_interval_steps: int = 0
    """Steps between checkpoints instead (0: by time)."""
    checkpoint_write_s: float = 120.0
    """Training stall per checkpoint (assumed: as RestartBaseline)."""

    def __post_init__(self) -> None:
        _check_non_negative(self)
        if self.memory_factor < 1:
            raise ConfigError(f"RedundantBaseline.memory_factor must be >= 1, got {self.memory_factor}")


@dataclass(frozen=True, kw_only=True)
class TorchrunBaseline:
    """Stock torchrun: restart every worker from the newest checkpoint."""

    restart_s: float = 10.3
    """Kill to next step of a restart, measured here (benchmarks/recovery.py, 5 local nodes:
    10.32 s on 2026-12-05)."""
    checkpoint_read_s: float = 60.0
    """Reading the checkpoint after a restart (assumed: 1 min for a multi-GB model; the local
    measurement's model is tiny)."""
    checkpoint_interval_s: float = 2550.0
    """Training time between checkpoints (as RestartBaseline)."""
    checkpoint_interval_steps: int = 0
    """Steps between checkpoints instead (0: by time)."""
    checkpoint_write_s: float = 120.0
    """Training stall per checkpoint (as RestartBaseline)."""

    def __post_init__(self) -> None:
        _check_non_negative(self)


@dataclass(frozen=True, kw_only=True)
class Baselines:
    restart: RestartBaseline = RestartBaseline()
    redundant: RedundantBaseline = RedundantBaseline()
    torchrun: TorchrunBaseline = TorchrunBaseline()


SOURCES = {
    "oobleck": "this project's planner and runtime; recovery constants fitted to its metrics logs",
    "restart": "Varuna-like restart from checkpoint (Athlur et al., EuroSys 2022); constants of the Oobleck "
               "artifact's simulator for GPT-3 6.7B",
    "redundant": "Bamboo-like redundant computation (Thorpe et al., NSDI 2023); constants of the Oobleck "
                 "artifact's simulator for GPT-3 6.7B (checkpoints assumed)",
    "torchrun": "stock torchrun restart; restart_s measured here (benchmarks/recovery.py)",
}
