"""A local job on etcd with TLS and client certificates: `--rdzv-conf
etcd_cacert=...,etcd_cert=...,etcd_key=...` reaches every client (agents, the launcher, the
workers, torch's c10d store for process groups), and the job recovers from a kill exactly (the
clients on their own: tests/store/test_etcd_tls.py). `tls` is the root conftest's."""

from __future__ import annotations

import subprocess
import sys

from etcd_server import etcd_process
from jobs import SCRIPT, assert_matches, job_args, records


def test_a_local_job_on_etcd_with_tls_recovers_exactly(tmp_path, tls, failure_free):
    import os

    env = {**os.environ, "OOBLECK_FAULT": "node=1,step=2,phase=backward"}
    conf = f"store=etcd,etcd_cacert={tls['ca']},etcd_cert={tls['client_cert']},etcd_key={tls['client_key']}"
    with etcd_process(tls=tls) as server:
        proc = subprocess.run([sys.executable, "-m", "oobleck_elastic.launch", "--oobleck-local-nodes=3",
                               "--nproc-per-node=1", f"--oobleck-log-dir={tmp_path / 'logs'}", f"--rdzv-conf={conf}",
                               f"--rdzv-endpoint=127.0.0.1:{server.port}", "--rdzv-id=tlsjob", SCRIPT,
                               *job_args(tmp_path, "job"), "--set", "planner.memory_per_worker=1GB"],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "lost node(s) [1] at step 3" in proc.stdout
    assert_matches(records(tmp_path / "job/metrics.jsonl")[-1], failure_free)
