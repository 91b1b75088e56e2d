"""Store faults under a running job: etcd restarted with its data for less than the
lease is ridden out with exact weights; etcd gone for good ends the job with a line naming it,
within the configured timeouts, and leaves no process behind (Note: [etcd outages])."""

from __future__ import annotations

import subprocess
import sys
import time

from etcd_server import etcd_process
from jobs import SCRIPT, STEPS, assert_matches, job_args, records, run_processes

# The blip (2 s down, then etcd's own start) must be shorter than the collective timeout too:
# workers read a step's decision from etcd one by one, so an outage can catch some of them
# past the read, in the next step's collectives, waiting on peers still blocked in etcd; a
# collective timeout shorter than the outage then fails the step and costs a recovery (exact,
# but not the ride-out this test checks; Note: [etcd outages]).
TIMEOUTS = ["--set", "elastic.collective_timeout_s=4.5", "--set", "elastic.lease_timeout_s=6",
            "--set", "elastic.agreement_timeout_s=30"]


def start(tmp_path, port: int, run_id: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "oobleck_elastic.launch", "--oobleck-local-nodes=3",
                             "--nproc-per-node=1", f"--oobleck-log-dir={tmp_path / 'logs'}", "--rdzv-conf=store=etcd",
                             f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={run_id}", SCRIPT,
                             *job_args(tmp_path, "job"), "--set", "planner.memory_per_worker=1GB", *TIMEOUTS],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for_step(tmp_path, proc, step: int) -> None:
    metrics = tmp_path / "job/metrics.jsonl"
    deadline = time.monotonic() + 200
    while not (metrics.exists() and f'"step": {step},' in metrics.read_text()):
        assert time.monotonic() < deadline and proc.poll() is None, "the job never got going"
        time.sleep(0.1)


def test_an_etcd_restart_shorter_than_the_lease_is_ridden_out_exactly(tmp_path, failure_free):
    with etcd_process() as server:
        proc = start(tmp_path, server.port, "etcdblip")
        try:
            wait_for_step(tmp_path, proc, 1)
            server.stop()
            time.sleep(2.0)
            server.start()
            out, _ = proc.communicate(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, out[-3000:]
    log = records(tmp_path / "job/metrics.jsonl")
    assert not [r for r in log if r.get("event") == "recovery"], "no node was taken for dead"
    steps = [r for r in log if "step" in r and "event" not in r]
    assert [r["step"] for r in steps] == list(range(STEPS))
    assert max(b["time"] - a["time"] for a, b in zip(steps, steps[1:])) > 1.5, "the outage fell within the run"
    assert_matches(log[-1], failure_free)


def test_etcd_gone_for_good_ends_the_job_with_a_line_naming_it(tmp_path):
    with etcd_process() as server:
        proc = start(tmp_path, server.port, "etcdgone")
        try:
            wait_for_step(tmp_path, proc, 0)
            server.stop()
            out, _ = proc.communicate(timeout=200)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode != 0
    assert f"etcd at 127.0.0.1:{server.port} is unreachable (for" in out, out[-3000:]
    time.sleep(1.0)
    assert not run_processes("etcdgone"), "no worker outlives the job"
