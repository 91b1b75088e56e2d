"""What a local job's loop watches, one small watcher per concern, each turn in this order: a
stop asked for by a signal, agents that died, the run's failure, progress (and the nodes to add
at a step), recoveries, and the run's end; a chaos schedule rides along (launcher/chaos.py).
A watcher returns True to end the loop; what is left running is then killed.

Each reads the run through the launcher's side of the protocol (`job.protocol`) and acts on the
nodes (`job.nodes`); its state is its own.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable
from typing import Any, Protocol

from oobleck_elastic.elastic.protocol import LauncherSide
from oobleck_elastic.launcher.zygote import ForkedProcess

__all__ = ["DeadNodes", "Finish", "Job", "Nodes", "Progress", "Recoveries", "RunFailure", "StopOnSignal", "Tick",
           "Watcher"]

FAILED_GRACE_S = 5.0  # after a worker's fatal error, how long the other nodes get to leave
STUCK_AFTER_END_S = 30.0  # after the run's end, how long its agents get to exit


class Nodes(Protocol):
    """What a watcher does with the job's nodes (local_job.LocalNodes)."""

    procs: list[ForkedProcess]

    def start(self) -> int: ...
    def signal(self, k: int, sig: signal.Signals) -> None: ...
    def node_id(self, k: int) -> int | None: ...


class Job(Protocol):
    """What a watcher reads and acts on (local_job.LocalJob)."""

    @property
    def protocol(self) -> LauncherSide: ...
    @property
    def nodes(self) -> Nodes: ...


class Watcher(Protocol):
    def watch(self, job: Job) -> bool: ...


class StopOnSignal:
    """SIGTERM or Ctrl-C: the first asks the run to stop after its current step (Note: [stop on
    request] in elastic/agent.py), the second kills the nodes. The handler only takes note; the
    watcher writes the request (no store call from inside a signal handler)."""

    def __init__(self) -> None:
        self.signal: str | None = None
        self.sent = False
        self.previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGTERM, signal.SIGINT)}

    def _handle(self, signum, frame) -> None:
        if self.signal is not None:
            raise KeyboardInterrupt
        self.signal = signal.Signals(signum).name

    def watch(self, job: Job) -> bool:
        if self.signal is not None and not self.sent:
            job.protocol.request_stop(f"the launcher ({self.signal})")
            self.sent = True
            print(f"oobleck: {self.signal}: stopping after the current step and writing a checkpoint "
                  "(again to kill the nodes now)", file=sys.stderr, flush=True)
        return False

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


class DeadNodes:
    """A node whose agent exited before the run is done is dead: said in the store at once
    (sooner than its lease would)."""

    def __init__(self) -> None:
        self.dead: set[int] = set()

    def watch(self, job: Job) -> bool:
        if job.protocol.finished():
            return False
        for k, p in enumerate(job.nodes.procs):
            if k in self.dead or p.poll() is None or p.returncode == 0:  # 0: it finished (a stop, the end)
                continue
            self.dead.add(k)
            node = job.nodes.node_id(k)
            if node is not None:
                job.protocol.liveness.mark_dead(node, f"agent exited with {p.returncode}")
                print(f"oobleck: node {node} died (agent exit code {p.returncode})", flush=True)
        return False

    def everyone(self, job: Job) -> bool:
        return len(self.dead) == len(job.nodes.procs)


class RunFailure:
    """A worker's fatal error ends the run: said once; the nodes get FAILED_GRACE_S to leave
    (nodes waiting to join would wait in vain)."""

    def __init__(self) -> None:
        self.failed_at: float | None = None

    def watch(self, job: Job) -> bool:
        failure = job.protocol.failure()
        if failure is None:
            return False
        if self.failed_at is None:
            self.failed_at = time.monotonic()
            print(f"oobleck: the run failed ({failure['by']}): {failure['error']}", file=sys.stderr, flush=True)
        return time.monotonic() - self.failed_at > FAILED_GRACE_S


class Tick:
    """Calls `tick` with the nodes each turn while the run goes on (a chaos schedule)."""

    def __init__(self, tick: Callable[[Any], None]) -> None:  # given the job's nodes
        self.tick = tick

    def watch(self, job: Job) -> bool:
        if job.protocol.failure() is None and not job.protocol.finished():
            self.tick(job.nodes)
        return False


class Progress:
    """One line whenever a multiple of monitoring.log_interval steps was passed (polling may
    skip steps), the resume the run began with, and the nodes to add once their step is done."""

    def __init__(self, interval: int, adds: list[int]) -> None:
        self.interval, self.pending_adds = interval, sorted(adds)
        self.first: tuple[float, int] | None = None
        self.last_step = -1
        self.resumed: dict | None = None

    def watch(self, job: Job) -> bool:
        rec = job.protocol.progress()
        if not rec or rec["step"] == self.last_step:
            return False
        self.first = self.first or (time.monotonic(), rec["step"] + 1)
        if ((rec["step"] + 1) // self.interval > (self.last_step + 1) // self.interval
                or rec["step"] + 1 == rec["total_steps"]):
            if self.resumed is None:  # looked for once, at the first line
                self.resumed = job.protocol.resumed() or {}
                if self.resumed:
                    print(f"oobleck: resumed from step {self.resumed['step']} (the checkpoint of run "
                          f"{self.resumed['from_run']} in {self.resumed['checkpoint_dir']})", flush=True)
            print(progress_line(rec, self.first), flush=True)
        self.last_step = rec["step"]
        while self.pending_adds and rec["step"] + 1 >= self.pending_adds[0]:
            self.pending_adds.pop(0)
            k = job.nodes.start()
            print(f"oobleck: starting one more node (agent {job.nodes.procs[k].pid}); it joins when ready",
                  flush=True)
        return False


class Recoveries:
    """One line per recovery, named by the generation it ended in (a recovery that spans several
    generations, after a failure during the recovery, has one record)."""

    def __init__(self) -> None:
        self.generation = 0

    def watch(self, job: Job) -> bool:
        pointer = job.protocol.try_pointer()
        latest = self.generation if pointer is None else pointer.generation
        for g in range(self.generation + 1, latest + 1):
            if recovery := job.protocol.recovery(g):
                self.generation = g
                print(recovery_line(recovery), flush=True)
        return False


class Finish:
    """The loop ends when every agent died, or STUCK_AFTER_END_S after the run's end; nodes
    left out of the last generation (hung, fenced) never finish on their own, so they are
    killed once the run is done."""

    def __init__(self, dead: DeadNodes) -> None:
        self.dead = dead
        self.finished_at: float | None = None

    def watch(self, job: Job) -> bool:
        if self.dead.everyone(job):
            return True
        if not job.protocol.finished():
            return False
        members = set(job.protocol.current(10.0).nodes)
        for k, p in enumerate(job.nodes.procs):
            if p.poll() is None and job.nodes.node_id(k) not in members:
                job.nodes.signal(k, signal.SIGKILL)
        self.finished_at = self.finished_at or time.monotonic()
        if time.monotonic() - self.finished_at > STUCK_AFTER_END_S:
            stuck = [p.pid for p in job.nodes.procs if p.poll() is None]
            print(f"oobleck: the run is done but agent(s) {stuck} did not exit; stopping them", file=sys.stderr)
            return True
        return False


def progress_line(rec: dict, first: tuple[float, int]) -> str:
    """One line per interval; the ETA extrapolates the steps seen since the first one."""
    step, total = rec["step"] + 1, rec.get("total_steps", 0)
    seen_at, seen_step = first
    done = step - seen_step
    eta = f"{(time.monotonic() - seen_at) / done * (total - step):5.0f} s" if done > 0 else "    ? s"
    return (f"step {step:>5}/{total}  loss {rec['loss']:.4f}  {rec['samples_per_s']:8.1f} samples/s  "
            f"gen {rec['generation']}  {rec['nodes']} nodes  {rec['num_pipelines']} pipelines "
            f"{rec['pipelines']}  ETA {eta}")


def recovery_line(rec: dict) -> str:
    what = " ".join(filter(None, [f"lost node(s) {rec['lost']}" if rec["lost"] else "",
                                  f"joined node(s) {rec['joined']}" if rec["joined"] else ""]))
    phases = ", ".join(f"{name} {seconds:.2f}" for name, seconds in rec["phases_s"].items())
    return (f"reconfigured -> generation {rec['generation']}: {what} at step {rec['step'] + 1}, "
            f"{rec['total_s']:.2f} s ({phases}), {rec['transfers']} layer copies "
            f"({rec['bytes_moved'] / 2**20:.1f} MiB); " + "; ".join(rec["actions"]))
