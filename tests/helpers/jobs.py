"""What the multi-process tests share: the example job's arguments, its metrics log, the
single-process reference run, and the comparison of final weights."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import tempfile

import psutil
import pytest

from oobleck_elastic.elastic.process import run_id_of, worker_identity
from oobleck_elastic.elastic.protocol.waits import wait_until
from oobleck_elastic.launcher import warm_starter

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "examples/gpt/train.py")
STEPS = 6


def job_args(tmp_path, name):
    return ["--config", str(ROOT / "examples/gpt/config.yaml"), "--set", f"train.steps={STEPS}",
            "--set", "train.dtype=float64", "--set", "planner.memory_per_worker=16MB",
            "--set", f"planner.profile_dir={tmp_path.parent / 'profiles'}",
            "--set", f"monitoring.metrics_path={tmp_path / name / 'metrics.jsonl'}",
            "--set", f"monitoring.tensorboard_dir={tmp_path / name / 'tb'}",
            "--set", f"checkpoint.dir={tmp_path / name / 'checkpoints'}"]


def records(path):
    return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines()]


def reference_run(tmp_path_factory, warm: str, *sets: str) -> dict:
    """The final record of the single-process run of the job with `sets` (one worker holds the
    whole model), run once per session for each `sets` however many tests compare with it;
    forked by the warm starter at `warm`, as `python SCRIPT ...` would run it."""
    key = tuple(sets)
    if key not in _REFERENCES:
        tmp = tmp_path_factory.mktemp("reference")
        # on the CPU even where GPUs are (a session fixture runs before conftest hides them)
        alone = [*job_args(tmp, "ref"), "--set", "planner.memory_per_worker=1GB", "--set", "train.device=cpu", *sets]
        starter = warm_starter.request_starter(warm, "reference", dict(os.environ), cwd=str(tmp))
        try:
            code = starter.start([SCRIPT, *alone], dict(os.environ), str(tmp / "ref.log"), str(tmp / "ref.log"))
            assert code.wait(timeout=300) == 0, (tmp / "ref.log").read_text()[-3000:]
        finally:
            starter.close()
        _REFERENCES[key] = records(tmp / "ref/metrics.jsonl")[-1]
    return _REFERENCES[key]


_REFERENCES: dict[tuple[str, ...], dict] = {}


@pytest.fixture(scope="session")
def failure_free(tmp_path_factory, warm_node_starter):
    """The single-process run (equal to a failure-free multi-node run, see test_launcher)."""
    return reference_run(tmp_path_factory, warm_node_starter)


@pytest.fixture(scope="session")
def failure_free_40(tmp_path_factory, warm_node_starter):
    """The single-process run of 40 steps: long enough for a node started at step 3 to be
    admitted before the end."""
    return reference_run(tmp_path_factory, warm_node_starter, "--set", "train.steps=40")


@pytest.fixture(scope="session")
def warm_node_starter():
    """The path of one warm starter (launcher/warm_starter.py) for the session: it imports
    torch once, not once per job."""
    folder = tempfile.mkdtemp(prefix="oobleck-starter-")  # a short path: a socket's is at most 107 bytes
    path = os.path.join(folder, "node-starter.sock")
    proc = subprocess.Popen(warm_starter.command(path), stdin=subprocess.DEVNULL)
    try:
        wait_until("the warm node starter to listen", lambda: os.path.exists(path) or proc.poll() is not None,
                   timeout=120, poll_s=0.05)
        assert proc.poll() is None, f"the warm node starter exited with {proc.returncode}"
        yield path
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        shutil.rmtree(folder, ignore_errors=True)


def assert_matches(final, reference, rel=1e-9):
    """A run's final record holds the reference's weights: the same steps, one sum and one norm
    per layer for every layer, each equal to `rel`. An empty or cut record does not match."""
    for key in ("steps", "param_sums", "param_norms"):
        assert key in final, f"the final record has no {key!r}: {final}"
    assert final["steps"] == reference["steps"], (final["steps"], reference["steps"])
    for key in ("param_sums", "param_norms"):
        assert len(final[key]) == len(reference[key]) > 0, (key, len(final[key]), len(reference[key]))
    for ours, theirs in zip(final["param_sums"] + final["param_norms"],
                            reference["param_sums"] + reference["param_norms"]):
        assert ours == pytest.approx(theirs, rel=rel, abs=1e-12)


def run_processes(run_id: str, workers: bool = False) -> list[psutil.Process]:
    """Every process of run `run_id` still alive: node starters, agents, worker starters and
    workers (elastic/process.py `run_id_of`), and launchers other than the test's own children
    in its process group (whose group a caller may kill); `workers`: the workers alone."""
    found = []
    ours = os.getpgrp()
    for proc in psutil.process_iter():
        try:
            if proc.pid == os.getpid() or os.getpgid(proc.pid) == ours:
                continue
            if run_id_of(proc) == run_id and (not workers or worker_identity(proc)):
                found.append(proc)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess, ProcessLookupError):
            continue
    return found


def node_worker(run_id: str, node: int, local_rank: int = 0) -> psutil.Process:
    """The worker process of `node` with `local_rank` (exec'd: its environment says who it is;
    forked: its name, elastic/process.py `worker_identity`)."""
    found = []
    for proc in run_processes(run_id, workers=True):
        try:
            if worker_identity(proc) == (node, local_rank):
                found.append(proc)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    assert len(found) == 1, found
    return found[0]


def node_agent(run_id: str, node: int) -> psutil.Process:
    """The agent of `node`: its worker's parent, or its worker starter's."""
    parent = node_worker(run_id, node).parent()
    return parent.parent() if parent.name() == "oobleck-starter" else parent
