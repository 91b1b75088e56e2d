"""The communicators a generation uses, in the one global order every rank creates them in.

Note: [communicator order]
    Creating a communicator blocks until every member arrives (gloo connects in new_group;
    NCCL in ncclCommInitRank, at the group's first use unless it is created eagerly, and a
    pair of ranks that exchange point to point outside a batch get a two-rank communicator
    of their own, at their first exchange). If the creations of a step happened at first use,
    one rank could block creating a replica set's communicator while a member of it waits for
    a pipeline gradient that its sender sends only after it has created another one: a
    heterogeneous layout can close that circle at step 0 of its first generation (pipeline A
    alone, pipeline B0 -> B1: A creates (A, B0), B0 waits for B1's last gradient, B1 creates
    (A, B1), which waits for A). So a generation creates, and then uses once (a warm-up), every
    communicator it will need while it is built, before any step: pipeline groups, replica
    sets, tied-parameter groups, then the point-to-point pair of every two neighbouring stages
    on different ranks, each list in a fixed order, and every rank goes down the one list,
    skipping what it is not a member of. A wait can then only be for a member that has not
    reached the same entry yet, and the earliest entry anyone waits at always completes: no
    circle, for any layout and any schedule (tests/unit/test_communicator_order.py checks it
    for the planner's layouts, and that one rank going its own way deadlocks).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from oobleck_elastic.runtime.plan import GenerationPlan

__all__ = ["Communicator", "communicators", "creation_order", "first_deadlock", "tie_communicator"]


@dataclass(frozen=True)
class Communicator:
    kind: str
    """"pipeline" | "replica" | "tie" | "p2p"."""
    ranks: tuple[int, ...]
    """Its members, ascending."""
    layers: tuple[int, ...] = ()
    """replica: the layers whose gradients it sums; tie: the layers sharing the parameter."""


def communicators(plan: GenerationPlan, tied: Sequence[Iterable[int]] = ()) -> list[Communicator]:
    """Every communicator of `plan`'s generation, in creation order (Note: [communicator order]).
    `tied`: for each tied parameter of the model, the layers that hold a copy of it."""
    out: list[Communicator] = []
    pipelines: dict[int, set[int]] = {}
    for rank, role in plan.roles.items():
        pipelines.setdefault(role.pipeline, set()).add(rank)
    out += [Communicator("pipeline", tuple(sorted(pipelines[p]))) for p in sorted(pipelines)]
    out += [Communicator("replica", tuple(ranks), tuple(layers)) for ranks, layers in plan.replica_sets]
    for layers in tied:
        tie = tie_communicator(plan, layers)
        if len(tie.ranks) > 1:
            out.append(tie)
    pairs: set[tuple[int, int]] = set()
    for role in plan.roles.values():
        ranks = role.stage_ranks
        pairs.update((min(a, b), max(a, b)) for a, b in zip(ranks, ranks[1:]) if a != b)
    out += [Communicator("p2p", pair) for pair in sorted(pairs)]
    return out


def tie_communicator(plan: GenerationPlan, layers: Iterable[int]) -> Communicator:
    """The group of a tied parameter held by `layers`: every rank that runs one of them (one
    rank alone needs no group)."""
    members = set(layers)
    ranks = tuple(sorted(r for r, role in plan.roles.items() if members & set(role.layer_ids)))
    return Communicator("tie", ranks, tuple(sorted(members)))


def creation_order(comms: Sequence[Communicator], rank: int) -> list[Communicator]:
    """What `rank` creates, in the order it does: the global list, restricted to its own."""
    return [c for c in comms if rank in c.ranks]


def first_deadlock(orders: Mapping[int, Sequence[Communicator]]) -> dict[int, Communicator] | None:
    """Plays the ranks' creation orders against each other, a creation completing once every
    member has reached it; returns None when all complete, else where each stuck rank waits."""
    position = {rank: 0 for rank in orders}
    while True:
        waiting = {rank: orders[rank][i] for rank, i in position.items() if i < len(orders[rank])}
        if not waiting:
            return None
        ready = [c for c in set(waiting.values()) if all(waiting.get(r) == c for r in c.ranks)]
        if not ready:
            return waiting
        for comm in ready:
            for rank in comm.ranks:
                position[rank] += 1
