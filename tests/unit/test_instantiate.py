"""Instantiation: every live count covered, exact batch sums, fastest mix, clear batch errors."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from random_profiles import random_profile, small_cluster

from oobleck_elastic.errors import InfeasibleBatchError, PlanningError
from oobleck_elastic.planning import Instantiation, dumps, instantiate, loads, plan_templates, split_batch


def check_instantiation(inst, ts, nodes, global_batch, microbatch):
    by_nodes = ts.by_nodes()
    used = [n for p in inst.pipelines for n in p.nodes]
    assert sorted(used) == sorted(nodes), "every live node in exactly one pipeline"
    assert len(inst.pipelines) >= ts.fault_tolerance + 1
    assert sum(p.microbatches for p in inst.pipelines) * microbatch == global_batch
    for p in inst.pipelines:
        assert len(p.nodes) == p.template
        assert p.microbatches >= by_nodes[p.template].num_stages
    slices = inst.sample_slices()
    assert slices[0][0] == 0 and slices[-1][1] == global_batch
    assert all(a[1] == b[0] for a, b in zip(slices, slices[1:]))


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), layers=st.integers(4, 12), g=st.sampled_from([1, 2]),
       f=st.integers(0, 2), n_max=st.integers(2, 14), per_worker_mb=st.integers(1, 6))
def test_every_live_count_is_covered(seed, layers, g, f, n_max, per_worker_mb):
    profile = random_profile(random.Random(seed), layers)
    total = sum(x.static_bytes + 2 * x.activation_bytes for x in profile.layers)
    cluster = small_cluster(g, max(total // per_worker_mb, 1))
    try:
        ts = plan_templates(profile, cluster, max_nodes=n_max, fault_tolerance=f, total_microbatches=64)
    except PlanningError:
        return  # too few nodes for f+1 replicas, or nothing fits: covered by other tests
    microbatch = 2
    for live in range((f + 1) * ts.min_nodes, n_max + 1):
        global_batch = microbatch * max(64, live * g)
        if live in ts.uncovered:
            with pytest.raises(PlanningError):
                instantiate(ts, range(live), global_batch, microbatch)
            continue
        nodes = random.Random(live).sample(range(100), live)
        inst = instantiate(ts, nodes, global_batch, microbatch)
        check_instantiation(inst, ts, nodes, global_batch, microbatch)
        assert instantiate(ts, nodes, global_batch, microbatch) == inst  # deterministic
        assert loads(Instantiation, dumps(inst)) == inst


def best_by_brute_force(ts, live, total):
    sizes = [t.nodes for t in ts.templates]
    best = None
    for count in range(ts.fault_tolerance + 1, live // ts.min_nodes + 1):
        for combo in itertools.combinations_with_replacement(sizes, count):
            if sum(combo) != live:
                continue
            templates = [ts.get(n) for n in combo]
            firsts = [t.num_stages for t in templates]
            if sum(firsts) > total:
                continue
            for extra in itertools.product(range(total + 1), repeat=count - 1):
                last = total - sum(firsts) - sum(extra)
                if last < 0:
                    continue
                ms = [f + e for f, e in zip(firsts, (*extra, last))]
                value = max(t.iteration_ms_at(m) for t, m in zip(templates, ms))
                best = value if best is None else min(best, value)
    return best


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), live=st.integers(2, 6), total=st.integers(6, 14))
def test_instantiation_is_fastest_mix_and_split(seed, live, total):
    profile = random_profile(random.Random(seed), 6)
    ts = plan_templates(profile, small_cluster(1, 10**12), max_nodes=6, fault_tolerance=1,
                        total_microbatches=total)
    if live < 2 * ts.min_nodes:
        return
    expected = best_by_brute_force(ts, live, total)
    if expected is None:
        with pytest.raises(InfeasibleBatchError):
            instantiate(ts, range(live), total, 1)
        return
    inst = instantiate(ts, range(live), total, 1)
    by_nodes = ts.by_nodes()
    # the search times templates at the pipeline count they were planned for (f + 1) ...
    nominal = max(by_nodes[p.template].iteration_ms_at(p.microbatches) for p in inst.pipelines)
    assert nominal == pytest.approx(expected, rel=1e-12)
    # ... and the result is timed with its real count (gradient all-reduce across all of them)
    real = len(inst.pipelines)
    assert inst.iteration_ms == pytest.approx(
        max(by_nodes[p.template].iteration_ms_at(p.microbatches, real) for p in inst.pipelines), rel=1e-12)
    assert (inst.iteration_ms > nominal) == (real > ts.fault_tolerance + 1)


def test_batch_too_small_names_nearest_valid_batch():
    profile = random_profile(random.Random(0), 8)
    ts = plan_templates(profile, small_cluster(2, 10**12), max_nodes=4, fault_tolerance=1,
                        total_microbatches=16)
    with pytest.raises(InfeasibleBatchError) as info:
        instantiate(ts, range(4), 12, 4)  # 3 microbatches for 4 nodes x 2 workers = 8 stages
    assert info.value.nearest_valid == 32
    assert "nearest valid global batch is 32" in str(info.value)


def test_split_batch_balances_unequal_pipelines():
    profile = random_profile(random.Random(3), 12)
    ts = plan_templates(profile, small_cluster(1, 10**12), max_nodes=6, fault_tolerance=1,
                        total_microbatches=40)
    small, large = ts.get(1), ts.get(5)
    counts = split_batch([small, large], 40, 1)
    assert sum(counts) == 40
    # moving one microbatch either way cannot lower the slowest pipeline
    here = max(small.iteration_ms_at(counts[0]), large.iteration_ms_at(counts[1]))
    for delta in (-1, 1):
        a, b = counts[0] + delta, counts[1] - delta
        if a >= small.num_stages and b >= large.num_stages:
            assert max(small.iteration_ms_at(a), large.iteration_ms_at(b)) >= here
