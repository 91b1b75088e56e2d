"""The cost model the planner optimises: 1F1B iteration time and per-worker memory of a split.

Note: [cost model]
    A pipeline of S stages runs M microbatches under 1F1B. Stage k (0-based) costs
    w_k = (forward + backward ms of its layers per microbatch) / width, where width is the
    number of workers the stage spans (1 in executable plans). Between stage k and k+1 each
    microbatch sends its activation forward and its gradient back, each costing
    c_k = latency + output_bytes(last layer of stage k) / bandwidth (intra-node bandwidth when
    both stages sit on one node, inter-node otherwise); transfers overlap compute.

        T(M) = max_k [ A_k + M * w_k ],   A_k = sum_{i<k} (w_i + 2 c_i)

    Stage k cannot start before the first microbatch has crossed stages 0..k-1, must then do
    M forward+backward passes itself, and the last gradient has to come back through the same
    stages: every term is a lower bound of the schedule's length, and the largest one is the
    critical path when the pipeline streams without bubbles. It is exact for balanced stages
    and never above a discrete-event simulation of torch's Schedule1F1B (`simulate.py`; the
    tests check both, and measure the gap on planned splits).

    Memory of a worker on stage k: (parameters + gradients + optimizer state of its layers +
    (S - k) microbatches of saved activations) / width, because 1F1B keeps up to S - k
    microbatches in flight on stage k (torch's Schedule1F1B warms up with S - k forwards).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from oobleck_elastic.planning.profile import ModelProfile

__all__ = ["Cluster", "CostTables", "iteration_ms", "stage_times"]


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """The hardware a plan is made for."""

    workers_per_node: int
    memory_per_worker: int
    intra_node_bandwidth: float = 50.0
    """GB/s."""
    inter_node_bandwidth: float = 12.5
    """GB/s."""
    link_latency_us: float = 20.0

    def __post_init__(self) -> None:
        if self.workers_per_node < 1:
            raise ValueError(f"workers_per_node must be >= 1, got {self.workers_per_node}")
        if self.memory_per_worker <= 0:
            raise ValueError(f"memory_per_worker must be > 0, got {self.memory_per_worker}")

    def transfer_ms(self, nbytes: float, cross_node: bool) -> float:
        bandwidth = self.inter_node_bandwidth if cross_node else self.intra_node_bandwidth
        return self.link_latency_us / 1e3 + nbytes / (bandwidth * 1e9) * 1e3


def iteration_ms(stage_ms: Sequence[float], send_ms: Sequence[float], microbatches: int) -> float:
    """T(M) of the cost model for stages with these compute and send times (see Note above)."""
    total = 0.0
    ahead = 0.0
    for k, w in enumerate(stage_ms):
        total = max(total, ahead + microbatches * w)
        ahead += w + (2 * send_ms[k] if k < len(send_ms) else 0.0)
    return total


def stage_times(profile: ModelProfile, cluster: Cluster, bounds: Sequence[int],
                nodes_of_stages: Sequence[int], width: int = 1) -> tuple[list[float], list[float]]:
    """Compute and send times of the stages [bounds[k], bounds[k+1]) placed on these nodes."""
    layers = profile.layers
    compute = [sum(layers[i].compute_ms for i in range(a, b)) / width
               for a, b in itertools.pairwise(bounds)]
    sends = [cluster.transfer_ms(layers[bounds[k + 1] - 1].output_bytes,
                                 nodes_of_stages[k] != nodes_of_stages[k + 1])
             for k in range(len(compute) - 1)]
    return compute, sends


class CostTables:
    """Prefix sums of a profile, as (L+1) x (L+1) matrices over layer ranges [l, e)."""

    def __init__(self, profile: ModelProfile, cluster: Cluster) -> None:
        layers = profile.layers
        self.num_layers = len(layers)
        compute = np.concatenate([[0.0], np.cumsum([x.compute_ms for x in layers])])
        static = np.concatenate([[0.0], np.cumsum([float(x.static_bytes) for x in layers])])
        act = np.concatenate([[0.0], np.cumsum([float(x.activation_bytes) for x in layers])])
        self.compute = compute[None, :] - compute[:, None]
        self.static = static[None, :] - static[:, None]
        self.activation = act[None, :] - act[:, None]
        out = np.array([0.0] + [float(x.output_bytes) for x in layers])
        # send_ms[cross][e]: cost of sending the output of layer e-1 (a stage ending at e).
        self.send_ms = {cross: np.array([np.inf] + [cluster.transfer_ms(b, cross) for b in out[1:]])
                        for cross in (False, True)}
        self.upper = np.triu(np.ones_like(self.compute, dtype=bool), k=1)

    def memory(self, l: int, e: int, in_flight: int, width: int) -> float:
        return (self.static[l, e] + in_flight * self.activation[l, e]) / width
