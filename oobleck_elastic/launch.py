"""`python -m oobleck_elastic.launch`: the command line. torchrun's flags plus a few --oobleck-*
ones, the job's configuration checked before anything starts, then one node or a whole local
job (both run by oobleck_elastic/launcher/).

    python -m oobleck_elastic.launch --nnodes 2 --nproc-per-node 4 --rdzv-endpoint host:29400 \\
        train.py --config job.yaml                     # one node of a multi-machine job
    python -m oobleck_elastic.launch --oobleck-local-nodes 4 --nproc-per-node 1 \\
        examples/gpt/train.py --config examples/gpt/config.yaml   # a whole 4-node job here

With --oobleck-local-nodes N this process hosts the membership store (or uses the etcd server
that --rdzv-conf store=etcd and --rdzv-endpoint name) and starts N node agents,
each in its own process group (so a node can be killed as a unit), and prints one progress line
per interval; node logs go to --oobleck-log-dir (-v shows them here instead).
"""

from __future__ import annotations

import argparse
import logging
import sys

from oobleck_elastic.config import JobConfig, load_config
from oobleck_elastic.errors import OobleckError
from oobleck_elastic.launcher.node_starter import EarlyStarter, early_node_starter
from oobleck_elastic.launcher.process_exit import exit_now

__all__ = ["main", "build_parser", "job_config_of"]


def build_parser() -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser  # torch: imported once a local job's starter is on its way

    parser = get_args_parser()
    parser.prog = "python -m oobleck_elastic.launch"
    parser.add_argument("--oobleck-local-nodes", type=int, default=0, metavar="N",
                        help="start an N-node job on this machine (one agent process group per node)")
    parser.add_argument("--oobleck-log-dir", default="runs/logs", help="per-node logs of a local job")
    parser.add_argument("--oobleck-add-node-at-step", type=int, action="append", default=[], metavar="K",
                        help="local jobs: start one more node once step K is done (repeatable)")
    # torchrun's --start-method applies to function entrypoints only; here it picks how a Python
    # training script's workers start (launcher/forked_workers.py)
    parser.set_defaults(start_method="fork")
    for action in parser._actions:
        if action.dest == "start_method":
            action.help = ("how workers start: 'fork' (the default) forks each from a process of its node that "
                           "has imported torch and this package once; 'spawn' starts a new interpreter for each, "
                           "as torchrun does")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="show node logs and more")
    parser.add_argument("--oobleck-node", action="store_true", help=argparse.SUPPRESS)
    return parser


def job_config_of(script_args: list[str]) -> JobConfig | None:
    """The job configuration the training script will load, if it takes --config/--set: checked
    here so a bad value stops the launch before any worker starts."""
    config = None
    sets = []
    for i, arg in enumerate(script_args):
        if arg == "--config" and i + 1 < len(script_args):
            config = script_args[i + 1]
        elif arg.startswith("--config="):
            config = arg.split("=", 1)[1]
        elif arg == "--set" and i + 1 < len(script_args):
            sets.append(script_args[i + 1])
    if config is None and not sets:
        return None
    from oobleck_elastic.runtime.supported import check_supported

    cfg = load_config(config, sets)
    check_supported(cfg)
    return cfg


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    early = early_node_starter(argv)  # a local job's node starter imports torch while we do
    try:
        return _launch(argv, early)
    finally:
        if early is not None:
            early.kill_unless_taken()  # not a local job after all, or it ended before it began


def _launch(argv: list[str], early: EarlyStarter | None) -> int:
    from oobleck_elastic.launcher.local_job import run_local_job
    from oobleck_elastic.launcher.node import run_node

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if getattr(args, "virtual_local_rank", False):
            raise OobleckError("--virtual-local-rank gives every worker of a node LOCAL_RANK 0, so all of them "
                               "would take the same place in the run: drop the flag (each worker gets its own GPU "
                               "by LOCAL_RANK)")
        if args.oobleck_node:
            return run_node(args)
        cfg = job_config_of(args.training_script_args)
        if cfg is not None and args.module and args.training_script == "oobleck_elastic.train":
            from oobleck_elastic.train import check_plan, check_resume, prepare

            spec, data, held_out = prepare(cfg)
            check_resume(cfg, spec, data, held_out)  # model, data and checkpoint checked here, not in every node's log
            if args.oobleck_local_nodes > 0 and str(args.nproc_per_node).isdigit():  # and the plan, here
                check_plan(cfg, spec, args.oobleck_local_nodes, int(args.nproc_per_node))
        if args.oobleck_local_nodes:
            if args.oobleck_local_nodes < 1:
                raise OobleckError(f"--oobleck-local-nodes must be >= 1, got {args.oobleck_local_nodes}")
            starter = None
            if early is not None and args.rdzv_id in ("none", early.run_id):
                starter, args.rdzv_id = early.take(), early.run_id  # the job owns it from here
            return run_local_job(args, cfg, starter=starter)
        return run_node(args, cfg)
    except OobleckError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    exit_now(main())
