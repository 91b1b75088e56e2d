"""Stock torchrun with `--rdzv-backend=oobleck` (the handler on its own:
tests/store/test_torchrun_store.py): a job on the embedded store trains exactly like one process,
and a job on a real etcd server loses node 0 to a SIGKILL, or a joiner as the generation
admitting it is built, and finishes with the weights of a failure-free run (no launcher of ours
marks the node dead: its lease does)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import psutil
from etcd_server import etcd_server
from jobs import ROOT, SCRIPT, STEPS, assert_matches, job_args, node_worker, records

from oobleck_elastic.runtime.checkpoint import read_manifest

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]  # what the `torchrun` script runs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(tmp_path, nodes: int, endpoint: str, conf: list[str], fault: str = "",
                 extra: tuple[str, ...] = (), during=None, entry: tuple[str, ...] = (SCRIPT,),
                 nnodes: str | None = None) -> list[subprocess.Popen]:
    """`nodes` torchrun processes (each its own session, so a fault kills one node) running
    `entry`, waited for; `during(procs)`, if given, runs while they do. `nnodes`: torchrun's
    `--nnodes` (default `nodes`); with MIN:MAX the nodes past MIN join the running job."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OOBLECK_FAULT": fault, "PYTHONPATH": str(ROOT)}
    procs = []
    for node in range(nodes):
        with open(tmp_path / f"torchrun{node}.log", "w") as log:
            procs.append(subprocess.Popen(
                [*TORCHRUN, f"--nnodes={nnodes or nodes}", "--nproc-per-node=1", "--rdzv-backend=oobleck",
                 f"--rdzv-endpoint={endpoint}", "--rdzv-id=torchruntest", "--monitor-interval=0.1", *conf,
                 *entry, *job_args(tmp_path, "job"), "--set", "planner.memory_per_worker=1GB", *extra],
                cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    deadline = time.monotonic() + 300
    try:
        if during:
            during(procs)
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    leftovers = [p for p in psutil.process_iter(["cmdline"])
                 if "--rdzv-id=torchruntest" in " ".join(p.info["cmdline"] or [])]
    assert not leftovers, "no agent or worker outlives its torchrun"
    return procs


def logs(tmp_path, nodes: int) -> str:
    return "\n".join((tmp_path / f"torchrun{n}.log").read_text()[-3000:] for n in range(nodes))


def wait_for_step_one(tmp_path, procs: list[subprocess.Popen]) -> None:
    """Polls the job's metrics log until step 1 is logged, while every torchrun lives."""
    metrics = tmp_path / "job/metrics.jsonl"
    deadline = time.monotonic() + 200
    while not (metrics.exists() and '"step": 1' in metrics.read_text()):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), logs(tmp_path, len(procs))
        time.sleep(0.1)


def test_stock_torchrun_on_the_embedded_store_trains_like_one_process(tmp_path, failure_free):
    # the package's own entry point, the model named by model.factory
    procs = run_torchrun(tmp_path, 2, f"127.0.0.1:{free_port()}", [], entry=("-m", "oobleck_elastic.train"),
                         extra=("--set", "model.factory=examples.gpt.model:job"))
    assert [p.returncode for p in procs] == [0, 0], logs(tmp_path, 2)
    log = records(tmp_path / "job/metrics.jsonl")
    assert [r["nodes"] for r in log if r.get("event") == "generation"] == [[0, 1]]
    steps = [r for r in log if "step" in r and "event" not in r]
    assert [r["step"] for r in steps] == list(range(STEPS)) and all(r["samples"] == 64 for r in steps)
    assert_matches(log[-1], failure_free)


def test_stock_torchrun_on_etcd_survives_losing_node_0(tmp_path, failure_free):
    # Node 0 is the lowest node (the first proposer) and registered first; with etcd no node
    # hosts the membership. The survivors learn of the death from gloo and from its lease.
    timeouts = ("--set", "elastic.collective_timeout_s=2", "--set", "elastic.lease_timeout_s=3",
                "--set", "elastic.agreement_timeout_s=10")
    with etcd_server() as port:
        procs = run_torchrun(tmp_path, 3, f"127.0.0.1:{port}", ["--rdzv-conf=store=etcd"],
                             fault="node=0,step=2,phase=backward", extra=timeouts)
    assert sorted(p.returncode for p in procs) == [-9, 0, 0], logs(tmp_path, 3)
    log = records(tmp_path / "job/metrics.jsonl")
    recovery = [r for r in log if r.get("event") == "recovery"]
    assert len(recovery) == 1 and recovery[0]["lost"] == [0] and recovery[0]["step"] == 2
    steps = [r for r in log if "step" in r and "event" not in r]
    assert [r["step"] for r in steps] == list(range(STEPS)), "each step logged exactly once"
    assert all(r["samples"] == 64 for r in steps)
    assert_matches(log[-1], failure_free)


def test_a_joiner_killed_while_its_generation_bootstraps_is_a_failed_build(tmp_path, failure_free_40, monkeypatch):
    """Under --nnodes=2:3 the third node to register (node 2) joins the running job, and is
    SIGKILLed while the generation admitting it bootstraps: its default group made, its
    subgroups not. The members wait in torch's etcd-backed c10d store for subgroup keys the
    joiner never writes and get `LookupError: Timeout while waiting for keys in EtcdStore`: a
    failed build, recovered like any (Note: [failed build]; it used to end every member's
    worker, and so the job, with nobody left to recover). The run goes on without node 2,
    exactly."""
    steps = 40  # long enough for the joiner to get ready and be admitted before the end
    # when it is admitted is not known in advance: a fault at every step's bootstrap fires at its first
    fault = ";".join(f"node=2,step={k},phase=bootstrap" for k in range(steps))
    kills = tmp_path / "kills.jsonl"
    monkeypatch.setenv("OOBLECK_FAULT_LOG", str(kills))
    timeouts = ("--set", "elastic.collective_timeout_s=2", "--set", "elastic.lease_timeout_s=3",
                "--set", "elastic.agreement_timeout_s=10")
    with etcd_server() as port:
        procs = run_torchrun(tmp_path, 3, f"127.0.0.1:{port}", ["--rdzv-conf=store=etcd"], fault=fault,
                             extra=("--set", f"train.steps={steps}", *timeouts), nnodes="2:3")
    assert sorted(p.returncode for p in procs) == [-9, 0, 0], logs(tmp_path, 3)
    assert [(k["node"], k["phase"]) for k in records(kills)] == [(2, "bootstrap")], "the joiner died building"
    log = records(tmp_path / "job/metrics.jsonl")
    causes = [r["cause"] for r in log if r.get("event") == "recovery"]
    assert any("LookupError while building generation" in c for c in causes), causes
    assert [r["nodes"] for r in log if r.get("event") == "generation"][-1] == [0, 1]
    assert [r["step"] for r in log if "step" in r and "event" not in r] == list(range(steps))
    assert_matches(log[-1], failure_free_40)


def test_a_worker_torch_restarts_comes_back_as_a_new_node(tmp_path, failure_free_40):
    # One worker of node 2 dies (its agent lives): torch's agent restarts the node's workers;
    # the handler marks node 2 dead at once and registers the node again as node 3, which
    # joins the run; the others are not restarted and the weights are the reference's.
    steps = 40  # long enough for the restarted worker to get ready and be admitted (as failure_free_40)

    def kill_a_worker_of_node_2(procs) -> None:
        wait_for_step_one(tmp_path, procs)
        node_worker("torchruntest", 2).kill()

    procs = run_torchrun(tmp_path, 3, f"127.0.0.1:{free_port()}", ["--max-restarts=1"],
                         extra=("--set", f"train.steps={steps}"), during=kill_a_worker_of_node_2)
    assert [p.returncode for p in procs] == [0, 0, 0], logs(tmp_path, 3)
    assert "node 2] workers restarted: rejoining the run as a new node" in logs(tmp_path, 3)
    log = records(tmp_path / "job/metrics.jsonl")
    recovery = [r for r in log if r.get("event") == "recovery"]
    assert [(r["lost"], r["joined"]) for r in recovery] == [([2], []), ([], [3])], recovery
    assert [r["step"] for r in log if "step" in r and "event" not in r] == list(range(steps))
    assert_matches(log[-1], failure_free_40)


def test_sigterm_to_a_stock_torchrun_stops_the_job_after_its_step_with_a_checkpoint(tmp_path):
    """What a scheduler does before preemption, under stock torchrun: torch's agent forwards the
    SIGTERM to its workers, which ask the run to stop; every node finishes the step and the
    final checkpoint is written (Note: [stop on request])."""
    def stop_node_1(procs) -> None:
        wait_for_step_one(tmp_path, procs)
        procs[1].send_signal(signal.SIGTERM)

    with etcd_server() as port:
        procs = run_torchrun(tmp_path, 2, f"127.0.0.1:{port}", ["--rdzv-conf=store=etcd"],
                             extra=("--set", "train.steps=200"), during=stop_node_1)
    log = records(tmp_path / "job/metrics.jsonl")
    (stopped,) = [r for r in log if r.get("event") == "stopped"]
    at = stopped["steps"]
    assert 2 <= at < 200, at
    assert [r["step"] for r in log if "step" in r and "event" not in r] == list(range(at))
    assert procs[0].returncode == 0, logs(tmp_path, 2)
    assert procs[1].returncode != 0  # torch's agent ends by re-raising the signal it was sent
    assert read_manifest(str(tmp_path / "job/checkpoints"), at)["step"] == at
    assert not [r for r in log if r.get("event") == "recovery"], "the stopped node was not taken for dead"
