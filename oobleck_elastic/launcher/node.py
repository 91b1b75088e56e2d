"""One node of a job: the oobleck agent with the oobleck rendezvous, built from torchrun's
parsed flags (what `torchrun --rdzv-backend=oobleck` would run on this machine).

Settings of the job that the rendezvous needs (the lease's heartbeat) travel in torchrun's
`--rdzv-conf`, the way stock torchrun passes them: `with_job_settings` adds them.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable

from torch.distributed.elastic.rendezvous.api import RendezvousParameters
from torch.distributed.elastic.rendezvous.utils import _parse_rendezvous_config
from torch.distributed.launcher.api import LaunchConfig
from torch.distributed.run import config_from_args

from oobleck_elastic.config import JobConfig
from oobleck_elastic.launcher.forked_workers import forks, starting_through
from oobleck_elastic.launcher.zygote import WORKER_MODULES, Zygote

__all__ = ["run_node", "rendezvous_parameters", "with_job_settings"]

logger = logging.getLogger(__name__)


def with_job_settings(rdzv_conf: str, cfg: JobConfig | None) -> str:
    """`--rdzv-conf` plus the rendezvous settings of the job (heartbeat_interval from
    elastic.heartbeat_interval_s, lease_timeout from elastic.lease_timeout_s); one given in
    `rdzv_conf` itself wins."""
    if cfg is None:
        return rdzv_conf
    given = _parse_rendezvous_config(rdzv_conf)
    job = {"heartbeat_interval": cfg.elastic.heartbeat_interval_s, "lease_timeout": cfg.elastic.lease_timeout_s}
    return ",".join(filter(None, [rdzv_conf, *(f"{k}={v}" for k, v in job.items() if k not in given)]))


def rendezvous_parameters(args: argparse.Namespace
                          ) -> tuple[LaunchConfig, Callable | str, list[str], RendezvousParameters]:
    """torchrun's launch config, the worker command and the oobleck rendezvous's parameters
    from the node's parsed flags."""
    args.rdzv_backend = "static"  # config_from_args checks only torch's own backends
    config, cmd, cmd_args = config_from_args(args)
    params = RendezvousParameters(backend="oobleck", endpoint=args.rdzv_endpoint, run_id=args.rdzv_id,
                                  min_nodes=config.min_nodes, max_nodes=config.max_nodes, **config.rdzv_configs)
    return config, cmd, cmd_args, params


def run_node(args: argparse.Namespace, cfg: JobConfig | None = None) -> int:
    """One node: the oobleck agent with the oobleck rendezvous (what torchrun would run);
    `cfg`, the job's configuration when the launcher read it, adds its rendezvous settings.
    With `--start-method fork` (the launcher's default) the workers of a Python program are
    forked by a starter that has imported their modules (launcher/forked_workers.py)."""
    args.rdzv_conf = with_job_settings(args.rdzv_conf, cfg)
    config, cmd, cmd_args, params = rendezvous_parameters(args)
    # before anything starts a thread (the rendezvous does): the starter is forked from this process
    starter = None
    if forks(config.start_method, cmd):
        try:
            starter = Zygote.fork(list(WORKER_MODULES))
        except RuntimeError as exc:  # a thread is running already: forking would copy its locks
            logger.warning("this node's workers start as new interpreters (as --start-method spawn): %s", exc)
    try:
        return _run_agent(config, cmd, cmd_args, params, starter)
    finally:
        if starter is not None:
            starter.close()


def _run_agent(config: LaunchConfig, cmd: Callable | str, cmd_args: list[str], params: RendezvousParameters,
               starter: Zygote | None) -> int:
    from torch.distributed.elastic.agent.server.api import WorkerSpec

    from oobleck_elastic.elastic.agent import OobleckAgent
    from oobleck_elastic.elastic.rendezvous import create_handler

    handler = create_handler(params)
    spec = WorkerSpec(role="trainer", local_world_size=config.nproc_per_node, entrypoint=cmd,
                      args=tuple(cmd_args), rdzv_handler=handler, max_restarts=config.max_restarts,
                      monitor_interval=config.monitor_interval, master_addr=handler.store.host,
                      master_port=handler.store.port)
    agent = OobleckAgent(spec=spec, logs_specs=config.logs_specs, start_method="spawn", exit_barrier_timeout=60,
                         start_processes=None if starter is None else starting_through(starter))
    try:
        result = agent.run()
    finally:
        try:
            handler.shutdown()
        except Exception as exc:  # the store's host may be gone; leaving is best effort
            handler.log.warning("could not leave the rendezvous cleanly: %s", exc)
    if result.is_failed():
        for rank, failure in result.failures.items():
            print(f"[node {handler.node}] worker {rank} failed: exit code {failure.exitcode}", file=sys.stderr)
        return 1
    return 0
