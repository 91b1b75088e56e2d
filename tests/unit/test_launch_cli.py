"""The launcher's command line without processes: the node command of a local job carries the
job's rendezvous settings in torchrun's --rdzv-conf (issue 12: settings reach the nodes through
the job config, not environment variables parsed by hand)."""

from __future__ import annotations

import socket

import pytest

from oobleck_elastic.config import load_config
from oobleck_elastic.elastic.rendezvous import create_handler
from oobleck_elastic.launch import build_parser
from oobleck_elastic.errors import OobleckError
from oobleck_elastic.launcher.local_job import free_gpus, node_command
from oobleck_elastic.launcher.node import rendezvous_parameters, with_job_settings


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_jobs_heartbeat_reaches_each_nodes_rendezvous(monkeypatch):
    monkeypatch.setenv("OOBLECK_HEARTBEAT_S", "9")  # no longer read: only the job's config counts
    cfg = load_config(None, ["elastic.heartbeat_interval_s=0.2"])
    args = build_parser().parse_args(["--oobleck-local-nodes=2", "--rdzv-conf=join_timeout=5", "train.py",
                                      "--config", "job.yaml"])
    cmd = node_command(args, cfg, f"127.0.0.1:{free_port()}", "heartbeat")
    assert cmd[1:4] == ["-m", "oobleck_elastic.launch", "--oobleck-node"]
    assert "--rdzv-conf=join_timeout=5,heartbeat_interval=0.2" in cmd
    *_, params = rendezvous_parameters(build_parser().parse_args(cmd[3:]))  # as the node parses it
    handler = create_handler(params)
    assert handler.heartbeat_interval == 0.2 and handler.timeout == 5.0
    handler.shutdown()


def test_a_heartbeat_given_in_rdzv_conf_wins_and_no_job_adds_nothing():
    cfg = load_config(None, ["elastic.heartbeat_interval_s=0.2"])
    assert with_job_settings("store=etcd,heartbeat_interval=0.1", cfg) == "store=etcd,heartbeat_interval=0.1"
    assert with_job_settings("", cfg) == "heartbeat_interval=0.2"
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
