"""The cost model against a discrete-event simulation of torch's Schedule1F1B (rendezvous messages)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oobleck_elastic.planning import Cluster, iteration_ms, plan_template, simulate_1f1b, synthetic_gpt
from oobleck_elastic.planning.cost import interleaved_iteration_ms, ring_factor
from oobleck_elastic.planning.simulate import one_f_one_b_order


def test_order_matches_torch_schedule_1f1b():
    # Stage 0 of 3 warms up with 3 forwards; the last stage alternates from the start.
    assert one_f_one_b_order(0, 3, 4) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3),
                                          ("B", 1), ("B", 2), ("B", 3)]
    assert one_f_one_b_order(2, 3, 3) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]


def test_simulation_of_a_hand_checked_schedule():
    # Two stages, M = 4: the slow second stage is busy from t=1 to the end: 1 + 4 * 20 + 1.
    assert simulate_1f1b([1, 10], [1, 10], [0.0], 4) == 82
    # Slow first stage: never idle, so exactly M * w_0.
    assert simulate_1f1b([10, 1], [10, 1], [0.0], 4) == 80


@pytest.mark.parametrize("send", [0.5, 1.0, 3.0])
def test_every_microbatch_waits_for_an_exchange_with_each_neighbour(send):
    # torch waits for each send with the next receive, and a send completes only once its
    # receiver has posted (gloo): two balanced stages pay one exchange per microbatch, plus the
    # first activation's way down: (M + 1) * (w + c), which the model gives exactly
    f, b, m = 5.0, 10.0, 16
    assert simulate_1f1b([f, f], [b, b], [send], m) == pytest.approx((m + 1) * (f + b + send), rel=1e-12)
    assert iteration_ms([f + b] * 2, [f] * 2, [send], m) == pytest.approx((m + 1) * (f + b + send), rel=1e-12)
    # a middle stage exchanges with both neighbours: two per microbatch
    three = simulate_1f1b([f] * 3, [b] * 3, [send] * 2, m)
    assert three - simulate_1f1b([f] * 3, [b] * 3, [0.0] * 2, m) >= 2 * (m - 1) * send
    assert iteration_ms([f + b] * 3, [f] * 3, [send] * 2, m) <= three


@settings(max_examples=300, deadline=None)
@given(stages=st.integers(1, 7), extra=st.integers(0, 12), seed=st.integers(0, 10**6),
       transfers=st.booleans())
def test_model_never_exceeds_simulation(stages, extra, seed, transfers):
    rng = random.Random(seed)
    fwd = [rng.uniform(0.2, 5) for _ in range(stages)]
    bwd = [rng.uniform(0.2, 10) for _ in range(stages)]
    send = [rng.uniform(0, 2) if transfers else 0.0 for _ in range(stages - 1)]
    m = stages + extra
    model = iteration_ms([f + b for f, b in zip(fwd, bwd)], fwd, send, m)
    assert model <= simulate_1f1b(fwd, bwd, send, m) * (1 + 1e-12)


@settings(max_examples=200, deadline=None)
@given(stages=st.integers(1, 8), extra=st.integers(0, 24), f=st.floats(0.1, 10), ratio=st.floats(0.3, 4))
def test_model_is_exact_for_balanced_stages(stages, extra, f, ratio):
    m = stages + extra
    b = f * ratio
    sim = simulate_1f1b([f] * stages, [b] * stages, [0.0] * (stages - 1), m)
    assert iteration_ms([f + b] * stages, [f] * stages, [0.0] * (stages - 1), m) == pytest.approx(sim, rel=1e-12)


def test_planned_splits_are_close_to_simulation():
    """On transformer-shaped profiles the planner's optimum is within 10% of the simulated
    schedule (the measured worst case is about 8%)."""
    worst = 0.0
    for layers in (12, 24, 48):
        profile = synthetic_gpt(layers, hidden=1024, seq_len=512)
        for g in (1, 2, 4):
            cluster = Cluster(workers_per_node=g, memory_per_worker=80 * 2**30)
            for nodes in (1, 2, 3):
                if nodes * g > layers:
                    continue
                for m in (nodes * g, 4 * nodes * g):
                    t = plan_template(profile, cluster, nodes, m)
                    fwd = [s.forward_ms for s in t.stages]
                    bwd = [s.compute_ms - s.forward_ms for s in t.stages]
                    sim = simulate_1f1b(fwd, bwd, [s.send_ms for s in t.stages[:-1]], m)
                    assert t.iteration_ms <= sim * (1 + 1e-12)
                    worst = max(worst, (sim - t.iteration_ms) / sim)
    assert worst < 0.10, worst


def test_gradient_allreduce_is_a_ring_over_the_pipelines():
    cluster = Cluster(workers_per_node=1, memory_per_worker=1, inter_node_bandwidth=10.0)  # 10 GB/s
    assert cluster.allreduce_ms(10**9, 1) == 0.0  # one pipeline: nothing to sum
    assert cluster.allreduce_ms(10**9, 2) == pytest.approx(100.0)  # 2 (p-1)/p = 1: 1 GB at 10 GB/s
    assert cluster.allreduce_ms(10**9, 4) == pytest.approx(150.0)  # 2 * 3/4
    assert [ring_factor(p) for p in (1, 2, 4, 8)] == [0.0, 1.0, 1.5, 1.75]


def test_each_stage_finishes_with_its_allreduce_and_optimizer_step():
    # Two equal stages, M = 4, no transfers: stage 0 ends its backwards at 2 + 4 * 3 (its first
    # backward waits 3 - 1 for stage 1's), stage 1 at 3 + 4 * 3; then each sums and steps.
    stage, forward = [3.0, 3.0], [1.0, 1.0]
    assert iteration_ms(stage, forward, [0.0], 4) == 15.0
    assert iteration_ms(stage, forward, [0.0], 4, [2.0, 10.0]) == 25.0  # 15 + 10
    assert iteration_ms(stage, forward, [0.0], 4, [10.0, 2.0]) == 24.0  # 14 + 10
    assert iteration_ms(stage, forward, [0.0], 4, [0.0, 0.0]) == iteration_ms(stage, forward, [0.0], 4)
    # interleaved: a worker's tail is the sum over its stages; the slowest worker's counts
    assert interleaved_iteration_ms([1.0] * 4, [0.0] * 4, 2, 4, [1.0, 2.0, 3.0, 0.5]) == \
        interleaved_iteration_ms([1.0] * 4, [0.0] * 4, 2, 4) + 4.0
