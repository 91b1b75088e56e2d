"""The warm node starter (launcher/warm_starter.py) that this tier's jobs get their node starters
from: what it forks runs where and as the launcher asked, shows its run id on its command line
for the tools that look for a run's processes, and ends with its owner; bad requests are refused
with the reason."""

from __future__ import annotations

import json
import os
import socket
import stat

import psutil
import pytest

from oobleck_elastic.elastic.process import run_id_of
from oobleck_elastic.elastic.protocol.waits import wait_until
from oobleck_elastic.launcher.node_starter import spawn_node_starter
from oobleck_elastic.launcher.warm_starter import RUN_ID_MAX, request_starter


def test_a_forked_node_starter_runs_as_asked_and_names_its_run(warm_node_starter, tmp_path, monkeypatch, capfd):
    script = tmp_path / "child.py"
    script.write_text("import os, sys, greeting\nprint('child in', os.getcwd(), greeting.WORD, flush=True)\n"
                      "import time; time.sleep(60)\n")
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib/greeting.py").write_text("import os\nWORD = os.environ['CHILD_SAYS']\n")
    monkeypatch.chdir(tmp_path)
    # PYTHONPATH relative to the job's working directory, as a new interpreter would take it
    starter = request_starter(warm_node_starter, "warmtest-1", {**os.environ, "PYTHONPATH": "lib"})
    try:
        proc = psutil.Process(starter.pid)
        assert proc.ppid() != os.getpid(), "the warm starter forked it, not this process"
        assert "--rdzv-id=warmtest-1" in proc.cmdline() and run_id_of(proc) == "warmtest-1"
        assert proc.cwd() == str(tmp_path) and os.getsid(starter.pid) == starter.pid
        child = starter.start([str(script)], {"CHILD_SAYS": "hello"})
        said: list[str] = []
        wait_until("the child's line", lambda: said.append(capfd.readouterr().out) or "\n" in "".join(said),
                   timeout=30, poll_s=0.05)
        assert "".join(said) == f"child in {tmp_path} hello\n", "its working directory, path, environment, stdout"
        # what the node starter forks (nodes, workers) is found by the same run id
        assert run_id_of(psutil.Process(child.pid)) == "warmtest-1"
        os.kill(child.pid, 9)
        assert child.wait(timeout=30) == -9
    finally:
        starter.close()
    assert not psutil.pid_exists(starter.pid) or psutil.Process(starter.pid).status() == psutil.STATUS_ZOMBIE


def test_requests_it_cannot_serve_are_refused_with_the_reason(warm_node_starter, tmp_path):
    with pytest.raises(ValueError, match=f"up to {RUN_ID_MAX} characters"):
        request_starter(warm_node_starter, "x" * (RUN_ID_MAX + 1), {})
    with pytest.raises(OSError):  # nobody listens there
        request_starter(str(tmp_path / "none.sock"), "run", {})
    # a request without the three descriptors: refused, and the warm starter serves on
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
        raw.settimeout(30)
        raw.connect(warm_node_starter)
        raw.sendall(b'{"run_id": "r", "env": {}, "cwd": "/"}\n')
        answer = json.loads(raw.makefile().readline())
    assert "three descriptors" in answer["error"]
    with pytest.raises(OSError, match="the job's PYTHONHASHSEED differ from the warm starter's"):
        request_starter(warm_node_starter, "run", {**os.environ, "PYTHONHASHSEED": "7"})
    starter = request_starter(warm_node_starter, "warmtest-2", dict(os.environ))
    starter.close()


def test_a_job_whose_warm_starter_does_not_answer_spawns_its_own_and_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OOBLECK_NODE_STARTER", str(tmp_path / "gone.sock"))
    starter = spawn_node_starter("coldtest")
    try:
        assert starter.proc is not None, "spawned by this process, as without a warm starter"
        assert run_id_of(psutil.Process(starter.pid)) == "coldtest"
    finally:
        starter.kill()
    said = capsys.readouterr().err.strip().splitlines()
    gone = tmp_path / "gone.sock"
    assert len(said) == 1 and said[0].startswith(
        f"oobleck: the warm node starter OOBLECK_NODE_STARTER={gone} did not start this job's nodes ("), said
    assert said[0].endswith("); starting them without it")


def test_the_socket_is_the_users_alone(warm_node_starter):
    assert stat.S_IMODE(os.stat(warm_node_starter).st_mode) == 0o600
