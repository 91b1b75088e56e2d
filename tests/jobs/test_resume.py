"""A stopped job resumes exactly: every node of a 4-node job is SIGKILLed (mid-step, or while a
checkpoint is being written) or one agent gets SIGTERM, and the same command on 3 nodes ends
with the weights of an uninterrupted one-process run (float64), having redone only the steps
after the checkpoint it resumed from (none after a SIGTERM). A checkpoint of another job is one
line from the launcher and stays untouched."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from jobs import SCRIPT, assert_matches, job_args, node_agent, records, run_processes

STEPS = 14
SETS = ["--set", f"train.steps={STEPS}", "--set", "checkpoint.interval=4"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted one-process run of the same job."""
    tmp = tmp_path_factory.mktemp("resume-reference")
    alone = [*job_args(tmp, "ref"), *SETS, "--set", "planner.memory_per_worker=1GB", "--set", "train.device=cpu"]
    proc = subprocess.run([sys.executable, SCRIPT, *alone], cwd=tmp, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return records(tmp / "ref/metrics.jsonl")[-1]


def launch(tmp_path, nodes: int, run_id: str, workers: int = 1, extra=()) -> list[str]:
    # every launch of the job writes to the same metrics log and checkpoint dir (job_args' "job")
    return [sys.executable, "-m", "oobleck_elastic.launch", f"--oobleck-local-nodes={nodes}",
            f"--nproc-per-node={workers}",
            f"--oobleck-log-dir={tmp_path / 'logs' / run_id}", f"--rdzv-id={run_id}", SCRIPT,
            *job_args(tmp_path, "job"), *SETS, *extra]


def start(tmp_path, nodes: int, run_id: str, env=None) -> subprocess.Popen:
    return subprocess.Popen(launch(tmp_path, nodes, run_id), cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def wait_until(condition, launcher: subprocess.Popen, what: str, timeout: float = 200) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline and launcher.poll() is None, f"never saw {what}"
        time.sleep(0.1)


def logged(tmp_path, step: int) -> bool:
    path = tmp_path / "job/metrics.jsonl"
    return path.exists() and any(r.get("step") == step and "event" not in r for r in records(path))


def kill_everything(launcher: subprocess.Popen, run_id: str) -> None:
    """SIGKILL the launcher and every node (agent and workers) at once, as a power cut would."""
    launcher.kill()
    launcher.wait()  # gone before the others are looked for: it shares this test's process group
    for worker in run_processes(run_id):
        try:
            os.killpg(os.getpgid(worker.pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    psutil.wait_procs(run_processes(run_id), timeout=10)
    assert not run_processes(run_id)


def resume(tmp_path, run_id: str, reference, first_step: int, extra=()):
    """The same job on 3 nodes of 2 workers (3 two-stage pipelines of one node each, where the
    first run had 2 pipelines of two one-worker nodes): it resumes from `first_step` and ends
    with the reference's weights."""
    proc = subprocess.run(launch(tmp_path, 3, run_id, workers=2, extra=extra), cwd=tmp_path, capture_output=True,
                          text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"oobleck: resumed from step {first_step} (the checkpoint of run" in proc.stdout, proc.stdout
    log = records(tmp_path / "job/metrics.jsonl")
    begin = max(i for i, r in enumerate(log) if r.get("event") == "resumed")
    assert log[begin]["step"] == first_step
    steps = [r for r in log[begin:] if "step" in r and "event" not in r]
    assert [r["step"] for r in steps] == list(range(first_step, STEPS)), "each remaining step exactly once"
    assert all(r["samples"] == 64 and r["nodes"] == 3 and r["num_pipelines"] == 3 for r in steps)
    assert_matches([r for r in log[begin:] if r.get("event") == "final"][0], reference)
    return proc


def test_every_node_killed_at_step_9_resumes_on_3_nodes_exactly(tmp_path, reference):
    launcher = start(tmp_path, 4, "cut")
    try:
        wait_until(lambda: logged(tmp_path, 9), launcher, "step 9")
    finally:
        kill_everything(launcher, "cut")
    assert sorted(os.listdir(tmp_path / "job/checkpoints"))[-1] == "step_00000008"
    resume(tmp_path, "again", reference, first_step=8)


def test_a_kill_while_a_checkpoint_is_written_resumes_from_the_one_before(tmp_path, reference):
    # every worker stops (SIGSTOP) once it has written its layers of step 8's checkpoint, before
    # the set is published; then every node is killed: step 8 is a partial directory (all its
    # layer files, no manifest), never loaded
    faults = ";".join(f"node={n},step=8,phase=checkpoint,action=stop" for n in range(4))
    launcher = start(tmp_path, 4, "midwrite", {**os.environ, "OOBLECK_FAULT": faults})
    try:
        wait_until(lambda: [p.status() for p in run_processes("midwrite", workers=True)] == [psutil.STATUS_STOPPED] * 4,
                   launcher, "every worker stopped in the middle of the checkpoint")
    finally:
        kill_everything(launcher, "midwrite")
    names = sorted(os.listdir(tmp_path / "job/checkpoints"))
    assert names == [".partial-step_00000008-midwrite", "step_00000004"], names
    resume(tmp_path, "again", reference, first_step=4)
    assert not any(n.startswith(".partial") for n in os.listdir(tmp_path / "job/checkpoints")), \
        "the resumed run cleans up what the killed one left half-written"


def test_a_node_killed_while_a_stops_checkpoint_is_written_stops_with_it_published(tmp_path, reference):
    """Node 3's agent gets SIGTERM in step 9 (the stop is carried by step 9's commit), with
    checkpoint.interval 5 (the stop's step 10 is an interval step too: it is written once, by
    the stop, not twice into one directory at once), and node 1 (of the first pipeline,
    whose replicas write the checkpoint) dies once it has written its part of the stop's
    checkpoint: the survivors write it again in the next generation and
    publish it before the run says it stopped. The run used to say "its checkpoint is in" with
    no checkpoint there (a stop's parts were counted per generation, rank 0 recorded the stop
    after its own part, and nothing checked)."""
    env = {**os.environ, "OOBLECK_FAULT": "node=3,step=9,phase=forward,action=term;node=1,step=10,phase=checkpoint"}
    proc = subprocess.run(launch(tmp_path, 4, "stopkill", extra=["--set", "checkpoint.interval=5"]), cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "oobleck: stopped on request after step 10; its checkpoint is in" in proc.stdout, proc.stdout
    log = records(tmp_path / "job/metrics.jsonl")
    assert [r["lost"] for r in log if r.get("event") == "recovery"] == [[1]]
    assert [r["steps"] for r in log if r.get("event") == "stopped"] == [10]
    assert sorted(os.listdir(tmp_path / "job/checkpoints")) == ["step_00000005", "step_00000010"]
    resume(tmp_path, "again", reference, first_step=10)


def test_sigterm_to_one_agent_stops_the_job_and_nothing_is_redone(tmp_path, reference):
    launcher = start(tmp_path, 4, "term")
    try:
        wait_until(lambda: logged(tmp_path, 9), launcher, "step 9")
        node_agent("term", 1).send_signal(signal.SIGTERM)  # what a scheduler sends a node
        out, _ = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            kill_everything(launcher, "term")
    assert launcher.returncode == 0, out
    (stopped,) = [r for r in records(tmp_path / "job/metrics.jsonl") if r.get("event") == "stopped"]
    at = stopped["steps"]
    assert 10 <= at < STEPS and f"oobleck: stopped on request after step {at}" in out, out
    assert not run_processes("term"), "every node exited"
    checkpoints = tmp_path / "job/checkpoints"
    assert f"step_{at:08d}" in os.listdir(checkpoints)
    resume(tmp_path, "again", reference, first_step=at)

    # the same checkpoint dir with another model: one line, before training, the checkpoint untouched
    before = {p: p.stat().st_mtime_ns for p in checkpoints.rglob("*")}
    other = subprocess.run(launch(tmp_path, 2, "other", extra=["--set", "model.d_model=32"]), cwd=tmp_path,
                           capture_output=True, text=True, timeout=300)
    assert other.returncode != 0
    assert "error: cannot resume from" in other.stderr and "the model differs" in other.stderr, other.stderr
    assert "Traceback" not in other.stdout + other.stderr
    # and with checkpoint.resume=never: its step 12 would have replaced this job's
    fresh = subprocess.run(launch(tmp_path, 2, "fresh", extra=["--set", "model.d_model=32", "--set",
                                                              "checkpoint.resume=never"]),
                           cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert fresh.returncode != 0 and "holds a checkpoint of another job" in fresh.stderr, fresh.stderr
    assert "Traceback" not in fresh.stdout + fresh.stderr
    assert {p: p.stat().st_mtime_ns for p in checkpoints.rglob("*")} == before
