"""Pipeline templates: for each node count, the exact optimum of the cost model (cost.py).

A template for n nodes of G workers places S stages in order on the nodes, never across a node.
Executable templates run one stage per worker (S = n * G), which is what the runtime executes.
`wide=True` models the paper's stages spanning several workers of one node: every stage of the
template spans the same width g (a divisor of G), S = n * G / g, and compute and memory divide
by g (ideal intra-stage sharding); those plans are for dry runs at scale.

The optimum is exact: with stage positions fixed, the suffix value
    V_j(l) = min_e max( own_j(l, e),  w(l, e) + 2 c_j(e) + V_{j+1}(e) ),
    own_j(l, e) = M w(l, e) + (M - 1)(c_{j-1}(l) + c_j(e)) + bubble_j(l, e) + tail(l, e)
is the best max_{k>=j}(A_k - A_j + own_k) over splits of layers [l, L) into stages j..S-1
(own_j depends only on the stage's own layers, its position, the boundary above it, which is
layer l - 1's output, and the compute below it, which is the sum of the layers after e whatever
their split), and `max(a, b + x)` is monotone in x, so optimal suffixes compose into the
optimal whole (Bellman).
Memory is a per-stage constraint that only depends on (j, l, e), so it prunes transitions.
The DP runs over numpy matrices of layer ranges: O(S * L^2) per template.

Interleaved templates (`virtual_stages=v > 1`, for ScheduleInterleaved1F1B) split the layers
into v * P stages with the same search (each stage held to 1/v of a worker's memory), place
stage k on worker position k mod P, then check each worker's real memory and size the
pipeline with the interleaved estimate (cost.py, Note: [interleaved cost model]). That split
is the 1F1B optimum over v * P stages, not a proven optimum of the interleaved schedule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from oobleck_elastic.planning.cost import (
    Cluster,
    CostTables,
    interleaved_in_flight,
    interleaved_iteration_ms,
    interleaved_terms,
    iteration_ms,
    ring_factor,
    stage_cycles,
    stage_leads,
    stage_tails,
    stage_times,
)
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
    """Per worker, with the schedule's in-flight activations (interleaved: the whole worker's,
    all of its stages)."""
    grad_sync_ms: float = 0.0
    """The stage's gradient bytes over the inter-node bandwidth: its all-reduce across P
    pipelines costs ring_factor(P) times this (cost.py, Note: [cost model])."""
    optimizer_ms: float = 0.0
    """The optimizer step of the stage's layers, once per iteration."""

    def tail_ms(self, pipelines: int) -> float:
        """Gradient all-reduce across `pipelines` pipelines plus the optimizer step."""
        return ring_factor(pipelines) * self.grad_sync_ms + self.optimizer_ms


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
    virtual_stages: int = 1
    """Stages per worker position: 1, or v for ScheduleInterleaved1F1B (stage k on position
    k mod positions)."""
    pipelines: int = 1
    """The pipeline count (f + 1) the split and iteration_ms assume for the gradient
    all-reduce; an instantiation times it with its own count."""

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def positions(self) -> int:
        """Stage positions (workers, or groups of `width` workers) of the pipeline."""
        return len(self.stages) // self.virtual_stages

    @property
    def width(self) -> int:
        return len(self.stages[0].workers)

    @property
    def min_microbatches(self) -> int:
        """Fewest microbatches the pipeline runs: one per position fills it."""
        return self.positions

    def runs_microbatches(self, microbatches: int) -> bool:
        """Whether torch's schedule accepts this count: ScheduleInterleaved1F1B needs it to be
        a multiple of its rounds, max(1, m // positions)."""
        if microbatches < self.min_microbatches:
            return False
        return self.virtual_stages == 1 or microbatches % max(1, microbatches // self.positions) == 0

    def tails(self, pipelines: int | None = None) -> list[float]:
        """Each stage's all-reduce (across `pipelines`, default self.pipelines) and optimizer step."""
        p = self.pipelines if pipelines is None else pipelines
        return [s.tail_ms(p) for s in self.stages]

    def iteration_ms_at(self, microbatches: int, pipelines: int | None = None) -> float:
        """T(microbatches) with `pipelines` pipelines summing gradients (default self.pipelines)."""
        compute = [s.compute_ms for s in self.stages]
        if self.virtual_stages > 1:
            return interleaved_iteration_ms(compute, [s.send_ms for s in self.stages], self.positions,
                                            microbatches, self.tails(pipelines))
        return iteration_ms(compute, [s.forward_ms for s in self.stages],
                            [s.send_ms for s in self.stages[:-1]], microbatches, self.tails(pipelines))

    def step_parts(self, microbatches: int, pipelines: int | None = None) -> dict[str, float]:
        """The estimated step (`iteration_ms_at`) in its parts, on the stage (interleaved: the
        worker position) that bounds it: the pipeline schedule up to that stage's last
        backward, its gradient all-reduce across the pipelines, and its optimizer step. They
        sum to the step."""
        p = self.pipelines if pipelines is None else pipelines
        total = self.iteration_ms_at(microbatches, p)
        if self.virtual_stages > 1:  # the tail term is the largest of the positions' summed tails
            bound = max(range(self.positions), key=lambda q: sum(s.tail_ms(p) for s in self.stages[q::self.positions]))
            stages = self.stages[bound::self.positions]
        else:  # the stage whose lead, microbatches and tail make the step
            compute = [s.compute_ms for s in self.stages]
            leads = stage_leads(compute, [s.forward_ms for s in self.stages], [s.send_ms for s in self.stages[:-1]])
            cycles = stage_cycles(compute, [s.send_ms for s in self.stages[:-1]])
            ends = [lead + microbatches * c + s.tail_ms(p) for lead, c, s in zip(leads, cycles, self.stages)]
            stages = (self.stages[ends.index(max(ends))],)
        all_reduce = sum(ring_factor(p) * s.grad_sync_ms for s in stages)
        optimizer = sum(s.optimizer_ms for s in stages)
        return {"schedule": total - all_reduce - optimizer, "all_reduce": all_reduce, "optimizer": optimizer}

    def times(self, total: int, pipelines: int | None = None) -> np.ndarray:
        """T(m) for m = min_microbatches .. total, vectorised (inf where the schedule cannot
        run m); `pipelines` as in iteration_ms_at."""
        m = np.arange(self.min_microbatches, total + 1, dtype=float)
        compute = np.array([s.compute_ms for s in self.stages])
        tails = np.array(self.tails(pipelines))
        if self.virtual_stages > 1:
            per_worker, fixed = interleaved_terms(list(compute), [s.send_ms for s in self.stages], self.positions,
                                                  list(tails))
            t = m * per_worker + fixed
        else:
            sends = [s.send_ms for s in self.stages[:-1]]
            leads = np.array(stage_leads(list(compute), [s.forward_ms for s in self.stages], sends)) + tails
            cycles = np.array(stage_cycles(list(compute), sends))
            t = (leads[:, None] + m[None, :] * cycles[:, None]).max(axis=0) if m.size else m
        if self.virtual_stages == 1:
            return t
        valid = np.array([self.runs_microbatches(int(x)) for x in m], dtype=bool)
        return np.where(valid, t, np.inf)

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
                         bounds: Sequence[int], microbatches: int, virtual_stages: int = 1,
                         pipelines: int = 1) -> PipelineTemplate:
    """The template for a given split (bounds[0] = 0 < ... < bounds[-1] = L) on `nodes` nodes;
    with virtual_stages = v, stage k runs on position k mod (stages / v); timed for
    `pipelines` pipelines summing gradients."""
    num_stages = len(bounds) - 1
    g = cluster.workers_per_node
    positions = num_stages // virtual_stages
    width = nodes * g // positions if positions else 0
    if positions * virtual_stages != num_stages or positions * width != nodes * g or g % width:
        raise ValueError(f"{num_stages} stages ({virtual_stages} per position) do not tile "
                         f"{nodes} node(s) of {g} workers evenly")
    position = [k % positions for k in range(num_stages)]
    placement = [(p * width) // g for p in position]
    compute, forward, sends = stage_times(profile, cluster, bounds, placement, width)
    syncs, optimizer = stage_tails(profile, cluster, bounds, width)
    tables = CostTables(profile, cluster)
    if virtual_stages == 1:
        memory = [tables.memory(bounds[k], bounds[k + 1], num_stages - k, width) for k in range(num_stages)]
    else:
        per_position = []
        for p in range(positions):
            mine = range(p, num_stages, positions)
            static = sum(tables.memory(bounds[k], bounds[k + 1], 0, width) for k in mine)
            act = max(tables.memory(bounds[k], bounds[k + 1], 1, width)
                      - tables.memory(bounds[k], bounds[k + 1], 0, width) for k in mine)
            per_position.append(static + interleaved_in_flight(p, positions, virtual_stages) * act)
        memory = [per_position[p] for p in position]
    stages = tuple(
        StagePlan(layers=(bounds[k], bounds[k + 1]), node=placement[k],
                  workers=tuple(range((position[k] * width) % g, (position[k] * width) % g + width)),
                  compute_ms=compute[k], forward_ms=forward[k],
                  send_ms=sends[k] if k < num_stages - 1 and positions > 1 else 0.0, memory_bytes=int(memory[k]),
                  grad_sync_ms=syncs[k], optimizer_ms=optimizer[k])
        for k in range(num_stages))
    template = PipelineTemplate(nodes=nodes, workers_per_node=g, stages=stages, microbatches=microbatches,
                                iteration_ms=0.0, virtual_stages=virtual_stages, pipelines=pipelines)
    return replace(template, iteration_ms=template.iteration_ms_at(microbatches))


def _optimal_bounds(tables: CostTables, cluster: Cluster, nodes: int, width: int,
                    microbatches: int, virtual_stages: int = 1, pipelines: int = 1) -> list[int] | None:
    """The exact optimal split for S = v * nodes * G / width stages, or None if none fits
    memory (with v > 1 each stage gets 1/v of a worker's budget)."""
    num_layers = tables.num_layers
    g = cluster.workers_per_node
    positions = nodes * g // width
    num_stages = positions * virtual_stages
    if num_stages > num_layers:
        return None
    compute = tables.compute / width
    forward = tables.forward / width
    below = tables.below[None, :] / width
    budget = cluster.memory_per_worker * width / virtual_stages
    # a stage's own term: its microbatches and their exchanges with its neighbours, then its
    # all-reduce and optimizer step (Note: [cost model]); with interleaving the split is the
    # 1F1B one, tails included
    big_m = microbatches * compute + tables.tail(pipelines, width)
    exchanges = microbatches - 1
    value = np.full(num_layers + 1, np.inf)
    choices: list[np.ndarray] = []

    def exchange(boundary: int) -> np.ndarray:
        """c across `boundary`, by the layer it follows (none between the stages of a one-worker
        interleaved pipeline: torch hands them over in the worker)."""
        if positions == 1:
            return np.zeros(num_layers + 1)
        return tables.send_ms[_crosses(boundary, positions, width, g)]

    for j in reversed(range(num_stages)):
        fits = tables.upper & (tables.static + (num_stages - j) * tables.activation <= budget)
        # c_{j-1}(l): the exchange with the stage above, across the output of layer l - 1
        up = exchange(j - 1)[:, None] if j > 0 else 0.0
        if j == num_stages - 1:
            own = big_m + exchanges * up
            cost = np.where(fits[:, num_layers], own[:, num_layers], np.inf)
            choice = np.full(num_layers + 1, num_layers)
        else:
            down = exchange(j)[None, :]
            bubble = np.maximum(down, below + 2 * down - (num_stages - j - 1) * (forward + up))
            own = big_m + exchanges * (up + down) + bubble
            total = np.maximum(own, compute + 2 * down + value[None, :])
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


def _crosses(boundary: int, positions: int, width: int, workers_per_node: int) -> bool:
    """Whether stages `boundary` and `boundary + 1` sit on different nodes."""
    return ((boundary % positions) * width) // workers_per_node != \
        (((boundary + 1) % positions) * width) // workers_per_node


def plan_template(profile: ModelProfile, cluster: Cluster, nodes: int, microbatches: int, *,
                  wide: bool = False, tables: CostTables | None = None,
                  virtual_stages: int = 1, pipelines: int = 1) -> PipelineTemplate | None:
    """The optimal template for `nodes` nodes, or None when no split fits."""
    if wide and virtual_stages > 1:
        raise ValueError("wide templates and interleaved (virtual_stages > 1) cannot be combined")
    tables = tables or CostTables(profile, cluster)
    g = cluster.workers_per_node
    widths = [w for w in range(1, g + 1) if g % w == 0] if wide else [1]
    best: PipelineTemplate | None = None
    for width in widths:
        bounds = _optimal_bounds(tables, cluster, nodes, width, microbatches, virtual_stages, pipelines)
        if bounds is None:
            continue
        candidate = template_from_bounds(profile, cluster, nodes, bounds, microbatches, virtual_stages, pipelines)
        if any(s.memory_bytes > cluster.memory_per_worker for s in candidate.stages):
            continue  # interleaving's extra in-flight activations do not fit
        if best is None or candidate.iteration_ms < best.iteration_ms:
            best = candidate
    return best


def _why_infeasible(profile: ModelProfile, cluster: Cluster, nodes: int, wide: bool,
                    virtual_stages: int = 1) -> str:
    stages = nodes if wide else nodes * cluster.workers_per_node * virtual_stages
    if stages > profile.num_layers:
        return (f"{stages} stages needed but the model has only {profile.num_layers} layers"
                + (f" ({virtual_stages} stages per worker)" if virtual_stages > 1 else "")
                + ("" if wide or virtual_stages > 1 else "; --wide lets stages span workers"))
    if virtual_stages > 1:
        return (f"no split fits the per-worker memory budget ({virtual_stages} stages per worker: "
                "interleaving keeps more activations in flight than 1F1B)")
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
                   total_microbatches: int, wide: bool = False, virtual_stages: int = 1) -> TemplateSet:
    """Templates for every node count in [n0, N - f*n0], capped where none is feasible;
    virtual_stages > 1 plans interleaved templates (see the module docstring)."""
    from oobleck_elastic.errors import PlanningError

    tables = CostTables(profile, cluster)
    templates: dict[int, PipelineTemplate] = {}
    infeasible: dict[int, str] = {}
    n0 = None
    n = 1
    stage_cap = profile.num_layers if wide else profile.num_layers // (cluster.workers_per_node * virtual_stages)
    while n <= max_nodes and (n0 is None or n <= max_nodes - fault_tolerance * n0):
        if n > stage_cap:
            if n0 is not None:
                infeasible[n] = _why_infeasible(profile, cluster, n, wide, virtual_stages)
                upper = max_nodes - fault_tolerance * n0
                if upper > n:
                    infeasible[n] = f"{n}..{upper} nodes: " + infeasible[n]
            break
        template = plan_template(profile, cluster, n,
                                 nominal_microbatches(total_microbatches, n, max_nodes),
                                 wide=wide, tables=tables, virtual_stages=virtual_stages,
                                 pipelines=fault_tolerance + 1)
        if template is not None:
            templates[n] = template
            n0 = n0 or n
        elif n0 is not None:
            infeasible[n] = _why_infeasible(profile, cluster, n, wide, virtual_stages)
        n += 1
    if n0 is None:
        raise PlanningError(
            f"no pipeline of 1..{min(max_nodes, max(stage_cap, 1))} node(s) fits: "
            + _why_infeasible(profile, cluster, min(max_nodes, max(stage_cap, 1)), wide, virtual_stages)
            + f" (memory_per_worker = {_bytes(cluster.memory_per_worker)}); "
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


def _bytes(n: float) -> str:
    """A byte count in the unit that reads best (for messages)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} bytes"
