"""Instantiation: which templates run, on which nodes, and how the global batch is split.

Note: [batch split]
    The global batch of B samples is B/b microbatches. Pipeline i gets m_i >= S_i of them
    (1F1B fills its S_i stages), sum m_i = B/b exactly, and the split minimises the slowest
    pipeline's cost-model time max_i T_i(m_i). Pipelines take contiguous sample slices in
    pipeline order (`Instantiation.sample_slices`). Interleaved pipelines only run counts
    their schedule accepts (`PipelineTemplate.runs_microbatches`); their split is an exact
    dynamic program over (pipeline, microbatches so far) instead of the greedy give-back.

Choosing the mix is a search over the target time T*: at T* template n can hold
cap_n(T*) = max{m : T_n(m) <= T*} microbatches, so "can the live nodes hold B/b by T*" is an
unbounded knapsack over node counts (all nodes used, at least f+1 pipelines) maximising the
capacity. Feasibility is monotone in T*, and the optimal T* is one of the values T_n(m), so a
binary search over those values finds the exact optimum of the cost model.

The gradient all-reduce in T depends on how many pipelines there are (cost.py, Note: [cost
model]); the search and the batch split time every template at the pipeline count it was
planned for (f + 1), which keeps the knapsack one search, and the chosen instantiation's
`iteration_ms` is then timed with its real pipeline count (the planner's estimate of the step).
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from oobleck_elastic.errors import InfeasibleBatchError, PlanningError
from oobleck_elastic.planning.templates import PipelineTemplate, TemplateSet

__all__ = ["PipelinePlan", "Instantiation", "check_instantiation", "fresh_layout", "instantiate", "split_batch",
           "build_instantiation"]


@dataclass(frozen=True, kw_only=True)
class PipelinePlan:
    """One pipeline: its template (by node count), its nodes in stage order, its microbatches."""

    template: int
    nodes: tuple[int, ...]
    microbatches: int
    iteration_ms: float


@dataclass(frozen=True, kw_only=True)
class Instantiation:
    """The pipelines of one generation."""

    pipelines: tuple[PipelinePlan, ...]
    global_batch_size: int
    microbatch_size: int
    iteration_ms: float
    spares: tuple[int, ...] = ()
    """Live nodes left out of every pipeline (no template fits them); they train again once
    enough nodes join."""

    @property
    def nodes(self) -> tuple[int, ...]:
        """Every member node, spares included."""
        return tuple(sorted([n for p in self.pipelines for n in p.nodes] + list(self.spares)))

    def sample_slices(self) -> list[tuple[int, int]]:
        """[start, end) of each pipeline's samples within the step's global batch."""
        slices, start = [], 0
        for p in self.pipelines:
            end = start + p.microbatches * self.microbatch_size
            slices.append((start, end))
            start = end
        return slices


def check_instantiation(inst: Instantiation, templates: TemplateSet, global_batch: int, microbatch: int) -> None:
    """Raises PlanningError unless `inst` is one this job could run: its batch, pipelines of
    templates it has on as many distinct nodes, and microbatches that cover the global batch
    exactly (an instantiation read from the store is checked before anything acts on it)."""
    by_nodes = templates.by_nodes()
    problems = []
    if (inst.global_batch_size, inst.microbatch_size) != (global_batch, microbatch):
        problems.append(f"batch {inst.global_batch_size}/{inst.microbatch_size}, "
                        f"the job's is {global_batch}/{microbatch}")
    for i, p in enumerate(inst.pipelines):
        if p.template not in by_nodes or len(p.nodes) != p.template:
            problems.append(f"pipeline {i} runs a {p.template}-node template on {len(p.nodes)} node(s) "
                            f"(templates: {sorted(by_nodes)})")
        if p.microbatches < 1:
            problems.append(f"pipeline {i} has {p.microbatches} microbatches")
    everyone = [n for p in inst.pipelines for n in p.nodes] + list(inst.spares)
    if len(set(everyone)) != len(everyone) or any(not isinstance(n, int) or n < 0 for n in everyone):
        problems.append(f"nodes {everyone} are not distinct node ids")
    covered = sum(p.microbatches for p in inst.pipelines) * microbatch
    if not inst.pipelines:  # nothing would train, and every sample of the step would be lost
        problems.append("it has no pipeline")
    elif covered != global_batch:
        problems.append(f"its microbatches hold {covered} samples, not the global batch of {global_batch}")
    if problems:
        raise PlanningError("invalid instantiation: " + "; ".join(problems))


def _capacity(times: np.ndarray, first: int, target: float) -> int:
    """max m with T(m) <= target, or first - 1 when even m = first is too slow. T is
    non-decreasing where finite; inf marks counts the schedule cannot run."""
    if np.isinf(times[-1:]).any() or not np.isfinite(times).all():
        fits = np.nonzero(times <= target)[0]
        return int(fits[-1]) + first if fits.size else first - 1
    return int(np.searchsorted(times, target, side="right")) - 1 + first


def _balanced(times: Sequence[np.ndarray], firsts: Sequence[int], total: int,
              kinds: Sequence[int] | None = None) -> list[int]:
    """m_i minimising max_i T_i(m_i) with sum m_i = total and m_i >= firsts[i].

    `kinds[i]` says which entry of `times`/`firsts` pipeline i uses (default: its own), so a
    thousand pipelines of a dozen templates cost a dozen searches, not a thousand."""
    kinds = list(range(len(times))) if kinds is None else list(kinds)
    if any(not np.isfinite(t).all() for t in times):
        return _balanced_exact(times, firsts, total, kinds)
    multiplicity = np.bincount(kinds, minlength=len(times))
    candidates = np.unique(np.concatenate([t for t, n in zip(times, multiplicity) if n and t.size]))

    def capacities(target: float) -> np.ndarray:
        return np.array([_capacity(t, f, target) for t, f in zip(times, firsts)])

    lo, hi = 0, len(candidates) - 1
    while lo < hi:  # smallest target whose capacities hold `total`
        mid = (lo + hi) // 2
        caps = capacities(candidates[mid])
        used = multiplicity > 0
        if np.all(caps[used] >= np.array(firsts)[used]) and int(caps @ multiplicity) >= total:
            hi = mid
        else:
            lo = mid + 1
    caps = capacities(candidates[lo])
    counts = [min(int(caps[k]), firsts[k] + times[k].size - 1) for k in kinds]
    # Give back the surplus from the slowest pipelines; ties go to the later pipeline so the
    # split is deterministic.
    heap = [(-times[k][counts[i] - firsts[k]], -i) for i, k in enumerate(kinds) if counts[i] > firsts[k]]
    heapq.heapify(heap)
    for _ in range(sum(counts) - total):
        _, neg_i = heapq.heappop(heap)
        i = -neg_i
        k = kinds[i]
        counts[i] -= 1
        if counts[i] > firsts[k]:
            heapq.heappush(heap, (-times[k][counts[i] - firsts[k]], neg_i))
    return counts


def _split_table(times: Sequence[np.ndarray], firsts: Sequence[int], limit: int,
                 kinds: Sequence[int]) -> tuple[np.ndarray, list[np.ndarray]]:
    """best[t]: least max_i T_i(m_i) over runnable m_i summing to t <= limit (inf: none), and
    each pipeline's choice of m_i for every running total."""
    best = np.full(limit + 1, np.inf)
    best[0] = -np.inf
    picks = []
    for k in kinds:
        nxt = np.full(limit + 1, np.inf)
        pick = np.zeros(limit + 1, dtype=np.int64)
        for offset, t_m in enumerate(times[k]):
            m = firsts[k] + offset
            if not np.isfinite(t_m) or m > limit:
                continue
            value = np.maximum(best[:limit + 1 - m], t_m)
            better = value < nxt[m:]
            nxt[m:][better] = value[better]
            pick[m:][better] = m
        best = nxt
        picks.append(pick)
    return best, picks


def _balanced_exact(times: Sequence[np.ndarray], firsts: Sequence[int], total: int,
                    kinds: Sequence[int]) -> list[int]:
    """The exact min-max split when some counts cannot run (interleaved schedules)."""
    best, picks = _split_table(times, firsts, total, kinds)
    if not np.isfinite(best[total]):
        raise ValueError(f"no split of {total} microbatches gives every pipeline a runnable count")
    counts, t = [], total
    for pick in reversed(picks):
        counts.append(int(pick[t]))
        t -= counts[-1]
    return counts[::-1]


def _nearest_batch_error(needed: int, microbatch_size: int, global_batch: int, what: str) -> InfeasibleBatchError:
    nearest = needed * microbatch_size
    return InfeasibleBatchError(
        f"global batch {global_batch} is {global_batch // microbatch_size} microbatches of "
        f"{microbatch_size}, but {what} need at least {needed} (one per stage for 1F1B); "
        f"the nearest valid global batch is {nearest} (train.global_batch_size)",
        nearest_valid=nearest)


def split_batch(templates: Sequence[PipelineTemplate], global_batch: int, microbatch_size: int) -> list[int]:
    """Microbatches per pipeline for a fixed mix of templates (see Note: [batch split])."""
    total = global_batch // microbatch_size
    firsts = [t.min_microbatches for t in templates]
    if sum(firsts) > total:
        raise _nearest_batch_error(sum(firsts), microbatch_size, global_batch,
                                   f"{len(templates)} pipelines with {sum(firsts)} stage positions")
    distinct: dict[int, int] = {}
    kinds = [distinct.setdefault(id(t), len(distinct)) for t in templates]
    unique = list({id(t): t for t in templates}.values())
    times = [t.times(total) for t in unique]
    if any(t.virtual_stages > 1 for t in unique):
        limit = 2 * total + sum(firsts)
        best, _ = _split_table([t.times(limit) for t in unique], [t.min_microbatches for t in unique],
                               limit, kinds)
        if not np.isfinite(best[total]):
            runnable = np.nonzero(np.isfinite(best))[0]
            nearest = int(runnable[np.argmin(np.abs(runnable - total))]) * microbatch_size
            raise InfeasibleBatchError(
                f"global batch {global_batch} is {total} microbatches of {microbatch_size}, which "
                f"{len(templates)} interleaved pipelines of {sorted(t.positions for t in templates)} "
                "positions cannot split into counts ScheduleInterleaved1F1B runs (each a multiple of "
                f"its rounds, m // positions); the nearest valid global batch is {nearest} "
                "(train.global_batch_size)", nearest_valid=nearest)
    return _balanced(times, [t.min_microbatches for t in unique], total, kinds)


def build_instantiation(templates: Sequence[PipelineTemplate], nodes: Sequence[Sequence[int]],
                        global_batch: int, microbatch_size: int, spares: Sequence[int] = ()) -> Instantiation:
    """An Instantiation of these templates on these node lists, with the balanced batch split."""
    counts = split_batch(templates, global_batch, microbatch_size)
    pipelines = tuple(
        PipelinePlan(template=t.nodes, nodes=tuple(n), microbatches=m,
                     iteration_ms=t.iteration_ms_at(m, len(templates)))
        for t, n, m in zip(templates, nodes, counts, strict=True))
    return Instantiation(pipelines=pipelines, global_batch_size=global_batch,
                         microbatch_size=microbatch_size,
                         iteration_ms=max(p.iteration_ms for p in pipelines),
                         spares=tuple(sorted(spares)))


def _best_mix(sizes: np.ndarray, caps: np.ndarray, num_nodes: int, min_pipelines: int):
    """Max total capacity over multisets of sizes summing to num_nodes with >= min_pipelines
    items: returns (capacity, chosen item indices) or (-1, []) when impossible."""
    k = min_pipelines
    best = np.full((num_nodes + 1, k + 1), -1, dtype=np.int64)
    best[0, 0] = 0
    pick = np.full((num_nodes + 1, k + 1, 2), -1, dtype=np.int64)  # (item, previous count)
    rows = np.arange(k + 1)
    for t in range(1, num_nodes + 1):
        usable = np.nonzero(sizes <= t)[0]
        if usable.size == 0:
            continue
        prev = best[t - sizes[usable]]                      # (items, k+1) by previous count
        gain = np.where(prev >= 0, prev + caps[usable, None], -1)
        # count c -> min(c + 1, k): column c' gets previous column c' - 1, and column k also
        # gets previous column k.
        shifted = np.full_like(gain, -1)
        shifted[:, 1:] = gain[:, :-1]
        from_prev = np.broadcast_to(rows - 1, gain.shape).copy()
        stay = gain[:, k] > shifted[:, k]
        shifted[stay, k] = gain[stay, k]
        from_prev[stay, k] = k
        item = shifted.argmax(axis=0)
        best[t] = shifted[item, rows]
        pick[t, :, 0] = usable[item]
        pick[t, :, 1] = from_prev[item, rows]
    if best[num_nodes, k] < 0:
        return -1, []
    chosen, t, c = [], num_nodes, k
    while t > 0:
        item, c = pick[t, c]
        chosen.append(int(item))
        t -= int(sizes[item])
    return int(best[num_nodes, k]), chosen


def instantiate(template_set: TemplateSet, nodes: Sequence[int], global_batch: int,
                microbatch_size: int, *, min_pipelines: int | None = None) -> Instantiation:
    """The fastest instantiation on `nodes` (all used) with at least min_pipelines pipelines
    (default f + 1) for the fixed global batch."""
    min_pipelines = template_set.fault_tolerance + 1 if min_pipelines is None else min_pipelines
    total = global_batch // microbatch_size
    node_ids = sorted(nodes)
    usable = [t for t in template_set.templates if t.min_microbatches <= total]
    if not usable:
        smallest = min(t.min_microbatches for t in template_set.templates)
        raise _nearest_batch_error(smallest, microbatch_size, global_batch, "the smallest pipeline's stages")
    sizes = np.array([t.nodes for t in usable])
    times = [t.times(total) for t in usable]
    candidates = np.unique(np.concatenate(times))
    candidates = candidates[np.isfinite(candidates)]

    def mix(target: float) -> tuple[int, np.ndarray]:
        caps = np.array([_capacity(ti, t.min_microbatches, target) for ti, t in zip(times, usable)])
        ok = caps >= np.array([t.min_microbatches for t in usable])
        return _best_mix(sizes[ok], caps[ok], len(node_ids), min_pipelines)[0], np.nonzero(ok)[0]

    capacity, _ = mix(candidates[-1])
    if capacity < 0:
        n0 = template_set.min_nodes
        raise PlanningError(
            f"{len(node_ids)} node(s) cannot be split into at least {min_pipelines} pipelines "
            f"from templates of {sizes.min()}..{sizes.max()} nodes (n0 = {n0}); "
            f"this needs at least {min_pipelines * n0} nodes")
    if capacity < total:
        raise AssertionError("the largest target must hold every microbatch")
    lo, hi = 0, len(candidates) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if mix(candidates[mid])[0] >= total:
            hi = mid
        else:
            lo = mid + 1
    caps = np.array([_capacity(ti, t.min_microbatches, candidates[lo]) for ti, t in zip(times, usable)])
    ok = np.nonzero(caps >= np.array([t.min_microbatches for t in usable]))[0]
    _, chosen = _best_mix(sizes[ok], caps[ok], len(node_ids), min_pipelines)
    picked = sorted((usable[ok[i]] for i in chosen), key=lambda t: -t.nodes)
    stages = sum(t.min_microbatches for t in picked)
    if stages > total:
        raise _nearest_batch_error(stages, microbatch_size, global_batch,
                                   f"{len(picked)} pipelines with {stages} stages")
    assignment, start = [], 0
    for t in picked:
        assignment.append(node_ids[start:start + t.nodes])
        start += t.nodes
    return build_instantiation(picked, assignment, global_batch, microbatch_size)


def fresh_layout(template_set: TemplateSet, nodes: Sequence[int], global_batch: int,
                 microbatch_size: int) -> Instantiation:
    """The fastest instantiation on as many of `nodes` as the templates cover, with f + 1
    pipelines where they fit, else one; the nodes left over wait as spares (a restore, or a
    first generation started again, on whatever nodes are left)."""
    node_ids = sorted(nodes)
    error = None
    for count in range(len(node_ids), 0, -1):
        for pipelines in dict.fromkeys((template_set.fault_tolerance + 1, 1)):
            try:
                inst = instantiate(template_set, node_ids[:count], global_batch, microbatch_size,
                                   min_pipelines=pipelines)
            except PlanningError as exc:
                error = error or exc
                continue
            return dataclasses.replace(inst, spares=tuple(node_ids[count:]))
    raise error or PlanningError("no live node to lay a generation on")
