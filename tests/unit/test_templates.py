"""Templates are the exact optimum of the cost model under the memory limit."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from random_profiles import random_profile, small_cluster

from oobleck_elastic.errors import PlanningError
from oobleck_elastic.planning import (
    LayerProfile,
    ModelProfile,
    TemplateSet,
    dumps,
    loads,
    plan_template,
    plan_templates,
    synthetic_gpt,
    template_from_bounds,
)


def brute_force(profile, cluster, nodes, microbatches, wide=False, pipelines=1):
    """min over every split (and width) of the cost model, or None if nothing fits memory."""
    g = cluster.workers_per_node
    widths = [w for w in range(1, g + 1) if g % w == 0] if wide else [1]
    best = None
    for width in widths:
        stages = nodes * g // width
        for cuts in itertools.combinations(range(1, profile.num_layers), stages - 1):
            t = template_from_bounds(profile, cluster, nodes, (0, *cuts, profile.num_layers), microbatches,
                                     pipelines=pipelines)
            if any(s.memory_bytes > cluster.memory_per_worker for s in t.stages):
                continue
            if best is None or t.iteration_ms < best:
                best = t.iteration_ms
    return best


@settings(max_examples=120, deadline=None)
@given(seed=st.integers(0, 10**6), layers=st.integers(2, 9), g=st.sampled_from([1, 2]),
       nodes=st.integers(1, 3), extra=st.integers(0, 8), tight=st.booleans(), fast_links=st.booleans())
def test_template_matches_brute_force(seed, layers, g, nodes, extra, tight, fast_links):
    rng = random.Random(seed)
    profile = random_profile(rng, layers)
    if nodes * g > layers:
        return
    total = sum(x.static_bytes + 3 * x.activation_bytes for x in profile.layers)
    memory = total // (nodes * g) + rng.randint(0, total // 4) if tight else 10**12
    cluster = small_cluster(g, memory, intra_node_bandwidth=50.0 if fast_links else 0.5,
                            inter_node_bandwidth=12.5 if fast_links else 0.1)
    m = nodes * g + extra
    expected = brute_force(profile, cluster, nodes, m)
    got = plan_template(profile, cluster, nodes, m)
    if expected is None:
        assert got is None
        return
    assert got is not None
    assert got.iteration_ms == pytest.approx(expected, rel=1e-9)
    assert all(s.memory_bytes <= cluster.memory_per_worker for s in got.stages)
    assert got.bounds()[0] == 0 and got.bounds()[-1] == layers


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 10**6), layers=st.integers(2, 8), nodes=st.integers(1, 3),
       pipelines=st.integers(1, 4), slow_links=st.booleans())
def test_template_with_gradient_sync_and_optimizer_matches_brute_force(seed, layers, nodes, pipelines, slow_links):
    """Each stage's all-reduce across the pipelines and its optimizer step (Note: [cost model])
    keep the split search exact."""
    rng = random.Random(seed)
    base = random_profile(rng, layers)
    profile = dataclasses.replace(base, layers=tuple(
        dataclasses.replace(x, optimizer_ms=rng.uniform(0, 4)) for x in base.layers))
    if nodes > layers:
        return
    cluster = small_cluster(1, 10**12, inter_node_bandwidth=0.01 if slow_links else 12.5)
    m = nodes + rng.randint(0, 6)
    expected = brute_force(profile, cluster, nodes, m, pipelines=pipelines)
    got = plan_template(profile, cluster, nodes, m, pipelines=pipelines)
    assert got.pipelines == pipelines
    assert got.iteration_ms == pytest.approx(expected, rel=1e-9)
    assert got.iteration_ms_at(m) == got.iteration_ms  # timed at its own pipeline count
    for s in got.stages:  # no stage ends before its own microbatches, all-reduce and optimizer step
        assert got.iteration_ms >= m * s.compute_ms + s.tail_ms(pipelines) - 1e-9


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), layers=st.integers(2, 8), nodes=st.integers(1, 2))
def test_wide_template_matches_brute_force(seed, layers, nodes):
    profile = random_profile(random.Random(seed), layers)
    cluster = small_cluster(4, 10**12)
    expected = brute_force(profile, cluster, nodes, 8, wide=True)
    got = plan_template(profile, cluster, nodes, 8, wide=True)
    assert got is not None and got.iteration_ms == pytest.approx(expected, rel=1e-9)
    # stages never span a node, and the widths tile every node's workers
    for node in range(nodes):
        workers = sorted(w for s in got.stages if s.node == node for w in s.workers)
        assert workers == list(range(4))


def test_executable_template_runs_one_stage_per_worker():
    t = plan_template(synthetic_gpt(24), small_cluster(4, 80 * 2**30), 3, 24)
    assert t.num_stages == 12
    assert [(s.node, s.workers) for s in t.stages] == [(k // 4, (k % 4,)) for k in range(12)]


def test_template_set_range_caps_and_coverage():
    profile = synthetic_gpt(24)
    cluster = small_cluster(1, 36 * 2**30)
    ts = plan_templates(profile, cluster, max_nodes=12, fault_tolerance=1, total_microbatches=64)
    assert ts.min_nodes == 3
    assert [t.nodes for t in ts.templates] == list(range(3, 10))  # [n0, N - f*n0]
    assert ts.uncovered == ()
    # Every template fits memory and is strictly the optimum for its own microbatch count.
    for t in ts.templates:
        assert max(s.memory_bytes for s in t.stages) <= cluster.memory_per_worker
        assert t.num_stages == t.nodes


def test_template_cap_when_workers_exceed_layers():
    ts = plan_templates(synthetic_gpt(12), small_cluster(4, 80 * 2**30), max_nodes=8,
                        fault_tolerance=1, total_microbatches=64)
    assert [t.nodes for t in ts.templates] == [1, 2, 3]
    assert "16 stages needed but the model has only 12 layers" in ts.infeasible[4]
    wide = plan_templates(synthetic_gpt(12), small_cluster(4, 80 * 2**30), max_nodes=8,
                          fault_tolerance=1, total_microbatches=64, wide=True)
    assert [t.nodes for t in wide.templates] == list(range(1, 8))


def test_uncovered_live_counts_are_reported():
    # 10 equal layers (static 10, activation 1) on 4 workers a node with a budget of 25: one
    # node (4 stages) needs a 3-layer stage (30 > 25), two nodes (8 stages) fit, three nodes
    # need 12 stages > 10 layers. So n0 = 2, the only template is 2 nodes, and 5 live nodes
    # cannot be covered by >= 2 pipelines.
    layer = LayerProfile(name="x", forward_ms=1.0, backward_ms=2.0, param_bytes=5, grad_bytes=5,
                         optimizer_bytes=0, activation_bytes=1, output_bytes=100)
    profile = ModelProfile(signature="flat", microbatch_size=1, dtype="float32", device="test",
                           torch_version="n/a", device_memory_bytes=None, layers=(layer,) * 10)
    ts = plan_templates(profile, small_cluster(4, 25), max_nodes=6, fault_tolerance=1,
                        total_microbatches=64)
    assert ts.min_nodes == 2
    assert [t.nodes for t in ts.templates] == [2]
    assert ts.uncovered == (5,)
    assert "12 stages needed but the model has only 10 layers" in ts.infeasible[3]


def test_no_feasible_template_is_a_clear_error():
    with pytest.raises(PlanningError, match="memory_per_worker"):
        plan_templates(synthetic_gpt(12), small_cluster(1, 2**20), max_nodes=4, fault_tolerance=1,
                       total_microbatches=16)
    with pytest.raises(PlanningError, match="fault_tolerance=2 needs 3 replicas"):
        plan_templates(synthetic_gpt(24), small_cluster(1, 36 * 2**30), max_nodes=8, fault_tolerance=2,
                       total_microbatches=16)


def test_templates_deterministic_and_round_trip_json():
    args = dict(max_nodes=10, fault_tolerance=1, total_microbatches=64)
    a = plan_templates(synthetic_gpt(24), small_cluster(2, 36 * 2**30), **args)
    b = plan_templates(synthetic_gpt(24), small_cluster(2, 36 * 2**30), **args)
    assert a == b
    assert loads(TemplateSet, dumps(a)) == a


def test_the_default_memory_budget_keeps_headroom_on_a_gpu_and_shares_the_host_on_the_cpu():
    from oobleck_elastic.config import PlannerConfig
    from oobleck_elastic.planning.job import make_cluster

    gib = 2**30
    profile = dataclasses.replace(synthetic_gpt(4), device="cuda:NVIDIA H100", device_memory_bytes=80 * gib)
    assert make_cluster(PlannerConfig(), profile, 8).memory_per_worker == 72 * gib  # a tenth kept back
    small = dataclasses.replace(profile, device_memory_bytes=16 * gib)
    assert make_cluster(PlannerConfig(), small, 8).memory_per_worker == 14 * gib  # at least 2 GiB
    host = dataclasses.replace(profile, device="cpu", device_memory_bytes=24 * gib)
    assert make_cluster(PlannerConfig(), host, 4).memory_per_worker == 6 * gib  # the RAM, shared
    given_budget = PlannerConfig(memory_per_worker="40GiB")
    assert make_cluster(given_budget, profile, 8).memory_per_worker == 40 * gib  # the user's word wins
