"""The launcher end to end: a local multi-node job through torch's agent, its metrics and
TensorBoard output, equality with the single-process reference, and early config errors."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jobs
import psutil
import pytest
from etcd_server import etcd_server

from oobleck_elastic.elastic.protocol import RECORDS
from oobleck_elastic.elastic.stores import connect_store

ROOT = pathlib.Path(__file__).resolve().parents[2]


def job_args(tmp_path, name, *extra):
    return ["--config", str(ROOT / "examples/gpt/config.yaml"), "--set", "train.steps=4",
            "--set", "train.dtype=float64", "--set", "planner.memory_per_worker=1GB",
            "--set", f"planner.profile_dir={tmp_path / 'profiles'}",
            "--set", f"monitoring.metrics_path={tmp_path / name / 'metrics.jsonl'}",
            "--set", f"monitoring.tensorboard_dir={tmp_path / name / 'tb'}",
            "--set", f"checkpoint.dir={tmp_path / name / 'checkpoints'}", *extra]


def records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def our_processes(marker: str):
    return [p for p in psutil.process_iter(["cmdline"]) if marker in " ".join(p.info["cmdline"] or [])]


def test_local_job_trains_reports_and_matches_reference(tmp_path):
    """The way a user runs it: without the tier's warm node starter (tests/jobs/conftest.py)."""
    script = str(ROOT / "examples/gpt/train.py")
    cold = {k: v for k, v in os.environ.items() if k != "OOBLECK_NODE_STARTER"}
    proc = subprocess.run([sys.executable, "-m", "oobleck_elastic.launch", "--oobleck-local-nodes", "3",
                           "--nproc-per-node", "1", "--oobleck-log-dir", str(tmp_path / "logs"),
                           "--rdzv-id", "launchtest", script, *job_args(tmp_path, "job")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300, env=cold)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "step     4/4" in proc.stdout and "tensorboard --logdir" in proc.stdout
    assert "Warning" not in proc.stderr, proc.stderr  # what a user sees of a clean run: no noise
    log = records(tmp_path / "job/metrics.jsonl")
    gen = [r for r in log if r.get("event") == "generation"]
    steps = [r for r in log if "step" in r and "event" not in r]
    final = [r for r in log if r.get("event") == "final"]
    assert len(gen) == 1 and gen[0]["nodes"] == [0, 1, 2] and len(gen[0]["pipelines"]) >= 2
    assert [r["step"] for r in steps] == [0, 1, 2, 3]
    assert all(r["samples"] == 64 and sum(r["pipelines"]) == 16 for r in steps)
    assert len(final) == 1 and len(final[0]["param_sums"]) == 8
    assert list((tmp_path / "job/tb").glob("events.out.tfevents.*"))
    assert (tmp_path / "job/tb/layout_generation_0.png").read_bytes().startswith(b"\x89PNG")
    assert (tmp_path / "job/tb/throughput.png").read_bytes().startswith(b"\x89PNG")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "job/tb")).Reload()
    assert {"layout/generation_0", "throughput"} <= set(events.Tags()["images"])
    assert events.Images("layout/generation_0")[0].encoded_image_string.startswith(b"\x89PNG")
    assert not our_processes("--rdzv-id=launchtest"), "no node agent or worker outlives the launcher"

    alone = subprocess.run([sys.executable, script, *job_args(tmp_path, "ref")], cwd=tmp_path,
                           capture_output=True, text=True, timeout=300)
    assert alone.returncode == 0, alone.stderr
    ref = records(tmp_path / "ref/metrics.jsonl")[-1]
    for ours, theirs in zip(final[0]["param_sums"] + final[0]["param_norms"], ref["param_sums"] + ref["param_norms"]):
        assert ours == pytest.approx(theirs, rel=1e-9, abs=1e-12)


def test_bad_config_fails_before_any_worker_starts(tmp_path):
    """Refused before any node starts; the node starter spawned before the flags were read is
    gone with the launcher."""
    proc = subprocess.run([sys.executable, "-m", "oobleck_elastic.launch", "--oobleck-local-nodes", "2",
                           "--rdzv-id=badconfig", "--oobleck-log-dir", str(tmp_path / "logs"),
                           str(ROOT / "examples/gpt/train.py"),
                           "--config", str(ROOT / "examples/gpt/config.yaml"), "--set", "train.microbatch_size=5"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "error: train.global_batch_size (64) must be a multiple of train.microbatch_size (5)" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "logs").exists(), "no node was started"
    assert not jobs.run_processes("badconfig"), "the node starter outlived the launcher"


def test_two_local_jobs_on_one_etcd_recover_apart_match_the_reference_and_leave_only_their_records(
        tmp_path, failure_free):
    """Jobs `etcdjob` (node 1 killed) and `other` (no failure) at once on one etcd;
    each trains exactly, and all either leaves in etcd is its records (Note: [store keys])."""
    def start(run_id, fault):
        env = {**os.environ, "OOBLECK_FAULT": fault} if fault else dict(os.environ)
        return subprocess.Popen(
            [sys.executable, "-m", "oobleck_elastic.launch", "--oobleck-local-nodes=3", "--nproc-per-node=1",
             f"--oobleck-log-dir={tmp_path / run_id / 'logs'}", "--rdzv-conf=store=etcd",
             f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={run_id}", jobs.SCRIPT,
             *jobs.job_args(tmp_path, run_id), "--set", "planner.memory_per_worker=1GB"],
            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    with etcd_server() as port:
        procs = {"etcdjob": start("etcdjob", "node=1,step=2,phase=backward"), "other": start("other", None)}
        try:
            out = {run_id: proc.communicate(timeout=300)[0] for run_id, proc in procs.items()}
        finally:
            for proc in procs.values():
                proc.kill()
        left = {run_id: connect_store(f"etcd://127.0.0.1:{port}", run_id).keys() for run_id in procs}
    for run_id, proc in procs.items():
        assert proc.returncode == 0, out[run_id]
        log = records(tmp_path / run_id / "metrics.jsonl")
        assert [r["step"] for r in log if "step" in r and "event" not in r] == list(range(jobs.STEPS))
        jobs.assert_matches(log[-1], failure_free)
        assert not our_processes(f"--rdzv-id={run_id}")
        assert [k for k in left[run_id] if not RECORDS.fullmatch(k)] == [], f"{run_id} left working keys"
        assert {"done", "generation", "generation/0", "nodes/0", "nodes/2/left"} <= set(left[run_id])
    assert f"store etcd://127.0.0.1:{port}" in out["etcdjob"] and "lost node(s) [1] at step 3" in out["etcdjob"]
    assert "lost node" not in out["other"]
    assert "generation/1" in left["etcdjob"] and "generation/1" not in left["other"]


def test_unknown_store_fails_before_any_node_starts(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "oobleck_elastic.launch", "--oobleck-local-nodes", "2",
                           "--rdzv-conf=store=zookeeper", "--oobleck-log-dir", str(tmp_path / "logs"),
                           str(ROOT / "examples/gpt/train.py")], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert "error: --rdzv-conf store=zookeeper is not a membership store; use one of embedded, etcd" in proc.stderr
    assert not (tmp_path / "logs").exists()
