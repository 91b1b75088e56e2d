"""The failure-trace simulator (oobleck_elastic/simulation, `python -m oobleck_elastic.simulate`):
traces and durations, the recovery-cost fit, exact accounting of simulated time, the same
planner code path as the runtime, the paper's Table 2 scenario and clean errors (its prediction
of a real local job with failures: tests/jobs/test_simulate_trace_jobs.py)."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib

import pytest

from oobleck_elastic.config import load_config
from oobleck_elastic.errors import ConfigError
from oobleck_elastic.planning import Cluster, synthetic_gpt
from oobleck_elastic.planning.reconfigure import Transfer, WorkerRef
from oobleck_elastic.planning.recovery import Base, plan_next, transfers_between
from oobleck_elastic.simulate import main
from oobleck_elastic.simulation import (
    Baselines,
    RecoveryConstants,
    RestartBaseline,
    SimJob,
    Trace,
    TraceEvent,
    fit_constants,
    fixed_trace,
    load_csv,
    parse_duration,
    poisson_trace,
    simulate,
)
from oobleck_elastic.simulation.recovery_cost import default_constants, transfer_seconds

ROOT = pathlib.Path(__file__).resolve().parents[2]
MEMORY = 400 * 2**20
CONSTANTS = RecoveryConstants(detect_s=0.1, teardown_s=0.2, agree_s=0.05, reinit_s=0.03, rebuild_s=0.02,
                              restore_s=0.5, step_overhead_s=0.1, source="test")


def small_job(**extra) -> SimJob:
    """12 layers, 1 worker per node, a memory limit that needs 2 nodes per pipeline (n0 = 2)."""
    profile = synthetic_gpt(12, hidden=512, seq_len=256, microbatch_size=2, vocab=4096)
    cluster = Cluster(workers_per_node=1, memory_per_worker=MEMORY)
    return SimJob(profile=profile, cluster=cluster, fault_tolerance=1, global_batch=64, microbatch=2, **extra)


# --- traces and durations --------------------------------------------------------------------

@pytest.mark.parametrize("text, seconds", [("90", 90), ("90s", 90), ("10min", 600), ("6h", 21600), ("1.5h", 5400),
                                           ("7.7min", 462), ("2d", 172800), (30, 30)])
def test_durations_parse_with_their_units(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text, message", [("-5s", "must not be negative"), ("10 minutes", "is not a duration"),
                                           ("ten", "is not a duration"), ("5y", "is not a duration")])
def test_bad_durations_say_what_is_accepted(text, message):
    with pytest.raises(ConfigError, match=message):
        parse_duration(text, "--replace-after")


def test_the_papers_fixed_trace_removes_one_node_per_interval_down_to_half():
    trace = fixed_trace(600, nodes=30, end_nodes=15)
    assert [e.time_s for e in trace.events] == [600 * k for k in range(1, 16)]
    assert {e.kind for e in trace.events} == {"remove"} and trace.duration_s == 16 * 600


def test_poisson_trace_is_seeded_and_replaces_nodes_after_the_delay():
    a = poisson_trace(462, nodes=8, events=400, replace_after_s=300, seed=3)
    assert a == poisson_trace(462, nodes=8, events=400, replace_after_s=300, seed=3)
    removes = [e for e in a.events if e.kind == "remove"]
    adds = [e for e in a.events if e.kind == "add"]
    assert len(removes) == len(adds) == 400
    assert sorted(e.node for e in adds) == list(range(8, 408))  # fresh ids
    gaps = [b.time_s - a_.time_s for a_, b in zip([TraceEvent(time_s=0, kind="remove")] + removes, removes)]
    assert 462 * 0.85 < sum(gaps) / len(gaps) < 462 * 1.15
    assert sorted(e.time_s for e in adds) == sorted(e.time_s + 300 for e in removes)


def test_the_cited_spot_means_have_names():
    from oobleck_elastic.simulation.trace import trace_from_spec

    for name, mean in (("ec2", 462), ("gcp", 618)):
        expected = dataclasses.replace(poisson_trace(mean, nodes=4, events=3, seed=0), name=f"poisson:{name}")
        assert trace_from_spec(f"poisson:{name}", nodes=4, events=3, replace_after_s=0, seed=0) == expected


def test_spot_trace_csv_reads_comments_header_and_durations(tmp_path):
    path = tmp_path / "spot.csv"
    path.write_text("time,kind,node\n# a comment\n90s,remove,3\n10min,add,7\n900,remove\n")
    trace = load_csv(str(path), nodes=6)
    assert [(e.time_s, e.kind, e.node) for e in trace.events] == [(90, "remove", 3), (600, "add", 7),
                                                                   (900, "remove", None)]


@pytest.mark.parametrize("line, message", [
    ("60,explode,1", "spot.csv:2: kind must be add or remove"),
    ("60,remove,x", "spot.csv:2: node must be a non-negative integer id"),
    ("-60,remove,1", "spot.csv:2: time must not be negative"),
    ("60", "spot.csv:2: expected time,kind"),
])
def test_bad_trace_rows_name_the_file_and_line(tmp_path, line, message):
    path = tmp_path / "spot.csv"
    path.write_text(f"time,kind,node\n{line}\n")
    with pytest.raises(ConfigError, match=message):
        load_csv(str(path), nodes=4)


# --- the recovery-cost model ----------------------------------------------------------------

def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_constants_are_the_median_phases_of_recoveries_and_the_mean_step_overhead(tmp_path):
    gen = {"event": "generation", "generation": 0, "nodes": [0, 1], "pipelines": [{"nodes": [0, 1], "microbatches": 4}]}
    steps = [{"step": k, "time": 10.0 + 0.5 * k} for k in range(4)]  # gaps of 0.5 s
    rec = [{"event": "recovery", "lost": [1], "restored_from": None,
            "phases_s": {"detect": d, "teardown": 0.2, "agree": 0.1, "reinit": 0.01, "rebuild": 0.0, "replay": 9}}
           for d in (0.1, 0.3, 5.0)]
    restore = {"event": "recovery", "lost": [2, 3], "restored_from": 10, "phases_s": {"detect": 0.2, "restore": 0.7}}
    join = {"event": "recovery", "lost": [], "joined": [4], "restored_from": None, "phases_s": {"agree": 99.0}}
    path = _write(tmp_path / "metrics.jsonl", [gen, *steps, *rec, restore, join, {"step": 4, "time": 30.0}])
    constants = fit_constants([path], step_model=lambda record: 0.3)
    assert constants.detect_s == pytest.approx(0.25)  # median of 0.1, 0.3, 5.0, 0.2: one slow one does not set it
    assert (constants.teardown_s, constants.agree_s, constants.restore_s) == pytest.approx((0.2, 0.1, 0.7))
    assert constants.step_overhead_s == pytest.approx(0.2) and constants.step_records == 3  # 0.5 - 0.3
    assert (constants.in_memory_records, constants.restore_records) == (3, 1)


def test_each_log_can_be_fitted_against_its_own_runs_profile(tmp_path):
    rec = {"event": "recovery", "lost": [1], "restored_from": None, "phases_s": {"detect": 0.1}}
    gen = {"event": "generation", "nodes": [0], "pipelines": [{"nodes": [0], "microbatches": 1}]}
    logs = [_write(tmp_path / f"m{k}.jsonl", [gen, {"step": 0, "time": 0.0}, {"step": 1, "time": gap}, rec])
            for k, gap in enumerate((1.0, 2.0))]
    constants = fit_constants(logs, [lambda r: 0.5, lambda r: 1.9])
    assert constants.step_overhead_s == pytest.approx((0.5 + 0.1) / 2)


def test_a_shared_host_bounds_a_step_by_its_cores():
    job = small_job()
    work = 32 * sum(layer.compute_ms for layer in job.profile.layers) / 1e3  # 32 microbatches, all layers
    assert job.step_seconds(1.0) == pytest.approx(1e-3)
    shared = small_job(host_cores=2)
    assert shared.step_seconds(1.0) == pytest.approx(max(1e-3, work / 2))
    assert shared.step_seconds(1e9) == pytest.approx(1e6)


def test_fitting_a_log_without_failures_says_how_to_make_one(tmp_path):
    path = _write(tmp_path / "metrics.jsonl", [{"step": 0, "time": 1.0}])
    with pytest.raises(ConfigError, match="run a job with failures"):
        fit_constants([path])


def test_the_shipped_constants_say_where_they_come_from():
    constants = default_constants()
    assert constants.in_memory_records >= 2 and constants.step_records > 0
    assert "benchmarks/recovery_constants.py" in constants.source
    assert constants.describe().startswith("recovery constants: detect")


def test_transfer_time_is_the_busiest_workers_bytes_over_the_bandwidth():
    a, b, c = WorkerRef(0, 0), WorkerRef(1, 0), WorkerRef(2, 0)
    transfers = [Transfer(layer=0, src=a, dst=c, bytes=4e9), Transfer(layer=1, src=b, dst=c, bytes=2e9),
                 Transfer(layer=2, src=a, dst=b, bytes=1e9)]
    assert transfer_seconds(transfers, 2.0) == pytest.approx(3.0)  # c receives 6 GB; a sends 5 GB


# --- simulated time --------------------------------------------------------------------------

def test_a_failure_costs_the_interrupted_step_and_the_fitted_recovery_and_time_adds_up():
    job = small_job(checkpoint_interval_steps=0)
    first = job.plan(6).instantiation
    step = first.iteration_ms / 1e3 + CONSTANTS.step_overhead_s
    at = 10.5 * step
    trace = Trace(name="one", nodes=6, events=(TraceEvent(time_s=at, kind="remove", node=1),), duration_s=40 * step)
    (ours,) = simulate(job, trace, CONSTANTS, systems=["oobleck"])
    change = ours.changes[0]
    assert ours.lost_s == pytest.approx(0.5 * step)
    assert ours.recovery_s == pytest.approx(CONSTANTS.in_memory_s(change.transfer_s))
    after = change.layout.instantiation.iteration_ms / 1e3 + CONSTANTS.step_overhead_s
    resumed = at + ours.recovery_s
    assert ours.steps == 10 + math.floor((trace.duration_s - resumed) / after + 1e-9)
    in_progress = trace.duration_s - resumed - (ours.steps - 10) * after
    assert ours.useful_s + ours.lost_s + ours.recovery_s + in_progress == pytest.approx(trace.duration_s)
    assert ours.samples_per_s == pytest.approx(ours.steps * 64 / trace.duration_s)


def test_the_restart_baseline_rolls_back_to_its_last_checkpoint():
    job = small_job()
    restart = RestartBaseline(restart_s=7.0, checkpoint_interval_s=100.0, checkpoint_write_s=3.0)
    trace = Trace(name="one", nodes=6, events=(TraceEvent(time_s=250.0, kind="remove", node=0),), duration_s=400.0)
    (r,) = simulate(job, trace, CONSTANTS, baselines=Baselines(restart=restart), systems=["restart"])
    (free,) = simulate(job, Trace(name="q", nodes=6, events=(), duration_s=250.0), CONSTANTS,
                       baselines=Baselines(restart=restart), systems=["restart"])
    step = free.useful_s / free.steps
    per_checkpoint = math.ceil(100.0 / step - 1e-9)  # steps between checkpoints
    saved = 2 * per_checkpoint  # two checkpoints fit before the failure at 250 s
    assert free.checkpoint_s == 6.0 and r.fallbacks == 1 and r.recovery_s == 7.0
    assert r.fallback_s == pytest.approx(free.useful_s - saved * step)  # training since the checkpoint is lost
    assert r.failure_free_samples_per_s > r.samples_per_s
    assert sum(steps for *_, steps in r.progress) == r.steps  # the plot leaves the thrown-away training out


def test_our_runtime_shares_the_planners_code_path_with_the_runtime():
    """The layouts the simulator reaches after each change are the ones the runtime's own
    functions give: templates as elastic/job.py plans them, then plan_next from each generation
    as elastic/run.py calls it, with transfers_between for the copies."""
    from oobleck_elastic.elastic.job import templates as runtime_templates

    job = small_job(checkpoint_interval_steps=5)
    cfg = load_config(ROOT / "examples/gpt/config.yaml", ["train.global_batch_size=64", "train.microbatch_size=2",
                                                          f"planner.memory_per_worker={MEMORY}"])
    assert job.plan(5).templates == runtime_templates(job.profile, cfg, 5, 1)
    events = (TraceEvent(time_s=30, kind="remove", node=1), TraceEvent(time_s=60, kind="add", node=5),
              TraceEvent(time_s=90, kind="remove", node=3), TraceEvent(time_s=120, kind="remove", node=5),
              TraceEvent(time_s=150, kind="remove", node=4))  # the last one loses layers: checkpoint fallback
    (ours,) = simulate(job, Trace(name="t", nodes=5, events=events, duration_s=200), CONSTANTS, systems=["oobleck"])
    templates = job.plan(5).templates
    base, live = Base(0, job.plan(5).instantiation), set(range(5))
    assert [c.node for c in ours.changes] == [1, 5, 3, 5, 4]
    for generation, change in enumerate(ours.changes, start=1):
        live = live - {change.node} if change.kind == "remove" else live | {change.node}
        expected = plan_next(templates, base, alive=sorted(live), dead=[change.node] if change.kind == "remove" else [],
                             step=0, checkpoint=lambda: 0, global_batch=64, microbatch=2)
        assert change.layout.instantiation == expected.instantiation
        assert (change.layout.restored_from is None) == (expected.restored_from is None)
        if expected.restored_from is None:
            assert change.layout.actions == expected.actions
        before = base.instantiation if expected.base is not None else None
        assert change.transfer_s == transfer_seconds(transfers_between(templates, before, expected.instantiation),
                                                     job.cluster.inter_node_bandwidth)
        base = Base(generation, expected.instantiation)
    assert ours.changes[-1].layout.restored_from is not None and ours.fallbacks == 1


def test_per_count_layouts_reuse_each_change_and_stay_close_to_exact():
    job = small_job()
    trace = poisson_trace(60, nodes=8, events=40, replace_after_s=20, seed=1)
    exact, = simulate(job, trace, CONSTANTS, systems=["oobleck"])
    cached, = simulate(job, trace, CONSTANTS, systems=["oobleck"], layouts="per-count")
    assert cached.recoveries == exact.recoveries == 80
    assert cached.samples_per_s == pytest.approx(exact.samples_per_s, rel=0.03)


# --- the command line ------------------------------------------------------------------------

def test_paper_table2_reproduces_the_ordering_and_the_collapse(tmp_path, capsys):
    png = tmp_path / "plot.png"
    assert main(["--scenario", "paper-table2", "--json", "--plot", str(png)]) == 0
    rows = {(r["trace"], r["system"]): r for r in json.loads(capsys.readouterr().out)["rows"]}
    for trace in ("fixed:6h", "fixed:1h", "fixed:10min"):
        assert rows[trace, "oobleck"]["samples_per_s"] > rows[trace, "restart"]["samples_per_s"]
        for r in (rows[trace, s] for s in ("oobleck", "restart", "redundant", "torchrun")):
            assert set(r) >= {"trace", "system", "samples_per_s", "failure_free_samples_per_s", "effective_fraction",
                              "recovery_s", "fallback_s", "paper_samples_per_s"}
    ours, varuna = rows["fixed:10min", "oobleck"], rows["fixed:10min", "restart"]
    assert varuna["samples_per_s"] < 0.10 * varuna["failure_free_samples_per_s"]
    assert ours["samples_per_s"] > 0.75 * ours["failure_free_samples_per_s"]
    assert (ours["paper_samples_per_s"], varuna["paper_samples_per_s"]) == (3.55, 0.12)
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_the_table_names_the_constants_and_the_paper_beside_ours(tmp_path, capsys):
    assert main(["--scenario", "paper-table2", "--plot", "", "--systems", "oobleck,restart"]) == 0
    out = capsys.readouterr().out
    assert "recovery constants: detect" in out and "source:" in out and "restart_s=701" in out
    assert "paper samples/s" in out and "Where and why ours differs" in out


def test_a_synthetic_job_with_a_poisson_trace_and_replacements(tmp_path, capsys):
    assert main(["--synthetic", "gpt", "--model-size", "1.3B", "--nnodes", "16", "--nproc-per-node", "2",
                 "--global-batch", "512", "--microbatch", "4", "--trace", "poisson:10.3min", "--events", "20",
                 "--replace-after", "2min", "--seed", "4", "--json", "--plot", str(tmp_path / "p.png")]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["system"] for r in rows] == ["oobleck", "restart", "redundant", "torchrun"]
    assert all(r["trace"] == "poisson:10.3min" for r in rows)
    ours = rows[0]
    assert ours["recoveries"] == 40 and ours["fallbacks"] == 0 and ours["samples_per_s"] > rows[1]["samples_per_s"]


@pytest.mark.parametrize("argv, message", [
    (["--trace", "fixd:10min"], "unknown trace kind 'fixd'"),
    (["--trace", "10min"], "no such file; give a CSV"),
    (["--traces", "fixed:1h"], "unrecognized arguments: --traces"),
    (["--trace", "fixed:10 minutes"], "is not a duration"),
    (["--trace", "poisson:5min", "--events", "-3"], "--events must be >= 0, got -3"),
    (["--trace", "poisson:5min", "--replace-after=-5s"], "--replace-after must not be negative"),
    (["--trace", "fixed:1h", "--baseline", "restart.restart_s=-1"], "must not be negative"),
    (["--trace", "fixed:1h", "--baseline", "varuna.restart_s=1"], "SYSTEM one of restart, redundant, torchrun"),
    (["--trace", "fixed:1h", "--model-size", "7B"], "unknown --model-size '7B'; known sizes: 125M"),
    (["--trace", "fixed:1h", "--systems", "oobleck,bamboo"], "unknown system(s) ['bamboo']"),
])
def test_bad_input_is_one_clear_line(capsys, argv, message):
    base = ["--synthetic", "gpt", "--model-size", "1.3B", "--nnodes", "8", "--global-batch", "256", "--microbatch", "4"]
    if "--model-size" in argv:
        base = base[:2] + base[4:]
    assert exit_code([*base, *argv, "--plot", ""]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def exit_code(argv) -> int:
    """main's status, or the one argparse exits with."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


def test_a_bad_csv_row_fails_the_cli_with_its_line(tmp_path, capsys):
    path = tmp_path / "spot.csv"
    path.write_text("0,remove,1\n60,remove,one\n")
    assert main(["--synthetic", "gpt:12", "--nnodes", "6", "--global-batch", "64", "--microbatch", "2",
                 "--trace", str(path), "--plot", ""]) == 2
    assert f"{path}:2: node must be a non-negative integer id, got 'one'" in capsys.readouterr().err

