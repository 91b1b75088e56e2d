"""Nodes with several workers: one worker of a 2-worker node crashes while its agent and its
sibling live. The node is one failure: its agent stops the sibling (torch's agent stops a
node's workers when one fails), leaves, and the survivors recover in memory with the weights
of a failure-free run."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
from jobs import SCRIPT, STEPS, assert_matches, job_args, node_worker, records, run_processes


def test_one_worker_of_a_two_worker_node_crashing_is_one_node_failure(tmp_path, failure_free):
    launcher = subprocess.Popen(
        [sys.executable, "-m", "oobleck_elastic.launch", "--oobleck-local-nodes=3", "--nproc-per-node=2",
         f"--oobleck-log-dir={tmp_path / 'logs'}", "--rdzv-id=twoworkers", SCRIPT, *job_args(tmp_path, "job")],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        metrics = tmp_path / "job/metrics.jsonl"
        deadline = time.monotonic() + 200
        while not (metrics.exists() and '"step": 1' in metrics.read_text()):
            assert time.monotonic() < deadline and launcher.poll() is None, "the job never got going"
            time.sleep(0.1)
        crashed = node_worker("twoworkers", 1, 1)
        sibling = node_worker("twoworkers", 1, 0)
        crashed.kill()
        out, _ = launcher.communicate(timeout=300)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, out
    assert not sibling.is_running() or sibling.status() == psutil.STATUS_ZOMBIE, "the sibling left with its node"
    log = records(tmp_path / "job/metrics.jsonl")
    recoveries = [r for r in log if r.get("event") == "recovery"]
    assert [r["lost"] for r in recoveries] == [[1]] and recoveries[0]["restored_from"] is None, recoveries
    assert [r["step"] for r in log if "step" in r and "event" not in r] == list(range(STEPS)), "each step once"
    assert_matches([r for r in log if r.get("event") == "final"][0], failure_free)
    assert not run_processes("twoworkers"), "no worker outlives the job"
