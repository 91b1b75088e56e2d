"""Interleaved templates: stage k on worker k mod P, worker memory, runnable microbatch counts."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from random_profiles import random_profile, small_cluster

from oobleck_elastic.config import load_config
from oobleck_elastic.errors import ConfigError, InfeasibleBatchError
from oobleck_elastic.planning import instantiate, plan_template, plan_templates, split_batch
from oobleck_elastic.planning.cost import CostTables, interleaved_in_flight


def test_stages_cycle_over_the_workers_and_memory_is_per_worker():
    profile = random_profile(random.Random(7), 16)
    cluster = small_cluster(2, 10**9)
    t = plan_template(profile, cluster, 2, 8, virtual_stages=2)
    assert t.num_stages == 8 and t.positions == 4 and t.virtual_stages == 2
    assert t.bounds()[0] == 0 and t.bounds()[-1] == 16
    assert all(a < b for a, b in itertools.pairwise(t.bounds()))
    tables = CostTables(profile, cluster)
    for k, stage in enumerate(t.stages):
        position = k % 4
        assert (stage.node, stage.workers) == (position // 2, (position % 2,))
        mine = [s.layers for s in t.stages[position::4]]
        static = sum(tables.static[a, b] for a, b in mine)
        act = max(tables.activation[a, b] for a, b in mine)
        assert stage.memory_bytes == int(static + interleaved_in_flight(position, 4, 2) * act)
    assert t.iteration_ms == t.iteration_ms_at(8)


def test_memory_budget_counts_all_stages_of_a_worker():
    profile = random_profile(random.Random(7), 16)
    roomy = plan_template(profile, small_cluster(1, 10**9), 2, 8, virtual_stages=2)
    tight = max(s.memory_bytes for s in roomy.stages)
    assert plan_template(profile, small_cluster(1, tight), 2, 8, virtual_stages=2) is not None
    assert plan_template(profile, small_cluster(1, tight // 3), 2, 8, virtual_stages=2) is None


@pytest.mark.parametrize("positions, runnable, not_runnable", [
    (4, [4, 5, 6, 7, 8, 10, 12, 15, 16], [9, 11, 13, 14]),  # torch's own examples: 4 ranks, 10 ok
    (2, [2, 3, 4, 6, 8], [5, 7, 9]),
    (1, [1, 2, 3, 7], []),
])
def test_runnable_counts_follow_torch_interleaved_rounds(positions, runnable, not_runnable):
    profile = random_profile(random.Random(1), 2 * positions)
    t = plan_template(profile, small_cluster(1, 10**9), positions, 8, virtual_stages=2)
    assert [m for m in runnable if not t.runs_microbatches(m)] == []
    assert [m for m in not_runnable if t.runs_microbatches(m)] == []
    assert not t.runs_microbatches(positions - 1)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), sizes=st.lists(st.integers(1, 3), min_size=1, max_size=3),
       total=st.integers(3, 16))
def test_interleaved_split_is_the_exact_min_max_over_runnable_counts(seed, sizes, total):
    profile = random_profile(random.Random(seed), 6)
    ts = plan_templates(profile, small_cluster(1, 10**12), max_nodes=3, fault_tolerance=0,
                        total_microbatches=total, virtual_stages=2)
    templates = [ts.get(n) for n in sizes]
    options = [[m for m in range(t.min_microbatches, total + 1) if t.runs_microbatches(m)] for t in templates]
    best = None
    for counts in itertools.product(*options):
        if sum(counts) == total:
            value = max(t.iteration_ms_at(m) for t, m in zip(templates, counts))
            best = value if best is None else min(best, value)
    if best is None:
        with pytest.raises(InfeasibleBatchError) as info:
            split_batch(templates, total, 1)
        assert info.value.nearest_valid != total
        return
    counts = split_batch(templates, total, 1)
    assert sum(counts) == total and all(t.runs_microbatches(m) for t, m in zip(templates, counts))
    assert max(t.iteration_ms_at(m) for t, m in zip(templates, counts)) == pytest.approx(best)


def test_unrunnable_batch_names_the_nearest_valid_one():
    profile = random_profile(random.Random(2), 6)
    ts = plan_templates(profile, small_cluster(1, 10**12), max_nodes=3, fault_tolerance=0,
                        total_microbatches=7, virtual_stages=2)
    with pytest.raises(InfeasibleBatchError) as info:
        split_batch([ts.get(3)], 14, 2)  # 7 microbatches on 3 workers: 2 rounds do not divide 7
    assert info.value.nearest_valid in (12, 16)
    assert f"nearest valid global batch is {info.value.nearest_valid}" in str(info.value)


def test_instantiation_gives_every_pipeline_a_runnable_count():
    profile = random_profile(random.Random(4), 12)
    ts = plan_templates(profile, small_cluster(1, 10**12), max_nodes=6, fault_tolerance=1,
                        total_microbatches=24, virtual_stages=2)
    for live in range(2, 7):
        inst = instantiate(ts, range(live), 24, 1)
        assert sum(p.microbatches for p in inst.pipelines) == 24
        assert all(ts.get(p.template).runs_microbatches(p.microbatches) for p in inst.pipelines)


def test_too_few_layers_for_the_stages_is_explained():
    profile = random_profile(random.Random(5), 6)
    ts = plan_templates(profile, small_cluster(1, 10**12), max_nodes=4, fault_tolerance=0,
                        total_microbatches=8, virtual_stages=2)
    assert [t.nodes for t in ts.templates] == [1, 2, 3]
    assert "8 stages needed but the model has only 6 layers (2 stages per worker)" in ts.infeasible[4]


def test_runtime_rejects_wide_plans_before_any_worker_starts():
    from oobleck_elastic.runtime.supported import check_supported

    with pytest.raises(ConfigError, match="planner.wide plans stages that span several workers"):
        check_supported(load_config(None, ["planner.wide=true"]))


def test_a_one_worker_interleaved_pipeline_pays_no_exchanges():
    """Its stages hand activations over in the worker (torch runs same-rank stages locally):
    T(M) is M times the whole model's compute plus the tails, whatever the transfer costs."""
    profile = random_profile(random.Random(3), 8)
    cluster = small_cluster(1, 10**9, link_latency_us=3000.0)
    t = plan_template(profile, cluster, 1, 4, virtual_stages=4)
    assert (t.positions, t.num_stages) == (1, 4)
    assert [s.send_ms for s in t.stages] == [0.0] * 4
    compute = sum(layer.compute_ms for layer in profile.layers)
    assert t.iteration_ms == pytest.approx(4 * compute + sum(t.tails()))
    assert t.times(6)[-1] == pytest.approx(6 * compute + sum(t.tails()))
