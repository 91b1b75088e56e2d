"""A generation creates its communicators in one global order (runtime/communicators.py, Note:
[communicator order]): for every layout the planner produces (heterogeneous pipelines,
several workers a node, interleaved stages, tied layers) every rank's creations complete, and
one rank going its own way deadlocks, so the check is not vacuous."""

from __future__ import annotations

import itertools
import random

import pytest
from random_profiles import random_profile, small_cluster

from oobleck_elastic.planning import build_instantiation, instantiate, plan_templates
from oobleck_elastic.runtime.communicators import Communicator, communicators, creation_order, first_deadlock
from oobleck_elastic.runtime.plan import GenerationPlan


def plans(seed: int, layers: int, workers: int, virtual: int, nodes: int, f: int):
    """The planner's generation plan on `nodes` nodes, and every mix of its templates that
    covers them with at least f + 1 pipelines (heterogeneous ones among them)."""
    profile = random_profile(random.Random(seed), layers)
    ts = plan_templates(profile, small_cluster(workers, 10**9), max_nodes=nodes, fault_tolerance=f,
                        total_microbatches=64, virtual_stages=virtual)
    yield GenerationPlan(generation=1, start_step=0, workers_per_node=workers,
                         instantiation=instantiate(ts, list(range(nodes)), 64, 1), templates=ts)
    sizes = sorted(t.nodes for t in ts.templates)
    for counts in itertools.combinations_with_replacement(sizes, f + 1):
        if sum(counts) != nodes:
            continue
        start = itertools.accumulate(counts, initial=0)
        pipelines = [tuple(range(a, a + n)) for a, n in zip(start, counts)]
        inst = build_instantiation([ts.get(n) for n in counts], pipelines, 64, 1)
        yield GenerationPlan(generation=1, start_step=0, workers_per_node=workers, instantiation=inst, templates=ts)


LAYOUTS = [  # seed, layers, workers a node, virtual stages, nodes, f
    (1, 8, 1, 1, 3, 1), (2, 12, 1, 1, 5, 1), (3, 12, 2, 1, 4, 1), (4, 16, 1, 2, 4, 1),
    (5, 24, 1, 1, 7, 2), (6, 16, 2, 2, 5, 1), (7, 10, 3, 1, 3, 2)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_rank_completes_its_creations_in_every_layout(layout):
    seen = 0
    for plan in plans(*layout):
        for tied in ((), ((0, plan.templates.templates[0].stages[-1].layers[1] - 1),)):
            comms = communicators(plan, tied)
            assert len(set(comms)) == len(comms)
            ranks = range(len(plan.members))
            orders = {r: creation_order(comms, r) for r in ranks}
            assert first_deadlock(orders) is None, plan.instantiation
            # and they are what the generation needs: its pipelines' neighbours, its replica sets
            for role in plan.roles.values():
                for a, b in zip(role.stage_ranks, role.stage_ranks[1:]):
                    assert a == b or Communicator("p2p", (min(a, b), max(a, b))) in comms
            assert [c.ranks for c in comms if c.kind == "replica"] == [r for r, _ in plan.replica_sets]
            seen += 1
    assert seen >= 2


def test_a_heterogeneous_layout_has_its_one_and_two_node_pipelines():
    plan = next(p for p in plans(1, 8, 1, 1, 3, 1) if len({len(x.nodes) for x in p.instantiation.pipelines}) > 1)
    comms = communicators(plan)
    assert {c.kind for c in comms} == {"pipeline", "replica", "p2p"}
    alone = next(r for r, role in plan.roles.items() if role.num_stages == 1)
    assert all(len(c.ranks) == 2 and alone in c.ranks for c in comms if c.kind == "replica")


@pytest.mark.parametrize("layout", LAYOUTS[:4])
def test_one_rank_creating_in_its_own_order_deadlocks(layout):
    """The same creations, one rank taking its own in reverse: some layout then waits in a
    circle (two ranks that share two communicators reach them in opposite orders)."""
    broken = 0
    for plan in plans(*layout):
        comms = communicators(plan)
        orders = {r: creation_order(comms, r) for r in range(len(plan.members))}
        for rank, mine in orders.items():
            if len(mine) > 1 and first_deadlock({**orders, rank: mine[::-1]}) is not None:
                broken += 1
                break
    assert broken > 0


def test_the_checker_reports_where_each_rank_waits():
    a, b = Communicator("pipeline", (0, 1)), Communicator("p2p", (0, 1))
    assert first_deadlock({0: [a, b], 1: [a, b]}) is None
    assert first_deadlock({0: [a, b], 1: [b, a]}) == {0: a, 1: b}
    assert first_deadlock({0: [Communicator("replica", (0, 2))], 1: [], 2: []}) is not None  # 2 never comes
