"""The launcher's command line on a real store: the node command of a local job carries the
job's rendezvous settings in torchrun's --rdzv-conf, and the rendezvous handler a node makes of
it (hosting the embedded store) uses them (settings reach the nodes through the job
config, not environment variables parsed by hand)."""

from __future__ import annotations

import socket

from oobleck_elastic.config import load_config
from oobleck_elastic.elastic.rendezvous import create_handler
from oobleck_elastic.launch import build_parser
from oobleck_elastic.launcher.local_job import node_command
from oobleck_elastic.launcher.node import rendezvous_parameters


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
    assert "--rdzv-conf=join_timeout=5,heartbeat_interval=0.2,lease_timeout=15.0" in cmd
    *_, params = rendezvous_parameters(build_parser().parse_args(cmd[3:]))  # as the node parses it
    handler = create_handler(params)
    assert handler.heartbeat_interval == 0.2 and handler.timeout == 5.0
    handler.shutdown()
