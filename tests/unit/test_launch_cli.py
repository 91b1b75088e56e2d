"""The launcher's command line without processes: the job's rendezvous settings join those of
torchrun's --rdzv-conf (settings reach the nodes through the job config, not
environment variables parsed by hand; the node command end to end on a real store:
tests/store/test_launch_cli_store.py), and local nodes get GPUs no running node holds."""

from __future__ import annotations

import pytest

from oobleck_elastic.config import load_config
from oobleck_elastic.errors import OobleckError
from oobleck_elastic.launcher.local_job import free_gpus
from oobleck_elastic.launcher.node import with_job_settings


def test_a_heartbeat_given_in_rdzv_conf_wins_and_no_job_adds_nothing():
    cfg = load_config(None, ["elastic.heartbeat_interval_s=0.2", "elastic.lease_timeout_s=12"])
    assert with_job_settings("store=etcd,heartbeat_interval=0.1", cfg) == \
        "store=etcd,heartbeat_interval=0.1,lease_timeout=12.0"
    assert with_job_settings("", cfg) == "heartbeat_interval=0.2,lease_timeout=12.0"
    assert with_job_settings("store=etcd", None) == "store=etcd"


def test_local_nodes_get_gpus_no_running_node_holds():
    """A replacement takes the GPUs its dead predecessor gave back, never a live node's (NCCL
    refuses two ranks of one communicator on one GPU); too few free GPUs is an error naming
    the flags to change."""
    assert free_gpus(4, set(), 2, node=0) == [0, 1]
    assert free_gpus(4, {0, 1}, 2, node=1) == [2, 3]
    assert free_gpus(4, {2, 3}, 2, node=2) == [0, 1]  # node 0 died: its GPUs again
    with pytest.raises(OobleckError, match=r"local node 3 needs 2 GPU\(s\) of its own but 1 of this machine's 4 are "
                                           r"free \(running nodes hold \[0, 1, 3\]\).*--oobleck-local-nodes"):
        free_gpus(4, {0, 1, 3}, 2, node=3)


def test_virtual_local_rank_is_refused_before_anything_starts(capsys):
    from oobleck_elastic.launch import main

    assert main(["--virtual-local-rank", "--oobleck-local-nodes=2", "train.py"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: --virtual-local-rank gives every worker")


def test_workers_are_forked_unless_spawn_is_asked_for():
    import sys

    from oobleck_elastic.launch import build_parser
    from oobleck_elastic.launcher.forked_workers import forks

    assert build_parser().parse_args(["train.py"]).start_method == "fork"
    assert forks("fork", sys.executable) and forks("forkserver", sys.executable)
    assert not forks("spawn", sys.executable) and not forks("fork", "/usr/bin/my-binary")
