"""Gray failures (Note: [gray failures] in elastic/reachability.py): who is left out when every
node answers the store but some cannot reach each other, and the probe that finds out, on real
loopback sockets (runtime/reach.py)."""

from __future__ import annotations

import itertools
import random
import socket
import time

from oobleck_elastic.elastic.reachability import left_out
from oobleck_elastic.runtime.reach import Responder, unreachable


def test_one_isolated_node_is_left_out_never_the_many_that_could_not_reach_it():
    # node 2 lost its data link: it reaches nobody and nobody reaches it
    reports = {0: {2}, 1: {2}, 2: {0, 1, 3}, 3: {2}}
    assert left_out([0, 1, 2, 3], reports) == (2,)
    # only the others' reports (its own never arrived): the same
    assert left_out([0, 1, 2, 3], {0: {2}, 1: {2}, 3: {2}}) == (2,)
    # only its own report: the one node whose edges all end in it
    assert left_out([0, 1, 2, 3], {2: {0, 1, 3}}) == (2,)


def test_a_network_split_in_two_leaves_the_larger_side_and_a_tie_keeps_the_lower_ids():
    big, small = [0, 1, 4], [2, 3]
    reports = {a: set(small) for a in big} | {b: set(big) for b in small}
    assert left_out(big + small, reports) == (2, 3)
    halves = {0: {2, 3}, 1: {2, 3}, 2: {0, 1}, 3: {0, 1}}
    assert left_out([0, 1, 2, 3], halves) == (2, 3)
    assert left_out([0, 1], {0: {1}, 1: {0}}) == (1,), "two nodes that cannot reach each other: keep node 0"


def test_nobody_is_left_out_when_every_probe_succeeded_and_reports_about_outsiders_are_ignored():
    assert left_out([0, 1, 2], {0: set(), 1: set(), 2: set()}) == ()
    assert left_out([0, 1, 2], {}) == ()
    assert left_out([0, 1], {0: {7}, 1: {1}}) == (), "a node outside the members, or itself, is no evidence"


def test_the_cover_is_minimal_on_random_graphs_and_every_member_decides_the_same():
    rng = random.Random(5)
    for _ in range(300):
        nodes = list(range(rng.randint(2, 7)))
        reports = {a: {b for b in nodes if b != a and rng.random() < 0.25} for a in nodes}
        out = left_out(nodes, reports)
        kept = set(nodes) - set(out)
        assert not any(b in reports[a] for a in kept for b in kept), "no failed edge is left among the kept"
        edges = {frozenset((a, b)) for a in nodes for b in reports[a]}
        brute = min(k for k in range(len(nodes) + 1)
                    if any(all(e & set(c) for e in edges) for c in itertools.combinations(nodes, k)))
        assert len(out) == brute
        shuffled = dict(rng.sample(sorted(reports.items()), len(reports)))
        assert left_out(list(reversed(nodes)), shuffled) == out, "the order reports are read in does not matter"


def test_the_probe_finds_a_live_responder_and_not_a_closed_or_silent_one():
    live = Responder("127.0.0.1")
    gone = Responder("127.0.0.1")
    gone.close()
    # a listener that never completes a handshake: its backlog is full, so SYNs go unanswered
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(0)
    fillers = []
    for _ in range(4):
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(silent.getsockname())
        fillers.append(s)
    try:
        start = time.monotonic()
        found = unreachable({"live": [live.endpoint], "gone": [gone.endpoint], "none": [],
                             "one of two": [gone.endpoint, live.endpoint],
                             "silent": [silent.getsockname()]}, timeout=0.5)
        assert found == {"gone", "none", "silent"}
        assert 0.5 <= time.monotonic() - start < 5.0, "the silent one waited out the timeout, once for all"
    finally:
        live.close()
        silent.close()
        for s in fillers:
            s.close()
