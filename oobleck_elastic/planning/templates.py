"""Pipeline templates: for each node count, the exact optimum of the cost model (cost.py).

A template for n nodes of G workers places S stages in order on the nodes, never across a node.
Executable templates run one stage per worker (S = n * G), which is what the runtime executes.
`wide=True` models the paper's stages spanning several workers of one node: every stage of the
template spans the same width g (a divisor of G), S = n * G / g, and compute and memory divide
by g (ideal intra-stage sharding); those plans are for dry runs at scale.

The optimum is exact: with stage positions fixed, the suffix value
    V_j(l) = min_e max( M w(l, e) + bubble_j(l, e),  w(l, e) + 2 c_j(e) + V_{j+1}(e) )
is the best max_{k>=j}(A_k - A_j + M w_k + bubble_k) over splits of layers [l, L) into stages
j..S-1 (bubble_j depends only on the stage's own layers and position, and on the compute below
it, which is the sum of the layers after e whatever their split), and `max(a, b + x)` is
monotone in x, so optimal suffixes compose into the optimal whole (Bellman).
Memory is a per-stage constraint that only depends on (j, l, e), so it prunes transitions.
The DP runs over numpy matrices of layer ranges: O(S * L^2) per template.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from oobleck_elastic.planning.cost import Cluster, CostTables, iteration_ms, stage_times
from oobleck_elastic.planning.profile import ModelProfile

__all__ = ["StagePlan", "PipelineTemplate", "TemplateSet", "plan_template", "plan_templates",
           "template_from_bounds", "nominal_microbatches"]


@dataclass(frozen=True, kw_only=True)
class StagePlan:
    """One stage of a template: layers [start, end) on `workers` of node position `node`."""

    layers: tuple[int, int]
    node: int
    workers: tuple[int, ...]
    compute_ms: float
    """Forward + backward per microbatch."""
    forward_ms: float
    """Forward per microbatch."""
    send_ms: float
    """One activation (or gradient) transfer to the next stage; 0 for the last stage."""
    memory_bytes: int
    """Per worker, with the 1F1B in-flight activations."""


@dataclass(frozen=True, kw_only=True)
class PipelineTemplate:
    """How a pipeline of `nodes` nodes is built; reused by every reconfiguration."""

    nodes: int
    workers_per_node: int
    stages: tuple[StagePlan, ...]
    microbatches: int
    """The microbatch count the split was optimised for."""
    iteration_ms: float
    """Cost-model iteration time at `microbatches`."""

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def width(self) -> int:
        return len(self.stages[0].workers)

    def iteration_ms_at(self, microbatches: int) -> float:
        return iteration_ms([s.compute_ms for s in self.stages], [s.forward_ms for s in self.stages],
                            [s.send_ms for s in self.stages[:-1]], microbatches)

    def bounds(self) -> list[int]:
        return [s.layers[0] for s in self.stages] + [self.stages[-1].layers[1]]


@dataclass(frozen=True, kw_only=True)
class TemplateSet:
    """All templates of a job plus what the planner found it could not cover."""

    templates: tuple[PipelineTemplate, ...]
    min_nodes: int
    """n0: the fewest nodes that hold one replica."""
    max_nodes: int
    """N: nodes the job was planned for."""
    fault_tolerance: int
    infeasible: dict[int, str] = field(default_factory=dict)
    """Node counts in [n0, N - f*n0] without a template, and why."""
    uncovered: tuple[int, ...] = ()
    """Live node counts in [(f+1)*n0, N] that no mix of >= f+1 templates uses exactly."""
    layer_state_bytes: tuple[int, ...] = ()
    """Parameters + optimizer state of each layer: what a transfer moves."""

    def by_nodes(self) -> dict[int, PipelineTemplate]:
        return {t.nodes: t for t in self.templates}

    def get(self, nodes: int) -> PipelineTemplate | None:
        return self.by_nodes().get(nodes)


def nominal_microbatches(total_microbatches: int, nodes: int, max_nodes: int) -> int:
    """The microbatch count a template is optimised for: its share if the whole job ran
    pipelines of its size (total * n / N), at least 1."""
    return max(1, round(total_microbatches * nodes / max_nodes))


def template_from_bounds(profile: ModelProfile, cluster: Cluster, nodes: int,
                         bounds: Sequence[int], microbatches: int) -> PipelineTemplate:
    """The template for a given split (bounds[0] = 0 < ... < bounds[-1] = L) on `nodes` nodes."""
    num_stages = len(bounds) - 1
    g = cluster.workers_per_node
    width = nodes * g // num_stages
    if num_stages * width != nodes * g or g % width:
        raise ValueError(f"{num_stages} stages do not tile {nodes} node(s) of {g} workers evenly")
    placement = [(k * width) // g for k in range(num_stages)]
    compute, forward, sends = stage_times(profile, cluster, bounds, placement, width)
    tables = CostTables(profile, cluster)
    stages = tuple(
        StagePlan(layers=(bounds[k], bounds[k + 1]), node=placement[k],
                  workers=tuple(range((k * width) % g, (k * width) % g + width)),
                  compute_ms=compute[k], forward_ms=forward[k],
                  send_ms=sends[k] if k < num_stages - 1 else 0.0,
                  memory_bytes=int(tables.memory(bounds[k], bounds[k + 1], num_stages - k, width)))
        for k in range(num_stages))
    return PipelineTemplate(nodes=nodes, workers_per_node=g, stages=stages, microbatches=microbatches,
                            iteration_ms=iteration_ms(compute, forward, sends, microbatches))


def _optimal_bounds(tables: CostTables, cluster: Cluster, nodes: int, width: int,
                    microbatches: int) -> list[int] | None:
    """The exact optimal split for S = nodes * G / width stages, or None if none fits memory."""
    num_layers = tables.num_layers
    g = cluster.workers_per_node
    num_stages = nodes * g // width
    if num_stages > num_layers:
        return None
    compute = tables.compute / width
    forward = tables.forward / width
    below = tables.below[None, :] / width
    budget = cluster.memory_per_worker * width
    big_m = microbatches * compute
    value = np.full(num_layers + 1, np.inf)
    choices: list[np.ndarray] = []
    for j in reversed(range(num_stages)):
        fits = tables.upper & (tables.static + (num_stages - j) * tables.activation <= budget)
        if j == num_stages - 1:
            cost = np.where(fits[:, num_layers], big_m[:, num_layers], np.inf)
            choice = np.full(num_layers + 1, num_layers)
        else:
            cross = (j * width) // g != ((j + 1) * width) // g
            send = 2 * tables.send_ms[cross][None, :]
            bubble = np.maximum(0.0, below + send - (num_stages - j - 1) * forward)
            total = np.maximum(big_m + bubble, compute + send + value[None, :])
            total = np.where(fits, total, np.inf)
            choice = np.argmin(total, axis=1)
            cost = total[np.arange(num_layers + 1), choice]
        choices.append(choice)
        value = cost
    if not np.isfinite(value[0]):
        return None
    bounds = [0]
    for choice in reversed(choices):
        bounds.append(int(choice[bounds[-1]]))
    return bounds


def plan_template(profile: ModelProfile, cluster: Cluster, nodes: int, microbatches: int, *,
                  wide: bool = False, tables: CostTables | None = None) -> PipelineTemplate | None:
    """The optimal template for `nodes` nodes, or None when no split fits."""
    tables = tables or CostTables(profile, cluster)
    g = cluster.workers_per_node
    widths = [w for w in range(1, g + 1) if g % w == 0] if wide else [1]
    best: PipelineTemplate | None = None
    for width in widths:
        bounds = _optimal_bounds(tables, cluster, nodes, width, microbatches)
        if bounds is None:
            continue
        candidate = template_from_bounds(profile, cluster, nodes, bounds, microbatches)
        if best is None or candidate.iteration_ms < best.iteration_ms:
            best = candidate
    return best


def _why_infeasible(profile: ModelProfile, cluster: Cluster, nodes: int, wide: bool) -> str:
    stages = nodes if wide else nodes * cluster.workers_per_node
    if stages > profile.num_layers:
        return (f"{stages} stages needed but the model has only {profile.num_layers} layers"
                + ("" if wide else "; --wide lets stages span workers"))
    return "no split fits the per-worker memory budget"


def _coverage(sizes: Sequence[int], lo: int, hi: int, min_pipelines: int) -> list[int]:
    """Live node counts in [lo, hi] that no multiset of >= min_pipelines sizes sums to."""
    # reach[t, c]: t nodes are exactly covered by c pipelines (c capped at min_pipelines).
    reach = np.zeros((hi + 1, min_pipelines + 1), dtype=bool)
    reach[0, 0] = True
    for t in range(1, hi + 1):
        for s in sizes:
            if s > t:
                break
            prev = reach[t - s]
            reach[t, 1:] |= prev[:-1]
            reach[t, min_pipelines] |= prev[min_pipelines]
    return [t for t in range(lo, hi + 1) if not reach[t, min_pipelines]]


def plan_templates(profile: ModelProfile, cluster: Cluster, *, max_nodes: int, fault_tolerance: int,
                   total_microbatches: int, wide: bool = False) -> TemplateSet:
    """Templates for every node count in [n0, N - f*n0], capped where none is feasible."""
    from oobleck_elastic.errors import PlanningError

    tables = CostTables(profile, cluster)
    templates: dict[int, PipelineTemplate] = {}
    infeasible: dict[int, str] = {}
    n0 = None
    n = 1
    stage_cap = profile.num_layers if wide else profile.num_layers // cluster.workers_per_node
    while n <= max_nodes and (n0 is None or n <= max_nodes - fault_tolerance * n0):
        if n > stage_cap:
            if n0 is not None:
                infeasible[n] = _why_infeasible(profile, cluster, n, wide)
                upper = max_nodes - fault_tolerance * n0
                if upper > n:
                    infeasible[n] = f"{n}..{upper} nodes: " + infeasible[n]
            break
        template = plan_template(profile, cluster, n,
                                 nominal_microbatches(total_microbatches, n, max_nodes),
                                 wide=wide, tables=tables)
        if template is not None:
            templates[n] = template
            n0 = n0 or n
        elif n0 is not None:
            infeasible[n] = _why_infeasible(profile, cluster, n, wide)
        n += 1
    if n0 is None:
        raise PlanningError(
            f"no pipeline of 1..{min(max_nodes, max(stage_cap, 1))} node(s) fits: "
            + _why_infeasible(profile, cluster, min(max_nodes, max(stage_cap, 1)), wide)
            + f" (memory_per_worker = {cluster.memory_per_worker / 2**30:.2f} GiB); "
            "add nodes, raise planner.memory_per_worker or use a smaller microbatch")
    if max_nodes < (fault_tolerance + 1) * n0:
        raise PlanningError(
            f"fault_tolerance={fault_tolerance} needs {fault_tolerance + 1} replicas of at least "
            f"{n0} node(s) each = {(fault_tolerance + 1) * n0} nodes, but the job has {max_nodes}; "
            "add nodes or lower fault_tolerance")
    uncovered = _coverage(sorted(templates), (fault_tolerance + 1) * n0, max_nodes,
                          fault_tolerance + 1)
    return TemplateSet(templates=tuple(templates[k] for k in sorted(templates)), min_nodes=n0,
                       max_nodes=max_nodes, fault_tolerance=fault_tolerance,
                       infeasible=infeasible, uncovered=tuple(uncovered),
                       layer_state_bytes=tuple(x.state_bytes for x in profile.layers))
