"""One node of a job: the oobleck agent with the oobleck rendezvous, built from torchrun's
parsed flags (what `torchrun --rdzv-backend=oobleck` would run on this machine)."""

from __future__ import annotations

import argparse
import logging
import sys

from torch.distributed.run import config_from_args

__all__ = ["run_node"]

logger = logging.getLogger(__name__)


def run_node(args: argparse.Namespace) -> int:
    """One node: the oobleck agent with the oobleck rendezvous (what torchrun would run)."""
    from torch.distributed.elastic.agent.server.api import WorkerSpec

    from oobleck_elastic.elastic.agent import OobleckAgent
    from oobleck_elastic.elastic.rendezvous import create_handler
    from torch.distributed.elastic.rendezvous.api import RendezvousParameters

    args.rdzv_backend = "static"  # config_from_args checks only torch's own backends
    config, cmd, cmd_args = config_from_args(args)
    params = RendezvousParameters(backend="oobleck", endpoint=args.rdzv_endpoint, run_id=args.rdzv_id,
                                  min_nodes=config.min_nodes, max_nodes=config.max_nodes, **config.rdzv_configs)
    handler = create_handler(params)
    spec = WorkerSpec(role="trainer", local_world_size=config.nproc_per_node, entrypoint=cmd,
                      args=tuple(cmd_args), rdzv_handler=handler, max_restarts=config.max_restarts,
                      monitor_interval=config.monitor_interval, master_addr=handler.store.host,
                      master_port=handler.store.port)
    agent = OobleckAgent(spec=spec, logs_specs=config.logs_specs, start_method="spawn",
                         exit_barrier_timeout=60)
    try:
        result = agent.run()
    finally:
        try:
            handler.shutdown()
        except Exception as exc:  # the store's host may be gone; leaving is best effort
            logger.warning("[node %s] could not leave the rendezvous cleanly: %s", handler.node, exc)
    if result.is_failed():
        for rank, failure in result.failures.items():
            print(f"[node {handler.node}] worker {rank} failed: exit code {failure.exitcode}", file=sys.stderr)
        return 1
    return 0
