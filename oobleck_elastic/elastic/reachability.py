"""Which nodes to leave out when every node answers the store but some cannot reach each other
on the data network: the decision of a roll call that found nobody dead.

Note: [gray failures]
    A node that loses its data link but keeps the store (a NIC or a switch port gone, the
    management network up) keeps its lease beating and answers every roll call, so nothing
    that reads leases or roll calls can tell it from a healthy node: the same nodes would be
    chosen again, and every build of the next generation would fail in gloo's connect. So
    when a roll call finds every member present and none dead, a failure is there that
    membership does not explain, and the members gather evidence: each worker tries a TCP
    handshake with every other member's responder on the data network (runtime/reach.py) and
    writes down whom it could not reach. Each "A could not reach B" is an edge between A and
    B; the nodes left out are the fewest whose removal leaves no edge (a minimum vertex cover),
    so one isolated node is the one left out, never the many that could not reach it, and a
    network split in two leaves the larger side. Among covers of that size, the one whose
    nodes have the most failed edges, then the one that keeps the lower node ids, so every
    member decides the same from the same reports. The evidence is gathered only then, so a
    failure that membership explains (a dead node) costs no probe. A transient failure whose
    network is fine again by the roll call finds every peer reachable, and the same nodes
    replay the step.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping

__all__ = ["EXACT_LIMIT", "left_out"]

EXACT_LIMIT = 200_000
"""Covers tried before the search settles for the greedy one (most failed edges first)."""


def left_out(nodes: Iterable[int], unreachable: Mapping[int, Iterable[int]]) -> tuple[int, ...]:
    """The nodes to leave out (Note: [gray failures]), sorted: the fewest among `nodes` whose
    removal leaves no two remaining nodes of which one reported the other unreachable;
    `unreachable[a]`: the nodes `a` could not reach. Reports about nodes outside `nodes` are
    ignored."""
    members = set(nodes)
    edges = {frozenset((a, b)) for a, bs in unreachable.items() if a in members
             for b in bs if b in members and b != a}
    degree: dict[int, int] = {}
    for edge in edges:
        for n in edge:
            degree[n] = degree.get(n, 0) + 1
    involved = sorted(degree, key=lambda n: (-degree[n], -n))  # likeliest culprits first
    tried = 0
    for size in range(len(involved) + 1):
        best: tuple[int, ...] | None = None
        for cover in itertools.combinations(involved, size):
            tried += 1
            if tried > EXACT_LIMIT:
                return _greedy(edges, degree)
            covers = all(edge & set(cover) for edge in edges)
            if covers and (best is None or _rank(cover, degree) < _rank(best, degree)):
                best = cover
        if best is not None:
            return tuple(sorted(best))
    raise AssertionError("leaving out every involved node leaves no edge")


def _rank(cover: tuple[int, ...], degree: Mapping[int, int]) -> tuple:
    """Smaller is preferred: more failed edges, then the lower ids kept."""
    return (-sum(degree[n] for n in cover), sorted(-n for n in cover))


def _greedy(edges: set[frozenset[int]], degree: Mapping[int, int]) -> tuple[int, ...]:
    left, out = set(edges), set()
    while left:
        counts: dict[int, int] = {}
        for edge in left:
            for n in edge:
                counts[n] = counts.get(n, 0) + 1
        pick = max(counts, key=lambda n: (counts[n], degree[n], n))
        out.add(pick)
        left = {e for e in left if pick not in e}
    return tuple(sorted(out))
