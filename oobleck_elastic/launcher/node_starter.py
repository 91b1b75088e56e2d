"""A local job's node starter: one process that imports torch, this package and what the workers
use once, then forks the job's node agents (launcher/zygote.py). The launcher spawns it before it
imports torch itself (`early_node_starter`), so the two imports run side by side: on two cores
a local job is under way some two seconds sooner. Where OOBLECK_NODE_STARTER names a warm starter
(launcher/warm_starter.py), the node starter is forked by it instead, its imports done already.
This module imports nothing heavy."""

from __future__ import annotations

import argparse
import os
import sys
import uuid
from dataclasses import dataclass

from oobleck_elastic.launcher import warm_starter
from oobleck_elastic.launcher.zygote import NODE_STARTER_MODULES, Zygote

__all__ = ["NODE_PROGRAM", "EarlyStarter", "early_node_starter", "node_env", "spawn_node_starter"]

NODE_PROGRAM = (sys.executable, "-m", "oobleck_elastic.launch")  # what each node runs, before its arguments


def node_env() -> dict[str, str]:
    """The environment every node of a local job starts with (one thread per worker unless the
    user says otherwise: a local job shares the machine's cores among all its workers)."""
    return {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def spawn_node_starter(run_id: str) -> Zygote:
    """The starter of run `run_id`'s nodes. Its environment names the run: /proc/PID/environ of
    every process forked from it (nodes, their workers) shows the starter's, so tools find the
    run's processes by it. Forked by the warm starter that OOBLECK_NODE_STARTER names, if any
    (whose processes show the run id on their command line instead); spawned if it does not
    answer."""
    env = {**node_env(), "OOBLECK_RUN_ID": run_id}
    warm = os.environ.get(warm_starter.ENV_VAR)
    if warm:
        try:
            return warm_starter.request_starter(warm, run_id, env)
        except (OSError, ValueError) as exc:
            print(f"oobleck: the warm node starter {warm_starter.ENV_VAR}={warm} did not start this job's "
                  f"nodes ({exc}); starting them without it", file=sys.stderr)
    return Zygote.spawn(env, run_id, list(NODE_STARTER_MODULES))


@dataclass
class EarlyStarter:
    """A node starter spawned before the job's flags were parsed, for run `run_id`; whoever
    does not `take()` it kills it (`kill_unless_taken`)."""

    starter: Zygote
    run_id: str
    taken: bool = False

    def take(self) -> Zygote:
        self.taken = True
        return self.starter

    def kill_unless_taken(self) -> None:
        if not self.taken:
            self.starter.kill()


def early_node_starter(argv: list[str]) -> EarlyStarter | None:
    """The node starter of the local job `argv` asks for, spawned now, before the
    launcher parses its flags with torchrun's parser (which imports torch); None if `argv` asks
    for anything else, or if it cannot tell (a flag it does not know is left to that parser)."""
    scan = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    scan.add_argument("--oobleck-local-nodes", "--oobleck_local_nodes", type=int, default=0)
    scan.add_argument("--oobleck-node", "--oobleck_node", action="store_true")
    scan.add_argument("--rdzv-id", "--rdzv_id", default="none")
    try:
        known, _ = scan.parse_known_args(argv)
    except argparse.ArgumentError:
        return None
    if known.oobleck_local_nodes < 1 or known.oobleck_node:
        return None
    run_id = known.rdzv_id if known.rdzv_id != "none" else uuid.uuid4().hex[:8]
    return EarlyStarter(spawn_node_starter(run_id), run_id)
