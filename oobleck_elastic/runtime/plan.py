"""What one generation runs, derived from its instantiation: ranks, stages, replica sets.

Note: [ranks]
    The members of a generation are every worker (node, local_rank) of every member node,
    spares included, sorted; a worker's global rank is its position in that list. Every worker
    derives the same ranks, stages and gradient groups from the same GenerationPlan.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from oobleck_elastic.planning import Instantiation, TemplateSet, WorkerRef

__all__ = ["GenerationPlan", "StageRole"]


@dataclass(frozen=True, kw_only=True)
class StageRole:
    """A worker's part in its pipeline: one stage, or several (stage k on position k mod
    positions) under the interleaved schedule."""

    pipeline: int
    stages: tuple[int, ...]
    """The stage indices this worker runs, ascending."""
    stage_layers: tuple[tuple[int, int], ...]
    """[start, end) layers of each of `stages`."""
    num_stages: int
    microbatches: int
    stage_ranks: tuple[int, ...]
    """Global rank of each stage of the pipeline, in stage order."""
    samples: tuple[int, int]
    """[start, end) of the pipeline's slice of the global batch."""

    @property
    def is_first(self) -> bool:
        return self.stages[0] == 0

    @property
    def is_last(self) -> bool:
        return self.stages[-1] == self.num_stages - 1

    @property
    def position(self) -> int:
        """This worker's place among the pipeline's workers (its first stage's index)."""
        return self.stages[0]

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return tuple(i for start, end in self.stage_layers for i in range(start, end))


@dataclass(frozen=True, kw_only=True)
class GenerationPlan:
    generation: int
    start_step: int
    """The first optimizer step this generation runs (steps before it are done everywhere)."""
    workers_per_node: int
    instantiation: Instantiation
    templates: TemplateSet

    @cached_property
    def members(self) -> tuple[WorkerRef, ...]:
        return tuple(WorkerRef(n, w) for n in self.instantiation.nodes for w in range(self.workers_per_node))

    @cached_property
    def _ranks(self) -> dict[WorkerRef, int]:
        return {w: i for i, w in enumerate(self.members)}

    def rank_of(self, worker: WorkerRef) -> int:
        return self._ranks[worker]

    @cached_property
    def roles(self) -> dict[int, StageRole]:
        """Global rank -> role, for every rank that runs a stage."""
        by_nodes = self.templates.by_nodes()
        slices = self.instantiation.sample_slices()
        roles = {}
        for p, (pipe, samples) in enumerate(zip(self.instantiation.pipelines, slices)):
            template = by_nodes[pipe.template]
            if template.width != 1:
                raise ValueError("wide templates (stages spanning workers) are for dry runs only")
            ranks = tuple(self.rank_of(WorkerRef(pipe.nodes[s.node], s.workers[0])) for s in template.stages)
            for rank in set(ranks):
                mine = tuple(k for k, r in enumerate(ranks) if r == rank)
                roles[rank] = StageRole(pipeline=p, stages=mine,
                                        stage_layers=tuple(template.stages[k].layers for k in mine),
                                        num_stages=len(ranks), microbatches=pipe.microbatches,
                                        stage_ranks=ranks, samples=samples)
        return roles

    @cached_property
    def replica_sets(self) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """(ranks holding these layers, layers) for layers held by more than one pipeline,
        layers with the same holders together, ordered by first layer (a global order every
        rank follows, so overlapping collectives cannot deadlock)."""
        holders: dict[int, list[int]] = {}
        for rank in sorted(self.roles):
            for layer in self.roles[rank].layer_ids:
                holders.setdefault(layer, []).append(rank)
        groups: dict[tuple[int, ...], list[int]] = {}
        for layer in sorted(holders):
            groups.setdefault(tuple(holders[layer]), []).append(layer)
        return sorted(((ranks, tuple(ls)) for ranks, ls in groups.items() if len(ranks) > 1),
                      key=lambda item: item[1][0])

    @cached_property
    def layer_owner(self) -> dict[int, int]:
        """One rank per layer (its replica in the first pipeline): counts it in the grad norm."""
        owner: dict[int, int] = {}
        for rank, role in sorted(self.roles.items(), key=lambda kv: (kv[1].pipeline, kv[0])):
            for layer in role.layer_ids:
                owner.setdefault(layer, rank)
        return owner
