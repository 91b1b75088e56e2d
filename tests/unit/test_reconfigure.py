"""Reconfiguration after failures and joins: valid plans, complete transfers, typed errors."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from random_profiles import random_profile, small_cluster

from oobleck_elastic.errors import LayersLostError
from oobleck_elastic.planning import (
    ReconfigurationPlan,
    WorkerRef,
    build_instantiation,
    dumps,
    instantiate,
    layer_holders,
    loads,
    plan_templates,
    reconfigure,
    synthetic_gpt,
)


def check_plan(ts, before, plan, lost, joined):
    inst = plan.instantiation
    live = (set(before.nodes) - set(lost)) | set(joined)
    assert set(inst.nodes) == live, "every live node is in a pipeline or a spare"
    in_pipelines = [n for p in inst.pipelines for n in p.nodes]
    assert len(in_pipelines) == len(set(in_pipelines))
    assert sum(p.microbatches for p in inst.pipelines) * inst.microbatch_size == before.global_batch_size
    old = {w: r for w, r in layer_holders(before, ts).items() if w.node not in lost}
    new = layer_holders(inst, ts)
    received = {(t.dst, t.layer) for t in plan.transfers}
    for t in plan.transfers:
        assert t.src in old and t.layer in old[t.src], "source holds the layer"
        assert t.src.node not in lost
    for worker, layers in new.items():
        had = old.get(worker, ())
        for layer in layers:
            if layer not in had:
                assert (worker, layer) in received, f"{worker} misses layer {layer}"
    assert len(received) == len(plan.transfers), "no layer is sent twice to one worker"
    # the new generation keeps the global batch and is a valid plan on its own
    if len(inst.pipelines) >= ts.fault_tolerance + 1:
        assert not [w for w in plan.warnings if "pipeline(s) for fault_tolerance" in w]


def job(seed, layers, g, n_max, f, per_worker):
    profile = random_profile(random.Random(seed), layers)
    total = sum(x.static_bytes + 2 * x.activation_bytes for x in profile.layers)
    ts = plan_templates(profile, small_cluster(g, max(total // per_worker, 1)), max_nodes=n_max,
                        fault_tolerance=f, total_microbatches=64)
    return ts, instantiate(ts, range(n_max), 2 * max(64, n_max * g), 2)


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 10**6), layers=st.integers(4, 12), g=st.sampled_from([1, 2]),
       f=st.integers(1, 3), n_max=st.integers(4, 14), per_worker=st.integers(1, 4), pick=st.randoms())
def test_any_f_failures_are_recovered_in_memory(seed, layers, g, f, n_max, per_worker, pick):
    try:
        ts, before = job(seed, layers, g, n_max, f, per_worker)
    except Exception:
        return  # job too small for f+1 replicas: covered elsewhere
    lost = pick.sample(sorted(before.nodes), f)
    plan = reconfigure(ts, before, lost=lost)  # must never raise LayersLostError for <= f losses
    check_plan(ts, before, plan, lost, [])
    assert plan == reconfigure(ts, before, lost=lost), "deterministic"
    assert loads(ReconfigurationPlan, dumps(plan)) == plan


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), layers=st.integers(4, 12), n_max=st.integers(4, 10),
       joins=st.integers(1, 5), pick=st.randoms())
def test_failures_then_joins(seed, layers, n_max, joins, pick):
    try:
        ts, before = job(seed, layers, 1, n_max, 1, 2)
    except Exception:
        return
    lost = pick.sample(sorted(before.nodes), 1)
    after = reconfigure(ts, before, lost=lost)
    joined = list(range(100, 100 + joins))
    plan = reconfigure(ts, after.instantiation, joined=joined)
    check_plan(ts, after.instantiation, plan, [], joined)


def test_more_than_f_failures_name_the_lost_layers():
    profile = synthetic_gpt(24)
    ts = plan_templates(profile, small_cluster(1, 36 * 2**30), max_nodes=8, fault_tolerance=1,
                        total_microbatches=64)
    before = instantiate(ts, range(8), 256, 4)
    assert [p.nodes for p in before.pipelines] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    first_stage = ts.get(4).stages[0].layers
    with pytest.raises(LayersLostError) as info:
        reconfigure(ts, before, lost=[0, 4])
    assert info.value.layers == list(range(*first_stage))
    assert "have no surviving replica" in str(info.value)
    # Two failures in one pipeline leave the other intact: recovered despite f = 1.
    plan = reconfigure(ts, before, lost=[0, 1])
    check_plan(ts, before, plan, [0, 1], [])


def test_reinstantiate_then_borrow_then_merge():
    profile = synthetic_gpt(24)
    ts = plan_templates(profile, small_cluster(1, 36 * 2**30), max_nodes=12, fault_tolerance=1,
                        total_microbatches=64)
    assert ts.min_nodes == 3 and [t.nodes for t in ts.templates] == list(range(3, 10))
    fours = build_instantiation([ts.get(4)] * 3, [range(0, 4), range(4, 8), range(8, 12)], 256, 4)
    # one node lost from a 4-node pipeline: the 3 survivors use the 3-node template
    plan = reconfigure(ts, fours, lost=[0])
    assert plan.actions == ("pipeline 0: re-instantiated from the 3-node template",)
    assert [p.nodes for p in plan.instantiation.pipelines] == [(1, 2, 3), tuple(range(4, 8)), tuple(range(8, 12))]
    check_plan(ts, fours, plan, [0], [])
    # two lost: 2 < n0 survivors borrow one node from a 4-node pipeline, which stays >= n0
    plan = reconfigure(ts, fours, lost=[0, 1])
    assert len(plan.actions) == 1 and "borrowed node(s)" in plan.actions[0]
    assert sorted(len(p.nodes) for p in plan.instantiation.pipelines) == [3, 3, 4]
    check_plan(ts, fours, plan, [0, 1], [])
    # every pipeline at n0: nobody can lend, so the survivor merges
    threes = build_instantiation([ts.get(3)] * 4, [range(0, 3), range(3, 6), range(6, 9), range(9, 12)], 256, 4)
    plan = reconfigure(ts, threes, lost=[0, 1])
    assert len(plan.actions) == 1 and "merged pipelines on [2]" in plan.actions[0]
    assert sorted(len(p.nodes) for p in plan.instantiation.pipelines) == [3, 3, 4]
    check_plan(ts, threes, plan, [0, 1], [])


def test_transfer_sources_are_spread_over_replicas():
    profile = synthetic_gpt(24)
    ts = plan_templates(profile, small_cluster(1, 36 * 2**30), max_nodes=12, fault_tolerance=1,
                        total_microbatches=64)
    threes = build_instantiation([ts.get(3)] * 4, [range(0, 3), range(3, 6), range(6, 9), range(9, 12)], 256, 4)
    plan = reconfigure(ts, threes, lost=[1])
    sent = {}
    for t in plan.transfers:
        sent[t.src] = sent.get(t.src, 0) + t.bytes
    assert len(sent) >= 3, "several replicas send"
    assert max(sent.values()) <= 2 * plan.bytes_moved / len(sent)


def test_join_forms_new_pipeline_and_moves_only_joiners_layers():
    profile = synthetic_gpt(24)
    ts = plan_templates(profile, small_cluster(1, 36 * 2**30), max_nodes=9, fault_tolerance=1,
                        total_microbatches=64)
    before = instantiate(ts, range(6), 256, 4)
    plan = reconfigure(ts, before, joined=[6, 7, 8])
    check_plan(ts, before, plan, [], [6, 7, 8])
    assert len(plan.instantiation.pipelines) == len(before.pipelines) + 1
    assert {t.dst.node for t in plan.transfers} == {6, 7, 8}
    assert all(isinstance(t.src, WorkerRef) for t in plan.transfers)
