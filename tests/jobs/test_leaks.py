"""Leaks over many generations: a run whose step fails once on one node 50 times
(action=glitch) goes through 50 recoveries on the same nodes (their exactness is
test_recovery's); the workers' file
descriptors, threads and resident memory, sampled from outside, stay within stated bounds, and
no process outlives the job."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import psutil
from jobs import SCRIPT, job_args, records, run_processes

from oobleck_elastic.elastic.process import worker_identity

GENERATIONS = 50
BOUNDS = {"fds": 4, "threads": 2, "rss_mb": 32.0}  # growth of the peaks from generations 5-15 to the last 10


def sample(run_id: str) -> dict[str, dict[str, float]]:
    out = {}
    for proc in run_processes(run_id, workers=True):
        try:
            with proc.oneshot():
                out[str(worker_identity(proc)[0])] = {
                    "fds": proc.num_fds(), "threads": proc.num_threads(), "rss_mb": proc.memory_info().rss / 2**20}
        except (psutil.NoSuchProcess, psutil.AccessDenied, TypeError):
            continue
    return out


def test_fifty_generations_leak_no_descriptors_threads_or_memory(tmp_path):
    steps = GENERATIONS + 2
    faults = ";".join(f"node=1,step={k},phase=forward,action=glitch" for k in range(GENERATIONS))
    env = {**os.environ, "OOBLECK_FAULT": faults}
    args = [*job_args(tmp_path, "job"), "--set", "planner.memory_per_worker=1GB", "--set", f"train.steps={steps}"]
    launcher = subprocess.Popen([sys.executable, "-m", "oobleck_elastic.launch", "--oobleck-local-nodes=2",
                                 "--nproc-per-node=1", f"--oobleck-log-dir={tmp_path / 'logs'}", "--rdzv-id=leaks",
                                 SCRIPT, *args], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    samples: list[tuple[int, dict]] = []  # (generation, usage by node)
    metrics = tmp_path / "job/metrics.jsonl"
    try:
        while launcher.poll() is None:
            lines = metrics.read_text().splitlines() if metrics.exists() else []
            steps_done = [json.loads(line) for line in lines[-5:] if '"event"' not in line]
            usage = sample("leaks")
            if steps_done and usage:
                samples.append((steps_done[-1]["generation"], usage))
            time.sleep(0.3)
        out = launcher.stdout.read()
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, out[-3000:]
    log = records(metrics)
    assert len([r for r in log if r.get("event") == "recovery"]) == GENERATIONS
    assert [r["step"] for r in log if "step" in r and "event" not in r] == list(range(steps)), "each step once"
    # peaks, so that a sample taken while a generation was torn down (its sockets and threads
    # gone, the next one's not yet there) does not pass for a level
    def peak(lo: int, hi: int) -> dict[str, dict[str, float]]:
        window = [u for g, u in samples if lo <= g <= hi]
        return {node: {k: max(u[node][k] for u in window if node in u) for k in BOUNDS}
                for node in set().union(*window)}

    assert samples and samples[-1][0] >= GENERATIONS - 2, samples[-1:]
    early, late = peak(5, 15), peak(GENERATIONS - 10, GENERATIONS)
    growth = {node: {k: round(late[node][k] - early[node][k], 1) for k in BOUNDS} for node in early if node in late}
    print(f"peaks over generations 5-15 -> {GENERATIONS - 10}-{GENERATIONS}:",
          json.dumps({n: {k: (round(early[n][k], 1), round(late[n][k], 1)) for k in BOUNDS} for n in growth}))
    assert len(growth) == 2, growth
    for node, grew in growth.items():
        for key, bound in BOUNDS.items():
            assert grew[key] <= bound, f"node {node}: {key} grew by {grew[key]} over {GENERATIONS} generations"
    time.sleep(1.0)
    assert not run_processes("leaks"), "no worker outlives the job"
