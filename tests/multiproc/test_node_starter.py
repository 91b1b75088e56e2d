"""A local job's node starter is spawned before the launcher imports torch
(launcher/node_starter.py): only for a local job, named for its run, and killed at once when the
launcher ends before it started anything."""

from __future__ import annotations

import time

import psutil

from oobleck_elastic.launcher.node_starter import early_node_starter


def test_only_a_local_job_gets_an_early_starter():
    assert early_node_starter(["--nnodes=2", "train.py"]) is None
    assert early_node_starter(["--oobleck-node", "--oobleck-local-nodes=2", "train.py"]) is None
    assert early_node_starter(["--oobleck-local-nodes=x", "train.py"]) is None, "left to torchrun's parser"
    assert early_node_starter(["--oobleck-local", "2", "train.py"]) is None, "an abbreviation is not guessed"


def test_the_early_starter_is_named_for_its_run_and_killed_unless_taken():
    early = early_node_starter(["--oobleck-local-nodes", "3", "--rdzv_id=starterrun", "train.py", "--set", "a=1"])
    assert early is not None and early.run_id == "starterrun"
    proc = psutil.Process(early.starter.pid)
    assert proc.environ()["OOBLECK_RUN_ID"] == "starterrun" and "--rdzv-id=starterrun" in proc.cmdline()
    started = time.monotonic()
    early.kill_unless_taken()  # the launcher failed before the job began: no waiting for torch's import
    assert not psutil.pid_exists(early.starter.pid) or proc.status() == psutil.STATUS_ZOMBIE
    assert time.monotonic() - started < 5


def test_a_taken_starter_is_left_to_its_job():
    early = early_node_starter(["--oobleck-local-nodes=1", "train.py"])
    assert early is not None and len(early.run_id) == 8, "a run id is made up as the launcher would"
    starter = early.take()
    early.kill_unless_taken()
    assert psutil.Process(starter.pid).is_running()
    starter.kill()
