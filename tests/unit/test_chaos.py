"""The chaos runner (oobleck_elastic/launcher/chaos.py) without processes: its report, read from a
metrics log, counts exactly; its schedule refuses what cannot fail a node and replaces nodes
that leave on their own; its comparison checks every logged step (the seeded run itself:
tests/jobs/test_chaos_jobs.py)."""

from __future__ import annotations

import json

import pytest

from oobleck_elastic.launcher.chaos import (
    ChaosConfig,
    ChaosSchedule,
    Injection,
    chaos_report,
    compare_losses,
    compare_weights,
)


def test_the_report_counts_failures_recoveries_lost_time_and_redone_steps(tmp_path):
    lines = [{"step": 0, "time": 10.0}, {"step": 1, "time": 11.0},
             {"event": "recovery", "generation": 1, "restored_from": None, "lost": [1]},
             {"event": "recovery", "generation": 2, "restored_from": None, "lost": [], "joined": [4]},
             {"step": 2, "time": 13.5}, {"step": 3, "time": 14.0},
             {"event": "recovery", "generation": 3, "restored_from": 2, "lost": [2, 3]},
             {"step": 2, "time": 17.0}, {"step": 3, "time": 17.5},
             {"event": "final", "steps": 4, "param_sums": [1.0], "param_norms": [2.0]}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    injections = [Injection(12.0, "kill", (1,), 1), Injection(14.5, "kill_two", (2,), 3),
                  Injection(14.9, "kill_two", (3,), 3)]
    report = chaos_report(injections, str(path))
    assert report.injected == {"kill": 1, "kill_in_recovery": 0, "kill_two": 1, "hang": 0}
    assert report.nodes_failed == 3 and (report.recoveries_in_memory, report.fallbacks) == (1, 1)
    assert report.lost_s == pytest.approx((1.5, 2.5, 2.1)) and report.steps_redone == 2 and report.steps == 4
    assert report.final["param_sums"] == [1.0]


def test_a_schedule_that_cannot_fail_a_node_is_refused():
    with pytest.raises(ValueError, match="at least 3 nodes"):
        ChaosConfig(nodes=2)
    with pytest.raises(ValueError, match="one non-negative number per kind"):
        ChaosConfig(weights=(1.0, 1.0))


class _Nodes:
    """The part of LocalNodes a schedule drives: which nodes run, and starting one more."""

    def __init__(self, n: int) -> None:
        self.alive = list(range(n))
        self.started = 0
        self.protocol = self

    def progress(self):
        return {"step": 7}

    def running(self):
        return list(self.alive)

    def start(self):
        self.started += 1
        self.alive.append(100 + self.started)


def test_the_comparison_checks_every_logged_step_and_scales_by_the_norm(tmp_path):
    reference = [{"step": 0, "loss": 2.0}, {"step": 1, "loss": 1.5}, {"step": 2, "loss": 1.25},
                 {"event": "final", "steps": 3, "param_sums": [-1e-3, 4.0], "param_norms": [10.0, 8.0]}]
    # step 1 was logged twice (redone after a fallback); its first record used a wrong sample
    run = [{"step": 0, "loss": 2.0}, {"step": 1, "loss": 1.5 * (1 + 1e-3)},
           {"event": "recovery", "restored_from": 0}, {"step": 1, "loss": 1.5}, {"step": 2, "loss": 1.25}]
    n, worst, at = compare_losses(run, reference)
    assert (n, at) == (4, 1) and worst == pytest.approx(1e-3)
    assert compare_losses([{"step": 7, "loss": 1.0}], reference)[1] == float("inf"), "a step the reference never ran"
    # a run without its last step's checkpoint fails the comparison, however close its sums
    # (the comparison used to fall back to them, which hid a run that lost its final checkpoint)
    final = {"steps": 3, "param_sums": [-1e-3, 4.0], "param_norms": [10.0, 8.0]}
    worst, what = compare_weights(str(tmp_path / "a"), str(tmp_path / "b"), final, reference[-1])
    assert worst == float("inf") and "checkpoint of its last step 3 is missing" in what, what
    assert compare_weights("a", "b", {**final, "steps": 2}, reference[-1])[0] == float("inf")


def test_a_node_that_leaves_on_its_own_is_replaced_too(monkeypatch):
    # a live node taken for dead on a loaded machine fences itself and exits: no injection
    # counted it, but the job must keep its size or the schedule runs out of nodes to fail
    clock = [1000.0]
    monkeypatch.setattr("oobleck_elastic.launcher.chaos.time.monotonic", lambda: clock[0])
    schedule = ChaosSchedule(ChaosConfig(nodes=4, mean_interval_s=1e9, replace_after_s=1.0))
    nodes = _Nodes(4)
    schedule(nodes)
    assert nodes.started == 0
    nodes.alive.remove(2)
    schedule(nodes)
    assert nodes.started == 0, "replaced after replace_after_s, as an injected loss is"
    clock[0] += 1.5
    schedule(nodes)
    schedule(nodes)
    assert nodes.started == 1 and len(nodes.alive) == 4
