"""The planner's estimate of a step is the step, shown in its parts: the pipeline schedule, the
gradient all-reduce and the optimizer step of the stage (interleaved: the worker position) that
bounds it, summing to the estimate, for 1F1B and interleaved templates alike."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from random_profiles import random_profile, small_cluster

from oobleck_elastic.plan import main
from oobleck_elastic.planning import plan_templates
from oobleck_elastic.planning.cost import ring_factor


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), nodes=st.integers(1, 3), virtual=st.sampled_from([1, 2]),
       pipelines=st.integers(1, 4))
def test_the_parts_sum_to_the_step_and_come_from_one_stage(seed, nodes, virtual, pipelines):
    profile = random_profile(random.Random(seed), 6)
    ts = plan_templates(profile, small_cluster(1, 10**12, inter_node_bandwidth=1e3), max_nodes=3,
                        fault_tolerance=0, total_microbatches=12, virtual_stages=virtual)
    t = ts.get(nodes)
    m = next(k for k in range(t.min_microbatches, 13) if t.runs_microbatches(k))
    parts = t.step_parts(m, pipelines)
    assert sum(parts.values()) == pytest.approx(t.iteration_ms_at(m, pipelines))
    assert parts["schedule"] > 0 and parts["all_reduce"] >= 0 and parts["optimizer"] >= 0
    # one stage's (interleaved: one position's stages') all-reduce and optimizer step
    groups = [t.stages[q::t.positions] for q in range(t.positions)] if virtual > 1 else [[s] for s in t.stages]
    assert any(parts["all_reduce"] == pytest.approx(ring_factor(pipelines) * sum(s.grad_sync_ms for s in g))
               and parts["optimizer"] == pytest.approx(sum(s.optimizer_ms for s in g)) for g in groups)
    if pipelines == 1:
        assert parts["all_reduce"] == 0, "one pipeline sums no gradients with another"


def test_the_plan_cli_shows_the_step_whole_and_in_parts(capsys):
    base = ["--synthetic", "gpt:24", "--nnodes", "8", "--nproc-per-node", "1", "--global-batch", "96",
            "--microbatch", "1"]
    assert main([*base, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    step = out["step_ms"]
    assert step["total"] == out["instantiation"]["iteration_ms"]
    assert step["schedule"] + step["all_reduce"] + step["optimizer"] == pytest.approx(step["total"])
    assert step["all_reduce"] > 0, "8 pipelines sum their gradients"
    assert main(base) == 0
    text = capsys.readouterr().out
    assert f"estimated step {step['total']:.1f} ms" in text
    assert (f"{step['schedule']:.1f} ms of pipeline schedule + {step['all_reduce']:.1f} ms of gradient "
            "all-reduce") in text
