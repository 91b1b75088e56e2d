"""In-place recovery with real processes and real SIGKILLs: a node of a local job is killed at
a named phase of a step; the survivors agree on a new generation, re-instantiate pipelines,
copy the missing layers, replay the step, and end with the weights of a failure-free run."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

import psutil
import pytest
from jobs import SCRIPT, STEPS, assert_matches, job_args, node_agent, node_worker, records, run_processes

from oobleck_elastic.runtime.checkpoint import checkpoints


def wait_for_step_one(tmp_path, proc: subprocess.Popen, timeout: float = 200) -> None:
    """Polls the job's metrics log until step 1 is logged (the job is under way)."""
    metrics = tmp_path / "job/metrics.jsonl"
    deadline = time.monotonic() + timeout
    while not (metrics.exists() and '"step": 1' in metrics.read_text()):
        assert time.monotonic() < deadline and proc.poll() is None, "the job never got going"
        time.sleep(0.2)


def start_job(tmp_path, nodes: int, run_id: str, extra: list[str], env=None) -> subprocess.Popen:
    """The example job on `nodes` local nodes, running in the background (output in a pipe)."""
    return subprocess.Popen([sys.executable, "-m", "oobleck_elastic.launch", f"--oobleck-local-nodes={nodes}",
                             "--nproc-per-node=1", f"--oobleck-log-dir={tmp_path / 'logs'}", f"--rdzv-id={run_id}",
                             SCRIPT, *job_args(tmp_path, "job"), *extra], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def run_with_faults(tmp_path, nodes: int, fault: str):
    env = {**os.environ, "OOBLECK_FAULT": fault}
    proc = subprocess.run([sys.executable, "-m", "oobleck_elastic.launch", f"--oobleck-local-nodes={nodes}",
                           "--nproc-per-node=1", f"--oobleck-log-dir={tmp_path / 'logs'}", SCRIPT,
                           *job_args(tmp_path, "job")], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout, records(tmp_path / "job/metrics.jsonl")


@pytest.mark.parametrize("faults", [
    # (node, step, phase): two kills in one run where the layout allows (5 nodes, f = 1)
    [(1, 1, "forward"), (3, 3, "grad_sync")],
    [(1, 1, "backward"), (3, 3, "optimizer")],
    [(1, 3, "commit")],
])
def test_kill_a_node_at_each_phase(tmp_path, failure_free, faults):
    spec = ";".join(f"node={n},step={k},phase={p}" for n, k, p in faults)
    stdout, log = run_with_faults(tmp_path, 5, spec)
    recoveries = [r for r in log if r.get("event") == "recovery"]
    # before the commit the step is replayed; after it (optimizer) survivors finished it
    assert [(r["lost"], r["step"]) for r in recoveries] == [
        ([n], k + 1 if p == "optimizer" else k) for n, k, p in faults]
    for r in recoveries:  # every phase timed, detection from the kill the injector recorded
        assert set(r["phases_s"]) == {"detect", "teardown", "agree", "reinit", "transfer", "rebuild", "replay"}
        assert all(0 <= v < 60 for v in r["phases_s"].values()), r["phases_s"]
    steps = [r for r in log if "step" in r and "event" not in r]
    assert [r["step"] for r in steps] == list(range(STEPS)), "each step logged exactly once"
    assert all(r["samples"] == 64 for r in steps), "every sample of every step counted once"
    assert steps[-1]["nodes"] == 5 - len(faults) and steps[-1]["generation"] == len(faults)
    assert f"reconfigured -> generation 1: lost node(s) [{faults[0][0]}]" in stdout
    assert_matches([r for r in log if r.get("event") == "final"][0], failure_free)


def test_two_simultaneous_kills_with_f2(tmp_path, failure_free):
    fault = "node=1,step=3,phase=backward;node=3,step=3,phase=backward"
    args_f2 = ["--set", "fault_tolerance=2"]
    env = {**os.environ, "OOBLECK_FAULT": fault}
    proc = subprocess.run([sys.executable, "-m", "oobleck_elastic.launch", "--oobleck-local-nodes=6",
                           "--nproc-per-node=1", f"--oobleck-log-dir={tmp_path / 'logs'}", SCRIPT,
                           *job_args(tmp_path, "job"), *args_f2], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    log = records(tmp_path / "job/metrics.jsonl")
    first = [r for r in log if r.get("event") == "generation"][0]
    assert len(first["pipelines"]) == 3
    recoveries = [r for r in log if r.get("event") == "recovery"]
    assert [sorted(r["lost"]) for r in recoveries] == [[1, 3]]
    steps = [r for r in log if "step" in r and "event" not in r]
    assert [r["step"] for r in steps] == list(range(STEPS))
    assert_matches([r for r in log if r.get("event") == "final"][0], failure_free)


@pytest.mark.parametrize("fault, lost", [
    ("node=1,step=2,phase=backward;node=0,step=2,phase=agreement", [0, 1]),  # the lowest node: the old proposer
])  # kills during the transfer: test_a_second_kill_in_each_window_of_a_recovery
def test_second_kill_during_recovery(tmp_path, failure_free, fault, lost):
    _, log = run_with_faults(tmp_path, 5, fault)
    recoveries = [r for r in log if r.get("event") == "recovery"]
    assert sorted(n for r in recoveries for n in r["lost"]) == lost
    steps = [r for r in log if "step" in r and "event" not in r]
    assert [r["step"] for r in steps] == list(range(STEPS))
    assert_matches([r for r in log if r.get("event") == "final"][0], failure_free)


def test_sigstopped_node_is_detected_by_its_lease(tmp_path, failure_free):
    timeouts = ["--set", "elastic.collective_timeout_s=2", "--set", "elastic.lease_timeout_s=3",
                "--set", "elastic.agreement_timeout_s=30"]
    launcher = start_job(tmp_path, 5, "stoptest", timeouts)
    stopped = []
    try:
        wait_for_step_one(tmp_path, launcher)
        worker = node_worker("stoptest", 1)
        for proc in (node_agent("stoptest", 1), worker):  # the whole node: agent (its lease stops) and worker
            proc.suspend()
            stopped.append(proc)
        out, _ = launcher.communicate(timeout=300)
    finally:
        for proc in stopped:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, out
    log = records(tmp_path / "job/metrics.jsonl")
    assert [r["lost"] for r in log if r.get("event") == "recovery"] == [[1]]
    assert_matches([r for r in log if r.get("event") == "final"][0], failure_free)


def test_a_hung_node_is_cut_out_by_its_silence_and_fences_itself_when_woken(tmp_path, failure_free_40):
    """A whole node stopped for 3 s (agent and worker: no socket closes, the lease stands still)
    under the default timeouts: the survivors' peer watches cut the generation once its lease
    has stood still for the roll-call window (0.6 s), instead of waiting in gloo for the 10 s
    collective timeout; woken while the others still train (40 steps), the node sees the next
    generation was chosen without it and fences itself at once. Exact, nothing left running."""
    env = {**os.environ, "OOBLECK_FAULT": "node=1,step=2,phase=forward,action=hang,seconds=3"}
    proc = subprocess.run([sys.executable, "-m", "oobleck_elastic.launch", "--oobleck-local-nodes=5",
                           "--nproc-per-node=1", f"--oobleck-log-dir={tmp_path / 'logs'}", "--rdzv-id=hangtest",
                           SCRIPT, *job_args(tmp_path, "job"), "--set", "train.steps=40"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    log = records(tmp_path / "job/metrics.jsonl")
    assert [r["lost"] for r in log if r.get("event") == "recovery"] == [[1]]
    assert_matches([r for r in log if r.get("event") == "final"][0], failure_free_40)
    nodes = "".join(p.read_text() for p in (tmp_path / "logs").glob("node*.log"))
    assert "node(s) [1] went silent" in nodes and "connections were cut" in nodes, nodes[-3000:]
    # woken after the others chose generation 1 without it (or, on a slow machine, during their
    # roll call): it is fenced before it writes anything for generation 0
    assert "node 1 fenced: generation 1 was chosen without it" in nodes or \
        "node 1 fenced: the roll call of generation 0 left it out" in nodes, nodes[-3000:]
    deadline = time.monotonic() + 30
    while run_processes("hangtest") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert run_processes("hangtest") == []


def test_node_joins_mid_run_after_a_failure(tmp_path, failure_free_40):
    steps = ["--set", "train.steps=40"]
    env = {**os.environ, "OOBLECK_FAULT": "node=1,step=2,phase=backward"}
    proc = subprocess.run([sys.executable, "-m", "oobleck_elastic.launch", "--oobleck-local-nodes=4",
                           "--nproc-per-node=1", "--oobleck-add-node-at-step=3",
                           f"--oobleck-log-dir={tmp_path / 'logs'}", SCRIPT, *job_args(tmp_path, "job"), *steps],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    log = records(tmp_path / "job/metrics.jsonl")
    changes = [(r["lost"], r["joined"]) for r in log if r.get("event") == "recovery"]
    assert changes == [([1], []), ([], [4])]
    step_records = [r for r in log if "step" in r and "event" not in r]
    assert [r["step"] for r in step_records] == list(range(40))
    assert step_records[-1]["num_pipelines"] == 2 and step_records[-1]["nodes"] == 4
    assert min(r["num_pipelines"] for r in step_records) == 1  # one pipeline while node 0 was spare
    assert_matches([r for r in log if r.get("event") == "final"][0], failure_free_40)


# After node 1 dies at step 3, generation 1 re-instantiates its pipeline on survivors, which
# receive the layers node 1 held from the other pipeline (the recovery record's `copies`). Which
# nodes send and receive depends on the measured profile, so a second fault is armed on every
# other node and fires on those that reach its window.
@pytest.mark.parametrize("phase, restored", [
    ("transfer_receive", None),  # the receivers die mid-transfer: the other pipeline holds every layer
    ("bootstrap", None),  # every survivor, while generation 1 makes its process groups
    ("transfer_send", 2),  # the senders die mid-transfer: they held the only other copies
])
def test_a_second_kill_in_each_window_of_a_recovery(tmp_path, failure_free, phase, restored):
    second = ";".join(f"node={n},step=3,phase={phase}" for n in ((2,) if phase == "bootstrap" else (0, 2, 3, 4)))
    env = {**os.environ, "OOBLECK_FAULT": f"node=1,step=3,phase=backward;{second}"}
    proc = subprocess.run([sys.executable, "-m", "oobleck_elastic.launch", "--oobleck-local-nodes=5",
                           "--nproc-per-node=1", f"--oobleck-log-dir={tmp_path / 'logs'}", SCRIPT,
                           *job_args(tmp_path, "job"), "--set", "checkpoint.interval=2",
                           "--set", f"checkpoint.dir={tmp_path / 'ckpt'}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    log = records(tmp_path / "job/metrics.jsonl")
    recoveries = [r for r in log if r.get("event") == "recovery"]
    lost = sorted(n for r in recoveries for n in r["lost"])
    assert 1 in lost and len(lost) >= 2, f"the second fault never fired: lost {lost}"
    restored_from = [r["restored_from"] for r in recoveries if r["restored_from"] is not None]
    assert restored_from == ([restored] if restored else [])
    steps = [r["step"] for r in log if "step" in r and "event" not in r]
    if restored is None:
        assert steps == list(range(STEPS)), "each step once"
    else:  # beyond f: the checkpoint after step 2, said so, and the steps after it again
        assert f"restored the checkpoint of step {restored}" in proc.stdout
        assert steps == [0, 1, 2, *range(restored, STEPS)]
    assert_matches([r for r in log if r.get("event") == "final"][0], failure_free)


def test_a_node_killed_while_a_checkpoint_is_written_leaves_it_unpublished_and_the_run_exact(tmp_path, failure_free):
    """Node 1 dies once it has written its layers of the checkpoint after step 4, before the
    checkpoint is published: the run recovers in memory, checkpoint 4 is never published
    (complete or ignored), and the final one is."""
    env = {**os.environ, "OOBLECK_FAULT": "node=1,step=4,phase=checkpoint"}
    extra = ["--set", "checkpoint.interval=2", "--set", f"checkpoint.dir={tmp_path / 'ckpt'}"]
    proc = subprocess.run([sys.executable, "-m", "oobleck_elastic.launch", "--oobleck-local-nodes=5",
                           "--nproc-per-node=1", f"--oobleck-log-dir={tmp_path / 'logs'}", SCRIPT,
                           *job_args(tmp_path, "job"), *extra], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    log = records(tmp_path / "job/metrics.jsonl")
    assert [r["lost"] for r in log if r.get("event") == "recovery"] == [[1]]
    assert [r["step"] for r in log if "step" in r and "event" not in r] == list(range(STEPS))
    assert sorted(step for step, _ in checkpoints(str(tmp_path / "ckpt"))) == [2, 6]
    assert_matches([r for r in log if r.get("event") == "final"][0], failure_free)


def run_checkpointed(tmp_path, interval: int):
    # nodes 1 and 3 die together, then node 4 while the checkpoint is being restored
    env = {**os.environ, "OOBLECK_FAULT": "node=1,step=3,phase=backward;node=3,step=3,phase=backward;"
                                          "node=4,step=3,phase=restore"}
    extra = ["--set", f"checkpoint.interval={interval}", "--set", f"checkpoint.dir={tmp_path / 'ckpt'}"]
    return subprocess.run([sys.executable, "-m", "oobleck_elastic.launch", "--oobleck-local-nodes=5",
                           "--nproc-per-node=1", f"--oobleck-log-dir={tmp_path / 'logs'}", SCRIPT,
                           *job_args(tmp_path, "job"), *extra], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=400)


def test_more_than_f_failures_fall_back_to_the_checkpoint(tmp_path, failure_free):
    # f = 1; nodes 1 and 3 sit in different pipelines, so some layers lose every replica. Node 4
    # dies while the restored generation is built, which has no in-memory base: the survivors
    # restore the checkpoint again instead of crashing.
    proc = run_checkpointed(tmp_path, interval=2)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "restored the checkpoint of step 2" in proc.stdout
    log = records(tmp_path / "job/metrics.jsonl")
    (recovery,) = [r for r in log if r.get("event") == "recovery"]
    assert recovery["restored_from"] == 2 and recovery["lost"] == [1, 3, 4]
    steps = [r["step"] for r in log if "step" in r and "event" not in r]
    assert steps == [0, 1, 2, 2, 3, 4, 5], "steps after the checkpoint run again"
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["step_00000002", "step_00000004", "step_00000006"]
    assert len(list((tmp_path / "ckpt/step_00000002").glob("layer_*/.metadata"))) == 8
    assert_matches([r for r in log if r.get("event") == "final"][0], failure_free)


def test_a_damaged_checkpoint_found_while_restoring_falls_back_to_the_one_before(tmp_path, failure_free):
    """Every node waits 6 s before step 3's commit while a byte of the published checkpoint of
    step 2 is flipped (same size: nothing but its checksum tells); then nodes 1 and 3 die, more
    than f. The fallback chooses step 2 from the manifests, a worker finds the damage as it
    loads its layer, the step is marked damaged and the next fallback starts the run again
    from its initial state, exactly (the read error crashed every
    survivor, and each survivor hashed the whole checkpoint before it could propose)."""
    slow = ";".join(f"node={n},step=3,phase=commit,action=slow,seconds=6" for n in range(5))
    env = {**os.environ, "OOBLECK_FAULT": f"{slow};node=1,step=3,phase=committed;node=3,step=3,phase=committed"}
    extra = ["--set", "checkpoint.interval=2", "--set", f"checkpoint.dir={tmp_path / 'ckpt'}"]
    launcher = subprocess.Popen([sys.executable, "-m", "oobleck_elastic.launch", "--oobleck-local-nodes=5",
                                 "--nproc-per-node=1", f"--oobleck-log-dir={tmp_path / 'logs'}", SCRIPT,
                                 *job_args(tmp_path, "job"), *extra], cwd=tmp_path, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 200
        while 2 not in dict(checkpoints(str(tmp_path / "ckpt"))):
            assert time.monotonic() < deadline and launcher.poll() is None, "step 2's checkpoint never appeared"
            time.sleep(0.1)
        path = tmp_path / "ckpt/step_00000002/layer_0005/__0_0.distcp"
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
        out, _ = launcher.communicate(timeout=300)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 0, out
    log = records(tmp_path / "job/metrics.jsonl")
    recoveries = [r for r in log if r.get("event") == "recovery"]
    assert [r["restored_from"] for r in recoveries][-1] == 0, recoveries
    steps = [r["step"] for r in log if "step" in r and "event" not in r]
    assert steps[-STEPS:] == list(range(STEPS)) and steps[:4] == [0, 1, 2, 3], steps
    found = [line for log_file in (tmp_path / "logs").glob("*.log") for line in log_file.read_text().splitlines()
             if "the checkpoint of step 2 did not load" in line]
    every = "\n".join(line for f in (tmp_path / "logs").glob("*.log") for line in f.read_text().splitlines()
                      if "WARN" in line or "ERROR" in line)
    assert found and "do not match their checksum" in found[0], every[-4000:]
    assert_matches([r for r in log if r.get("event") == "final"][0], failure_free)


def test_no_replica_before_the_first_checkpoint_starts_the_run_again_exactly(tmp_path, failure_free):
    """More than f nodes lost before any checkpoint: the initial state is rebuilt exactly on the
    survivors and the run goes on from step 0 (it used to end with an error)."""
    proc = run_checkpointed(tmp_path, interval=0)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no checkpoint yet: started the run again from its initial state (step 0)" in proc.stdout
    log = records(tmp_path / "job/metrics.jsonl")
    (recovery,) = [r for r in log if r.get("event") == "recovery"]
    assert recovery["restored_from"] == 0 and recovery["lost"] == [1, 3]
    assert [r["step"] for r in log if "step" in r and "event" not in r] == [0, 1, 2, 0, 1, 2, 3, 4, 5]
    assert_matches([r for r in log if r.get("event") == "final"][0], failure_free)
    assert sorted(step for step, _ in checkpoints(str(tmp_path / "ckpt"))) == [STEPS], "interval 0: the final one"


def test_workers_exit_when_their_agent_dies(tmp_path):
    """SIGKILL only node 2's agent: its worker must not live on as an orphan, and the rest of
    the job recovers."""
    launcher = subprocess.Popen([sys.executable, "-m", "oobleck_elastic.launch", "--oobleck-local-nodes=3",
                                 "--nproc-per-node=1", f"--oobleck-log-dir={tmp_path / 'logs'}", "--rdzv-id=orphan",
                                 SCRIPT, *job_args(tmp_path, "job"), "--set", "planner.memory_per_worker=1GB"],
                                cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_step_one(tmp_path, launcher)
        worker, agent = node_worker("orphan", 2), node_agent("orphan", 2)
        agent.kill()
        gone, alive = psutil.wait_procs([worker], timeout=10)
        assert not alive, "the worker outlived its agent"
        out, _ = launcher.communicate(timeout=300)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, out
    assert [r["lost"] for r in records(tmp_path / "job/metrics.jsonl") if r.get("event") == "recovery"] == [[2]]


def test_losing_the_embedded_store_host_fails_clearly(tmp_path):
    """Two nodes started by hand (no local launcher): the first agent hosts the store. Killing
    that node must end the other one with a clear message, not a hang."""
    port = free_port()
    base = [sys.executable, "-m", "oobleck_elastic.launch", "--nnodes=2", "--nproc-per-node=1",
            f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=hostloss", "--max-restarts=0", SCRIPT,
            *job_args(tmp_path, "job"), "--set", "planner.memory_per_worker=1GB", "--set", "fault_tolerance=0",
            "--set", "train.steps=200", "--set", "elastic.collective_timeout_s=5"]
    logs = [open(tmp_path / f"node{k}.log", "w") for k in range(2)]
    host = subprocess.Popen(base, cwd=tmp_path, stdout=logs[0], stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 60
    while not port_open(port):
        assert time.monotonic() < deadline and host.poll() is None, "the first node never hosted the store"
        time.sleep(0.1)
    other = subprocess.Popen(base, cwd=tmp_path, stdout=logs[1], stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for_step_one(tmp_path, other)
        worker = node_worker("hostloss", 0)
        os.killpg(host.pid, 9)
        worker.kill()  # the whole first node
        assert other.wait(timeout=120) != 0
    finally:
        for proc in (host, other):
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
        for log in logs:
            log.close()
    text = (tmp_path / "node1.log").read_text()
    assert "membership store at 127.0.0.1" in text and "is unreachable" in text, text[-3000:]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def published(tmp_path, step: int) -> dict:
    """The manifest of the job's published checkpoint of `step` (fails when there is none)."""
    found = dict(checkpoints(str(tmp_path / "job/checkpoints")))
    assert step in found, f"no checkpoint of step {step} was published (steps: {sorted(found)})"
    return found[step]


def test_a_kill_in_the_last_steps_optimizer_phase_still_ends_the_run(tmp_path, failure_free):
    """The final weight summary is a collective: a node lost there is recovered like any other
    failure, and the run still ends with its final record and with the
    checkpoint of its last step published: the survivors had written their parts of it in the
    generation that failed, and the run used to end without it."""
    stdout, log = run_with_faults(tmp_path, 5, f"node=1,step={STEPS - 1},phase=optimizer")
    assert [(r["lost"], r["step"]) for r in log if r.get("event") == "recovery"] == [([1], STEPS)]
    assert [r["step"] for r in log if "step" in r and "event" not in r] == list(range(STEPS))
    assert_matches([r for r in log if r.get("event") == "final"][0], failure_free)
    assert published(tmp_path, STEPS)["layers"] == len(failure_free["param_sums"])


def test_a_final_checkpoint_write_that_fails_once_is_written_again_before_the_end(tmp_path, failure_free):
    """Node 0's write of its part of the last step's checkpoint fails once (an I/O error, say):
    it is logged as a background write's is, rank 0 sees the checkpoint unpublished, and the
    end is done again by the same nodes, so the run ends with it published (a foreground
    write error used to be recovered with the other workers' parts never written again)."""
    stdout, log = run_with_faults(tmp_path, 4, f"node=0,step={STEPS},phase=checkpoint,action=glitch")
    # every worker learns rank 0's verdict in the final barrier and the same nodes replay the
    # end at once (they used to wait in the barrier for the roll call's timeout, and one of them
    # then took the next generation's end record for its own and left, taken for dead)
    assert [(r["lost"], r["joined"]) for r in log if r.get("event") == "recovery"] == [([], [])]
    assert len([r for r in log if r.get("event") == "final"]) == 1
    assert published(tmp_path, STEPS)["layers"] == len(failure_free["param_sums"])
    assert_matches([r for r in log if r.get("event") == "final"][0], failure_free)


def test_a_worker_paused_past_the_collective_timeout_is_slow_not_dead(tmp_path, failure_free):
    """A worker stopped (SIGSTOP, by the injector: `action=stop`) in step 2's forward for longer
    than the collective timeout while its agent's lease goes on: the step times out and is
    aborted; once it is resumed every node answers the roll call, and the same nodes replay the
    step in a new generation (only a lease or a roll call makes a node dead)."""
    timeouts = ["--set", "elastic.collective_timeout_s=2", "--set", "elastic.lease_timeout_s=20",
                "--set", "elastic.agreement_timeout_s=60"]
    env = {**os.environ, "OOBLECK_FAULT": "node=2,step=2,phase=forward,action=stop"}
    launcher = start_job(tmp_path, 4, "slowtest", timeouts, env)
    try:
        deadline = time.monotonic() + 200
        # a peer's "recovering" line (the stopped worker cannot write one): the others timed out
        while not any("recovering" in log.read_text() for log in (tmp_path / "logs").glob("node*.log")):
            assert time.monotonic() < deadline and launcher.poll() is None, "the stopped worker's peers never timed out"
            time.sleep(0.2)
        worker = node_worker("slowtest", 2)
        assert worker.status() == psutil.STATUS_STOPPED
        worker.resume()
        out, _ = launcher.communicate(timeout=300)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for proc in run_processes("slowtest"):  # a stopped worker cannot notice its agent is gone
            proc.kill()
    assert launcher.returncode == 0, out
    log = records(tmp_path / "job/metrics.jsonl")
    recoveries = [r for r in log if r.get("event") == "recovery"]
    assert recoveries and all(r["lost"] == [] and r["joined"] == [] for r in recoveries), recoveries
    assert "every node answered the roll call" in recoveries[0]["actions"][0]
    steps = [r for r in log if "step" in r and "event" not in r]
    assert [r["step"] for r in steps] == list(range(STEPS)) and steps[-1]["nodes"] == 4
    assert_matches([r for r in log if r.get("event") == "final"][0], failure_free)


def test_a_step_slower_than_the_collective_timeout_gets_through_on_replay(tmp_path, failure_free):
    """Node 2 takes 3 s in step 2's gradient sum, every time it runs it, against a 2 s collective
    timeout: the step times out, every node answers the roll call, and each replay doubles the
    timeout until the step gets through (slow is not dead, and a slow
    transfer or checkpoint write is no different)."""
    timeouts = ["--set", "elastic.collective_timeout_s=2", "--set", "elastic.lease_timeout_s=20",
                "--set", "elastic.agreement_timeout_s=60"]
    env = {**os.environ, "OOBLECK_FAULT": "node=2,step=2,phase=grad_sync,action=slow,seconds=3"}
    proc = subprocess.run([sys.executable, "-m", "oobleck_elastic.launch", "--oobleck-local-nodes=4",
                           "--nproc-per-node=1", f"--oobleck-log-dir={tmp_path / 'logs'}", SCRIPT,
                           *job_args(tmp_path, "job"), *timeouts], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = records(tmp_path / "job/metrics.jsonl")
    recoveries = [r for r in log if r.get("event") == "recovery"]
    assert recoveries and all(r["lost"] == [] and r["joined"] == [] for r in recoveries), recoveries
    steps = [r for r in log if "step" in r and "event" not in r]
    assert [r["step"] for r in steps] == list(range(STEPS)) and steps[-1]["nodes"] == 4
    assert_matches([r for r in log if r.get("event") == "final"][0], failure_free)


def test_rank_0_killed_after_a_commit_or_at_the_end_leaves_nothing_unreported(tmp_path, failure_free):
    """Node 0 (global rank 0, the reporting worker) dies once step 2 is committed, before it
    writes the step's line: the new rank 0 writes it, so every step is in the log once. That
    rank 0, node 1, dies after the run's last collective, before it records the end: the
    others used to leave, and the job had finished without a final record or `done` (a chaos
    run found it). They wait for the end to be recorded, so node 2 records it (Note: [the end
    is recorded before anyone leaves] in elastic/run.py)."""
    out, log = run_with_faults(tmp_path, 4, f"node=0,step=2,phase=committed;node=1,step={STEPS},phase=finish")
    assert [r["lost"] for r in log if r.get("event") == "recovery"] == [[0], [1]]
    assert len([r for r in log if r.get("event") == "final"]) == 1
    steps = [r for r in log if "step" in r and "event" not in r]
    assert [r["step"] for r in steps] == list(range(STEPS)), [r["step"] for r in steps]
    # the new rank 0 is the survivors' hot spare: it reports the step's time, not its own (it
    # started step 3 late, after drawing the layout, and waited for nobody: 3 ms of 180)
    (spare,) = [r["spares"] for r in log if r.get("event") == "generation" and r["generation"] == 1]
    assert spare == [1]
    times = [r["step_time_s"] for r in steps]
    assert min(times) > 0.2 * statistics.median(times), times
    assert_matches([r for r in log if r.get("event") == "final"][0], failure_free)
    assert published(tmp_path, STEPS)["layers"] == len(failure_free["param_sums"])


def test_a_node_killed_at_the_end_while_rank_0_records_it_ends_the_run(tmp_path, failure_free):
    """Node 3 dies after the run's last collective while rank 0 (node 0, 2 s slow there) has
    not yet recorded the end: the others' final barrier fails first. They wait for the end
    while rank 0 lives, so the run ends once, recorded, without a recovery after its final
    record (they used to start one at once, and with too few nodes left would have failed
    the finished run)."""
    out, log = run_with_faults(tmp_path, 4, f"node=3,step={STEPS},phase=finish;"
                                            f"node=0,step={STEPS},phase=finish,action=slow,seconds=2")
    assert [r.get("event") for r in log if r.get("event")][-1] == "final"
    assert [r for r in log if r.get("event") == "recovery"] == []
    assert_matches([r for r in log if r.get("event") == "final"][0], failure_free)
    assert published(tmp_path, STEPS)["layers"] == len(failure_free["param_sums"])


def test_a_run_that_cannot_go_on_says_so_and_stops_its_waiting_joiner(tmp_path):
    """A step that keeps failing with every node alive ends the run (a bug, not a node failure);
    the first worker to give up publishes the failure, so a node waiting to join stops waiting
    (it used to wait out elastic.join_timeout_s) and the launcher prints why and stops the job."""
    timeouts = ["--set", "elastic.join_timeout_s=280"]
    env = {**os.environ, "OOBLECK_FAULT": "node=1,step=1,phase=grad_sync,action=raise"}
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "oobleck_elastic.launch", "--oobleck-local-nodes=2",
                           "--nproc-per-node=1", f"--oobleck-log-dir={tmp_path / 'logs'}",
                           "--oobleck-add-node-at-step=0", SCRIPT, *job_args(tmp_path, "job"),
                           "--set", "planner.memory_per_worker=1GB", *timeouts],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=250)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "oobleck: the run failed (node " in proc.stderr, proc.stderr[-2000:]
    assert "GiveUp: step 1 failed 4 times with every node alive" in proc.stderr, proc.stderr[-2000:]
    # the joiner left by itself (tests/unit/test_protocol.py has the mechanism) or, not up yet, was
    # stopped with the others: the job never waited out the joiner's 280 s join timeout
    assert "waiting for node 2 to be admitted" not in (tmp_path / "logs/node2.log").read_text()
    assert time.monotonic() - started < 200

