"""A whole job on this machine (`--oobleck-local-nodes N`): hosts the membership store (or
uses the etcd server that `--rdzv-conf store=etcd` and `--rdzv-endpoint` name), starts N node
agents, each in its own process group so a node can be killed as a unit, and watches the run
through the store (`LocalJob`, with the watchers of launcher/job_watchers.py): one progress line
per interval, one line per reconfiguration, nodes added at the steps asked for, a dead agent
marked dead at once, a stop on SIGTERM or Ctrl-C.

Each node runs `python -m oobleck_elastic.launch --oobleck-node ...` (launcher/node.py), forked
by the node starter (launcher/node_starter.py) so that torch is imported once for all the nodes.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable

import psutil

from oobleck_elastic.config import JobConfig
from oobleck_elastic.elastic.protocol import LauncherSide
from oobleck_elastic.elastic.stores import StoreUnreachable
from oobleck_elastic.errors import OobleckError
from oobleck_elastic.launcher.job_watchers import (
    DeadNodes,
    Finish,
    Progress,
    Recoveries,
    RunFailure,
    StopOnSignal,
    Tick,
    Watcher,
)
from oobleck_elastic.launcher.node import with_job_settings
from oobleck_elastic.launcher.node_starter import NODE_PROGRAM, node_env, spawn_node_starter
from oobleck_elastic.launcher.zygote import ForkedProcess, Zygote

__all__ = ["LocalJob", "LocalNodes", "run_local_job", "node_command"]

def _node_of_pid(protocol: LauncherSide, pid: int) -> int | None:
    """The newest node id registered by agent `pid` (a node whose workers torch restarted
    registers again under a new id)."""
    for node in reversed(range(protocol.registered())):
        info = protocol.node_info(node)
        if info and info.get("pid") == pid:
            return node
    return None


def _local_store(args: argparse.Namespace, run_id: str):
    """The membership store of a local job: hosted here (embedded), or on the etcd server that
    `--rdzv-conf store=etcd` and `--rdzv-endpoint` name. Returns it and the nodes' endpoint."""
    from torch.distributed.elastic.rendezvous.utils import _parse_rendezvous_config

    from oobleck_elastic.elastic.rendezvous import store_kind
    from oobleck_elastic.elastic.stores import connect_store, host_store

    conf = _parse_rendezvous_config(args.rdzv_conf)
    if store_kind(conf) == "etcd":
        from oobleck_elastic.elastic.stores.etcd_v2 import EtcdAccess

        endpoint = args.rdzv_endpoint or "127.0.0.1:2379"
        query = EtcdAccess.from_config(conf).query()
        return connect_store(f"etcd://{endpoint}" + (f"?{query}" if query else ""), run_id), endpoint
    port = int(args.rdzv_endpoint.rpartition(":")[2]) if args.rdzv_endpoint else 0
    store = host_store("127.0.0.1", port, run_id)
    return store, f"127.0.0.1:{store.port}"


def node_command(args: argparse.Namespace, cfg: JobConfig | None, endpoint: str, run_id: str) -> list[str]:
    """The command of one node of the local job: the launcher again, as one node, with the job's
    rendezvous settings in --rdzv-conf (launcher/node.py)."""
    nodes = args.oobleck_local_nodes
    most = nodes + len(args.oobleck_add_node_at_step)
    return [*NODE_PROGRAM, "--oobleck-node", f"--nnodes={nodes}:{most}",
            f"--nproc-per-node={args.nproc_per_node}", f"--rdzv-endpoint={endpoint}",
            f"--rdzv-conf={with_job_settings(args.rdzv_conf, cfg)}", f"--rdzv-id={run_id}",
            f"--max-restarts={args.max_restarts}", "--monitor-interval=0.1", f"--start-method={args.start_method}",
            *(["-m"] if args.module else []), args.training_script, *args.training_script_args]


def free_gpus(count: int, held: set[int], want: int, node: int) -> list[int]:
    """The `want` lowest GPUs of `count` that no running node holds. NCCL refuses two ranks of
    one communicator on one GPU, so a node that cannot have GPUs of its own is an error, not a
    GPU shared with a live node."""
    free = [g for g in range(count) if g not in held]
    if len(free) < want:
        raise OobleckError(
            f"local node {node} needs {want} GPU(s) of its own but {len(free)} of this machine's {count} are free "
            f"(running nodes hold {sorted(held)}): start fewer local nodes (--oobleck-local-nodes, "
            "--oobleck-add-node-at-step) or workers per node (--nproc-per-node), or set CUDA_VISIBLE_DEVICES")
    return free[:want]


def _gpu_count() -> int:
    import torch  # the launcher's parent (torch.distributed.run) has it loaded already

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


class LocalNodes:
    """The node processes of a local job, by start order k (node k's log is node<k>.log): the
    launcher's loop watches them, and a chaos schedule (launcher/chaos.py) signals them."""

    def __init__(self, command: list[str], log_dir: str, verbose: bool, protocol: LauncherSide,
                 workers_per_node: int = 1, run_id: str = "", starter: Zygote | None = None) -> None:
        self.command, self.log_dir, self.verbose, self.protocol = command, log_dir, verbose, protocol
        self.workers_per_node = workers_per_node
        self.env = node_env()
        self.procs: list[ForkedProcess] = []
        self.gpus: dict[int, list[int]] = {}  # node k -> the GPUs it was given
        self.zygote = starter or spawn_node_starter(run_id)

    def start(self) -> int:
        """Starts one more node (its own session, so it can be killed as a unit); its k. The
        node is forked by the zygote (launcher/zygote.py), which has imported torch already."""
        k = len(self.procs)
        log = None if self.verbose else os.path.join(self.log_dir, f"node{k}.log")
        self.procs.append(self.zygote.start(["--main", NODE_PROGRAM[2], *self.command[len(NODE_PROGRAM):]],
                                            self._node_env(k), log, log))
        return k

    def close(self) -> None:
        self.zygote.close()

    def _node_env(self, k: int) -> dict[str, str]:
        """Node k's environment. On a machine with GPUs (and no CUDA_VISIBLE_DEVICES of the
        user's), node k sees GPUs of its own, as a real machine's workers would: every local
        node's worker w has LOCAL_RANK w, and two ranks of one NCCL communicator must not share
        a GPU (runtime.devices). A node that has exited gives its GPUs back, so a replacement
        takes the dead node's; more nodes than free GPUs is an error (free_gpus)."""
        count = _gpu_count()
        if count == 0 or "CUDA_VISIBLE_DEVICES" in self.env:
            return self.env
        held = {g for j, gpus in self.gpus.items() if self.procs[j].poll() is None for g in gpus}
        self.gpus[k] = free_gpus(count, held, self.workers_per_node, k)
        return {**self.env, "CUDA_VISIBLE_DEVICES": ",".join(map(str, self.gpus[k]))}

    def check_gpus(self, most_nodes: int) -> None:
        """Before any node starts: on a machine with GPUs, `most_nodes` nodes alive at once must
        each have GPUs of their own (free_gpus)."""
        count = _gpu_count()
        if count and "CUDA_VISIBLE_DEVICES" not in self.env:
            free_gpus(count, set(), most_nodes * self.workers_per_node, most_nodes - 1)

    def running(self) -> list[int]:
        return [k for k, p in enumerate(self.procs) if p.poll() is None]

    def signal(self, k: int, sig: signal.Signals) -> None:
        """Sends `sig` to every process of node k, its agent and its workers (torch starts each
        worker in a process group of its own), as a machine would die (SIGKILL) or hang (SIGSTOP).
        A worker still starting (not yet watching its agent) is reached too."""
        try:
            agent = psutil.Process(self.procs[k].pid)
            tree = [agent, *agent.children(recursive=True)]
        except psutil.NoSuchProcess:  # it exited meanwhile
            return
        for proc in tree:
            try:
                proc.send_signal(sig)
            except psutil.NoSuchProcess:
                pass

    def node_id(self, k: int) -> int | None:
        return _node_of_pid(self.protocol, self.procs[k].pid)


def run_local_job(args: argparse.Namespace, cfg: JobConfig | None,
                  tick: Callable[[LocalNodes], None] | None = None, starter: Zygote | None = None) -> int:
    """Runs the job of `args` (the launcher's parsed flags: --oobleck-local-nodes, --nproc-per-node,
    --rdzv-*, --max-restarts, --oobleck-add-node-at-step, --oobleck-log-dir, -v and the training
    script with its arguments) to its end; `cfg` is the job's configuration when the script
    takes one. `tick`: called with the nodes on every turn of the loop (a chaos schedule).
    `starter`: the job's node starter if the launcher spawned it already (launcher/node_starter.py).
    Returns the launcher's exit status: 0 when the run finished or stopped on request."""
    return LocalJob(args, cfg, starter).run([Tick(tick)] if tick else [])


class LocalJob:
    """One local job: its store, its nodes, and the loop that watches its run (launcher/
    job_watchers.py) until it ends; then what the launcher says of it."""

    def __init__(self, args: argparse.Namespace, cfg: JobConfig | None, starter: Zygote | None = None) -> None:
        self.args, self.cfg = args, cfg
        self.run_id = args.rdzv_id if args.rdzv_id != "none" else uuid.uuid4().hex[:8]
        self.store, endpoint = _local_store(args, self.run_id)
        self.protocol = LauncherSide(self.store)
        os.makedirs(args.oobleck_log_dir, exist_ok=True)
        workers = int(args.nproc_per_node) if str(args.nproc_per_node).isdigit() else 1
        self.nodes = LocalNodes(node_command(args, cfg, endpoint, self.run_id), args.oobleck_log_dir,
                                bool(args.verbose), self.protocol, workers_per_node=workers, run_id=self.run_id,
                                starter=starter)
        self.nodes.check_gpus(args.oobleck_local_nodes + len(args.oobleck_add_node_at_step))

    def run(self, extra: list[Watcher]) -> int:
        """Starts the nodes and watches the run to its end; the launcher's exit status."""
        args = self.args
        print(f"oobleck: {args.oobleck_local_nodes} local nodes x {args.nproc_per_node} worker(s), run "
              f"{self.run_id}, store {self.store.url}; node logs in {args.oobleck_log_dir}/", flush=True)
        for _ in range(args.oobleck_local_nodes):
            self.nodes.start()
        started = time.monotonic()
        stopper, dead = StopOnSignal(), DeadNodes()
        watchers: list[Watcher] = [stopper, dead, RunFailure(), *extra,
                                   Progress(self.cfg.monitoring.log_interval if self.cfg else 1,
                                            args.oobleck_add_node_at_step),
                                   Recoveries(), Finish(dead)]
        lost_store = False
        try:
            while any(p.poll() is None for p in self.nodes.procs):
                if any(w.watch(self) for w in watchers):  # the first that ends the loop ends it
                    break
                time.sleep(0.1)
        except StoreUnreachable as exc:  # etcd gone for longer than its outage timeout: nothing can go on
            print(f"oobleck: {exc}; stopping the job", file=sys.stderr, flush=True)
            lost_store = True
        except KeyboardInterrupt:
            print("interrupted: killing every node", file=sys.stderr)
        finally:
            stopper.restore()
            for k, p in enumerate(self.nodes.procs):  # what is left is stuck or was interrupted twice
                if p.poll() is None:
                    self.nodes.signal(k, signal.SIGKILL)  # the agent and its workers, even one not watching it yet
                    p.wait()
            self.nodes.close()
        return self._verdict(None if lost_store else self.protocol.done(), started)

    def _verdict(self, done: dict | None, started: float) -> int:
        """What the launcher says of the run that ended, and its exit status."""
        args = self.args
        if not done:
            failed = [k for k, p in enumerate(self.nodes.procs) if p.returncode != 0]
            print(f"oobleck: the job did not finish; node logs (by start order): "
                  f"{', '.join(f'{args.oobleck_log_dir}/node{k}.log' for k in failed)}", file=sys.stderr)
            for k in failed:
                if args.verbose:
                    break
                lines = open(os.path.join(args.oobleck_log_dir, f"node{k}.log")).read().splitlines()
                errors = [line for line in lines if line.startswith("error:")]
                if errors:
                    print(f"  {errors[-1]}", file=sys.stderr)
                    break
            return 1
        if done.get("stopped"):
            try:  # the run records a stop only once its checkpoint is published; look anyway before saying so
                from oobleck_elastic.runtime.checkpoint import read_manifest  # DCP: imported when used

                read_manifest(done["checkpoint_dir"], done["steps"])
            except (OSError, ValueError) as exc:
                print(f"oobleck: stopped on request after step {done['steps']}, but its checkpoint is not in "
                      f"{done['checkpoint_dir']} ({exc}); a relaunch resumes from an older one", file=sys.stderr)
                return 1
            print(f"oobleck: stopped on request after step {done['steps']}; its checkpoint is in "
                  f"{done['checkpoint_dir']}: run the same command to resume from it")
            return 0
        print(f"oobleck: finished {done['steps']} steps in {time.monotonic() - started:.1f} s")
        if self.cfg:
            print(f"  metrics log: {self.cfg.monitoring.metrics_path}")
            print(f"  TensorBoard: tensorboard --logdir {self.cfg.monitoring.tensorboard_dir}  "
                  "(then open http://localhost:6006)")
        return 0
