"""Fault injection for tests and demos: SIGKILL a whole node at a named phase of a step (or,
with `action=stop`, SIGSTOP the worker alone: a hung worker whose agent keeps the lease).

    OOBLECK_FAULT="node=2,step=7,phase=backward"            one fault
    OOBLECK_FAULT="node=2,step=7,phase=backward;node=0,step=9,phase=commit"

Phases: forward, backward, grad_sync, commit, committed (the step's commit decided, before
anything is done with it), optimizer, bootstrap (a generation that starts at step K is
making its process groups: the default group exists, its subgroups do not), build (its process
groups exist, no layer has moved), transfer (before layers move), transfer_send and
transfer_receive (once this worker has posted its sends, or its receives, of the layer
transfer, before they complete: a sender or a receiver dying mid-transfer), agreement,
restore (while a generation restored from a checkpoint is built), checkpoint (once this worker has written its
layers of the checkpoint after step K, before the checkpoint is published), eval (as the
evaluation after step K begins), grow (a member, as joiners admitted after step K or later
are about to be proposed: it died in its optimizer step), admit (a member, once the record
admitting them has won, before it is built) and finish (with K the run's step count: the run's
last collective is done, its end not yet recorded). grow and admit fire at the first admission at or
after step K, since when a joiner is ready is not known in advance. `action=slow,seconds=S` makes the worker
sleep S seconds each time it reaches the phase of that step (a slow transfer, say);
`action=raise` makes it raise an error each time (a bug: the step fails with every node alive),
`action=glitch` once (a transient error: the same nodes replay the step), `action=term` sends
its agent SIGTERM once (a scheduler stopping the node: the run stops after the step),
`action=hang,seconds=S` stops the whole node (agent and workers) for S seconds once, then wakes
it (a silent failure: no socket closes, the lease stands still). A worker of the
named node that reaches the phase of that step kills its agent's process group (the node) and
itself, like a machine dying: no cleanup, no goodbye. Just before, it records the kill's time
in the membership store (`faults/<node>`, so recovery records can time detection from the real
failure) and, with OOBLECK_FAULT_LOG set, appends it there (JSON lines).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Protocol

import psutil

from oobleck_elastic.errors import ConfigError

__all__ = ["Fault", "parse_faults", "FaultInjector", "KillRecorder", "PHASES"]

ACTIONS = ("kill", "stop", "slow", "raise", "glitch", "term", "hang")
TIMED = ("slow", "hang")  # the actions that take seconds=S
PHASES = ("forward", "backward", "grad_sync", "commit", "committed", "optimizer", "bootstrap", "build", "transfer",
          "transfer_send", "transfer_receive", "agreement", "restore", "checkpoint", "eval", "grow", "admit",
          "finish", "join")
AT_OR_AFTER = ("grow", "admit")  # phases whose step is the earliest one they fire at


class KillRecorder(Protocol):
    """Where a kill is recorded: the run's Liveness (elastic/protocol/liveness.py; duck-typed,
    so this module does not import elastic, which sits above it)."""

    def record_kill(self, node: int, record: dict) -> None: ...


@dataclass(frozen=True)
class Fault:
    node: int
    step: int
    phase: str
    action: str = "kill"
    seconds: float = 0.0


def parse_faults(text: str) -> list[Fault]:
    faults = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        fields = dict(item.split("=", 1) for item in part.split(",") if "=" in item)
        action = fields.get("action", "kill")
        known = {"node", "step", "phase"} <= set(fields) <= {"node", "step", "phase", "action", "seconds"}
        if not known or fields["phase"] not in PHASES or action not in ACTIONS \
                or ("seconds" in fields) != (action in TIMED):
            raise ConfigError(f"OOBLECK_FAULT entry {part!r} must be node=N,step=K,phase=P[,action=A] with P one "
                              f"of {', '.join(PHASES)} and A one of {', '.join(ACTIONS)} (slow and hang take "
                              "seconds=S)")
        faults.append(Fault(int(fields["node"]), int(fields["step"]), fields["phase"], action,
                            float(fields.get("seconds", 0.0))))
    return faults


class FaultInjector:
    """The fault hook of a run with faults to inject (runtime/fault_hook.py's FaultHook): called
    at each phase, it kills this node when a fault matches."""

    def __init__(self, node: int, faults: list[Fault], store: KillRecorder | None = None) -> None:
        self.node = node
        self.faults = [f for f in faults if f.node == node]
        self.store = store

    @classmethod
    def from_environ(cls, node: int, store: KillRecorder | None = None) -> FaultInjector:
        return cls(node, parse_faults(os.environ.get("OOBLECK_FAULT", "")), store)

    def __call__(self, phase: str, step: int) -> None:
        """This worker reached `phase` of `step` (runtime/fault_hook.py says which step a phase
        belongs to)."""
        fault = next((f for f in self.faults if f.phase == phase
                      and (f.step == step or (phase in AT_OR_AFTER and f.step <= step))), None)
        if fault is not None:
            record = {"time": time.time(), "node": self.node, "step": step, "phase": phase}
            if self.store is not None:
                self.store.record_kill(self.node, record)
            log = os.environ.get("OOBLECK_FAULT_LOG")
            if log:  # when the kill happened, for benchmarks/recovery.py
                with open(log, "a") as f:
                    f.write(json.dumps(record) + "\n")
            if fault.action == "slow":  # every time: a replay is as slow
                time.sleep(fault.seconds)
            elif fault.action == "raise":  # every time: a bug in this worker, not a node failure
                raise RuntimeError(f"injected error at {phase} of step {step} on node {self.node}")
            elif fault.action == "glitch":  # once: a transient error, the step is replayed
                self.faults.remove(fault)
                raise RuntimeError(f"injected glitch at {phase} of step {step} on node {self.node}")
            elif fault.action == "term":  # once: what a scheduler sends a node it stops
                self.faults.remove(fault)
                os.kill(_agent(), signal.SIGTERM)
            elif fault.action == "stop":
                self.faults.remove(fault)  # once: after SIGCONT the step is replayed
                os.kill(os.getpid(), signal.SIGSTOP)
            elif fault.action == "hang":
                self.faults.remove(fault)  # once: woken, the node finds itself fenced
                self.hang_node(fault.seconds)
            else:
                self.kill_node()

    @staticmethod
    def kill_node() -> None:
        agent = _agent()
        try:  # the agent's group holds the node's worker starter too, if it has one
            os.killpg(os.getpgid(agent), signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        os.kill(os.getpid(), signal.SIGKILL)


    @staticmethod
    def hang_node(seconds: float) -> None:
        """Stops this node for `seconds`, then wakes it: a silent failure, no socket closes and
        the lease stands still. The node is its agent, this worker's parent (the agent, or the
        node's worker starter) and every descendant of either: each worker has a session of its
        own. A process of its own session sends the SIGCONTs."""
        me, node = os.getpid(), set()
        for root in {_agent(), os.getppid()}:
            try:
                proc = psutil.Process(root)
                node |= {proc.pid, *(p.pid for p in proc.children(recursive=True))}
            except psutil.NoSuchProcess:
                pass
        others = sorted(node - {me})
        waker = (f"import os, signal, time; time.sleep({seconds!r})\n"
                 f"for pid in {[*others, me]!r}:\n"
                 "    try: os.kill(pid, signal.SIGCONT)\n"
                 "    except ProcessLookupError: pass")
        subprocess.Popen([sys.executable, "-c", waker], start_new_session=True, stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for pid in others:
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                pass
        os.kill(me, signal.SIGSTOP)


def _agent() -> int:
    """This worker's agent: its parent, unless the node's worker starter forked it (its
    environment names the agent either way)."""
    return int(os.environ.get("OOBLECK_AGENT_PID", os.getppid()))
