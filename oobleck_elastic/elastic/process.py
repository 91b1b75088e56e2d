"""How a worker process stands to its agent: it exits when the agent dies, its agent's lease is
fast enough for the job's timeouts, and a SIGTERM from the agent is a stop request (Note: [stop
on request] in elastic/agent.py) unless it is torch stopping the node after a failure."""

from __future__ import annotations

import ctypes
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable

import psutil

from oobleck_elastic.config import JobConfig
from oobleck_elastic.elastic.protocol import Side
from oobleck_elastic.elastic.stores import MembershipStore
from oobleck_elastic.errors import OobleckError

__all__ = ["check_lease", "run_id_of", "stop_or_die", "watch_parent", "worker_identity", "worker_name"]
_ROUNDING = 1 + 1e-9  # 3 x 0.2 is 0.6000000000000001: a heartbeat that divides a timeout exactly fits it

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def worker_name(node: int | str, local_rank: int | str) -> str:
    """What a forked worker calls itself in /proc/PID/comm (15 characters at most): its
    /proc/PID/environ is its starter's, fixed at exec (launcher/zygote.py)."""
    return f"oobleck-w{node}.{local_rank}"[:15]


_NAMED = re.compile(r"oobleck-w(\d+)\.(\d+)")


def worker_identity(proc: psutil.Process) -> tuple[int, int] | None:
    """(node, local rank) of a worker process, exec'd (its environment says) or forked (its
    name says); None for any other process. Raises psutil.Error as psutil does."""
    env = proc.environ()
    if "OOBLECK_NODE_ID" in env and "LOCAL_RANK" in env and "OOBLECK_STORE" in env:
        return int(env["OOBLECK_NODE_ID"]), int(env["LOCAL_RANK"])
    named = _NAMED.fullmatch(proc.name())
    return (int(named.group(1)), int(named.group(2))) if named else None


def run_id_of(proc: psutil.Process) -> str | None:
    """The run a process of a job belongs to: its environment's OOBLECK_RUN_ID (an exec'd worker,
    or anything forked from a local job's node starter), or the --rdzv-id on its command line (a
    node, and what it forked: they share its command line). Raises psutil.Error as psutil does."""
    run = proc.environ().get("OOBLECK_RUN_ID")
    if run is not None:
        return run
    argv = proc.cmdline()
    for i, arg in enumerate(argv):
        for flag in ("--rdzv-id", "--rdzv_id"):
            if arg.startswith(flag + "="):
                return arg.split("=", 1)[1]
            if arg == flag and i + 1 < len(argv):
                return argv[i + 1]
    return None


def watch_parent() -> None:
    """Workers die with their agent (a SIGKILLed agent would otherwise leave orphans): on Linux
    the kernel sends SIGKILL when the parent goes (prctl PR_SET_PDEATHSIG; torch's agents
    start workers from their main thread, whose exit is what the kernel watches); elsewhere a
    thread polls the parent's pid. The agent's pid comes from its environment (OOBLECK_AGENT_PID;
    OOBLECK_PARENT_PID, the node's worker starter, for a forked worker, launcher/zygote.py):
    an agent SIGKILLed while this worker was still importing is gone already, and its orphan,
    adopted by init, must not take init for its agent (the chaos run found such orphans)."""
    parent = int(os.environ.get("OOBLECK_PARENT_PID") or os.environ.get("OOBLECK_AGENT_PID") or os.getppid())
    if os.getppid() != parent:  # the agent died before this worker got here
        os._exit(1)
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0:
            if os.getppid() != parent:  # the parent died before the request took effect
                os._exit(1)
            return

    def watch() -> None:
        while True:
            if os.getppid() != parent:
                os._exit(1)
            time.sleep(0.2)

    threading.Thread(target=watch, name="oobleck-parent-watch", daemon=True).start()


def check_lease(store: MembershipStore, node: int, cfg: JobConfig) -> None:
    """The agent beats the node's lease at its own interval (torchrun does not read the job
    config): it must renew twice per lease timeout and three times per roll-call window, or
    healthy nodes look dead."""
    beat = (Side(store).node_info(node) or {}).get("heartbeat_s")
    ela = cfg.elastic
    if beat is not None and (2 * beat > ela.lease_timeout_s * _ROUNDING
                             or 3 * beat > ela.rollcall_window_s * _ROUNDING):
        raise OobleckError(
            f"node {node}'s agent renews its lease every {beat} s, too slow for "
            f"elastic.lease_timeout_s={ela.lease_timeout_s} (2 beats) and elastic.rollcall_window_s="
            f"{ela.rollcall_window_s} (3 beats); pass torchrun --rdzv-conf "
            f"heartbeat_interval={ela.heartbeat_interval_s} (elastic.heartbeat_interval_s)")



def stop_or_die(node: int, local_world_size: int, stop: Callable[[], None]) -> None:
    """A SIGTERM from torch's agent (stock torchrun): the agent was told to stop (a scheduler's
    SIGTERM), so the run stops after its step (Note: [stop on request]); but when torch stops
    the node's workers because one of them died, this worker dies as it always did."""
    alive = 0
    try:
        children = psutil.Process(os.getppid()).children()  # the agent's, or the node's worker starter's
    except psutil.Error:  # the agent is gone: nothing to stop for
        children = []
    for child in children:
        try:  # this node's workers only (the agent may have other children)
            if child.status() != psutil.STATUS_ZOMBIE and (worker_identity(child) or (None,))[0] == node:
                alive += 1
        except psutil.Error:
            continue
    if alive >= local_world_size:
        stop()
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
