"""A chaos run: a local job while a seeded schedule injects failures from outside the nodes
(signals to a node's process group, as a machine dying or hanging would; no in-process
injector), and the report of what it survived.

Kinds of failure, drawn at random moments (so every phase of a step and of a recovery gets
hit), each on members of the current generation:
    kill              one node SIGKILLed
    kill_in_recovery  one node SIGKILLed, a second one 0.1-0.8 s later: during the recovery
    kill_two          two nodes SIGKILLed within a second (more than f = 1 may be lost at once:
                      the checkpoint fallback where no replica is left)
    hang              one node SIGSTOPped past its lease, then woken: it must fence itself
A replacement node is started after each loss, injected or not (a node fenced after being
taken for dead leaves on its own), so the job keeps its size and joins are exercised too. The
schedule never leaves fewer than `min_alive` members.

Then the comparison with a failure-free run of the same script, alone: every logged step's loss
against the reference's loss of that step, and the final weights tensor by tensor; and the
processes of the run left behind.
"""

from __future__ import annotations

import math
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

import psutil
import torch

from oobleck_elastic.elastic.process import run_id_of
from oobleck_elastic.errors import OobleckError
from oobleck_elastic.launcher.local_job import LocalNodes
from oobleck_elastic.monitoring.metrics import read_records
from oobleck_elastic.runtime.checkpoint import load_model_state, read_manifest

__all__ = ["KINDS", "LOSS_RTOL", "WEIGHTS_RTOL", "ChaosConfig", "ChaosSchedule", "Injection", "ChaosReport",
           "chaos_report", "compare_losses", "compare_weights", "job_args", "orphans", "reference_run"]

# Float64 runs on different layouts sum each gradient in a different order, and training
# amplifies that rounding over steps (measured here: 1e-13 after 1,300 steps, 2.5e-8 after
# 4,500 for the chaos run and the failure-free 5-node run alike). A sample used twice or not at
# all moves its step's loss by ~1e-3 and the weights by ~1e-4; a lost update more. The bounds
# sit between the two, two orders of magnitude from each.
LOSS_RTOL = 1e-7
WEIGHTS_RTOL = 1e-6

KINDS = ("kill", "kill_in_recovery", "kill_two", "hang")


@dataclass(frozen=True, kw_only=True)
class ChaosConfig:
    """A chaos schedule."""

    seed: int = 0
    nodes: int = 4
    """The job's size, kept by starting a replacement after each loss."""
    mean_interval_s: float = 8.0
    """Mean time between two injections (exponentially distributed)."""
    weights: tuple[float, ...] = (5.0, 1.0, 1.0, 1.0)
    """Relative frequency of each kind, in KINDS order."""
    hang_s: float = 6.0
    """How long a hung node stays stopped (more than its lease, so it is taken for dead)."""
    replace_after_s: float = 1.0
    """A replacement node starts this long after a node was lost."""
    min_alive: int = 2
    """Members the schedule always leaves alive."""
    timeout_s: float = 3600.0
    """The whole run's limit: past it, the run counts as hung and is stopped."""

    def __post_init__(self) -> None:
        if self.nodes < self.min_alive + 1:
            raise ValueError(f"chaos needs at least {self.min_alive + 1} nodes to fail one, got {self.nodes}")
        if len(self.weights) != len(KINDS) or min(self.weights) < 0 or not sum(self.weights):
            raise ValueError(f"weights are one non-negative number per kind {KINDS}, got {self.weights}")
        if self.mean_interval_s <= 0 or self.hang_s <= 0:
            raise ValueError("mean_interval_s and hang_s must be > 0")


@dataclass(frozen=True)
class Injection:
    """One failure injected: when (wall time), what, which node ids, after which step."""

    time: float
    kind: str
    nodes: tuple[int, ...]
    step: int


@dataclass
class ChaosSchedule:
    """Called on every turn of the local job's loop (`run_local_job(..., tick=schedule)`)."""

    cfg: ChaosConfig
    injections: list[Injection] = field(default_factory=list)
    timed_out: bool = False

    def __post_init__(self) -> None:
        self.rng = random.Random(self.cfg.seed)
        self.next_at: float | None = None
        self.pending: list[tuple[float, str, int]] = []  # (when, kind, k): follow-up kills and wake-ups
        self.lost_at: list[float] = []  # when each node was lost, for its replacement
        self.killed: set[int] = set()  # k of nodes killed or hung (not to be picked again)
        self.deadline = time.monotonic() + self.cfg.timeout_s

    def __call__(self, local: LocalNodes) -> None:
        now = time.monotonic()
        if now > self.deadline:
            self.timed_out = True
            raise KeyboardInterrupt  # the job's loop kills every node and reports the job unfinished
        progress = local.protocol.progress()
        if progress is None:
            return  # not training yet: nothing to interrupt
        for item in [p for p in self.pending if p[0] <= now]:
            self.pending.remove(item)
            _, kind, k = item
            if kind == "wake":  # it finds itself fenced and leaves, or, not taken for dead, trains on
                local.signal(k, signal.SIGCONT)
                self.killed.discard(k)
            else:
                self._fail(local, kind, [k], progress["step"], follow_up=True)
        # a node that left on its own (fenced after being taken for dead on a loaded machine, or
        # a run-time error) is replaced too, or the job shrinks until nothing can be injected
        alive = len([k for k in local.running() if k not in self.killed])
        self.lost_at += [now] * max(0, self.cfg.nodes - alive - len(self.lost_at))
        while self.lost_at and now - self.lost_at[0] >= self.cfg.replace_after_s:
            self.lost_at.pop(0)
            local.start()
        if self.next_at is None:
            self.next_at = now + self.rng.expovariate(1.0 / self.cfg.mean_interval_s)
        if now < self.next_at or self.pending:
            return
        self.next_at = now + self.rng.expovariate(1.0 / self.cfg.mean_interval_s)
        kind = self.rng.choices(KINDS, weights=self.cfg.weights)[0]
        members = self._members(local)
        victims = 2 if kind in ("kill_in_recovery", "kill_two") else 1
        if len(members) - victims < self.cfg.min_alive:
            return  # too few left: wait for the replacements
        chosen = self.rng.sample(members, victims)
        if kind == "kill_in_recovery":
            self.pending.append((now + self.rng.uniform(0.1, 0.8), kind, chosen[1]))
            self.killed.add(chosen[1])
            chosen = chosen[:1]
        elif kind == "kill_two":
            self.pending.append((now + self.rng.uniform(0.0, 1.0), kind, chosen[1]))
            self.killed.add(chosen[1])
            chosen = chosen[:1]
        self._fail(local, kind, chosen, progress["step"])

    def _members(self, local: LocalNodes) -> list[int]:
        """Running nodes (by k) that are members of the current generation, not yet failed."""
        try:
            current = set(local.protocol.current(5.0).nodes)
        except (OobleckError, RuntimeError):  # the store busy or a record mid-write: try at the next turn
            return []
        return [k for k in local.running() if k not in self.killed and local.node_id(k) in current]

    def _fail(self, local: LocalNodes, kind: str, ks: list[int], step: int, follow_up: bool = False) -> None:
        now = time.monotonic()
        for k in ks:
            node = local.node_id(k)
            if kind == "hang":
                local.signal(k, signal.SIGSTOP)
                self.pending.append((now + self.cfg.hang_s, "wake", k))
            else:
                local.signal(k, signal.SIGKILL)
            self.killed.add(k)
            self.lost_at.append(now)
            self.injections.append(Injection(time.time(), kind, (node,) if node is not None else (), step))
            print(f"chaos: {kind}{' (second)' if follow_up else ''}: node {node} after step {step}", flush=True)


@dataclass(frozen=True)
class ChaosReport:
    """What a chaos run survived, from its injections and its metrics log."""

    injected: dict[str, int]
    nodes_failed: int
    recoveries_in_memory: int
    fallbacks: int
    lost_s: tuple[float, ...]
    """Per injection: from it to the next completed step."""
    steps_redone: int
    steps: int
    final: dict | None

    def lines(self) -> list[str]:
        kinds = ", ".join(f"{kind} {n}" for kind, n in self.injected.items() if n)
        lost = (f"median {statistics.median(self.lost_s):.2f} s, max {max(self.lost_s):.2f} s"
                if self.lost_s else "n/a")
        return [f"failures injected: {sum(self.injected.values())} ({kinds or 'none'}); nodes failed: "
                f"{self.nodes_failed}",
                f"recovered in memory: {self.recoveries_in_memory}; checkpoint fallbacks: {self.fallbacks}",
                f"time lost per failure (injection -> next completed step): {lost}",
                f"steps redone: {self.steps_redone} of {self.steps} steps"]


def chaos_report(injections: list[Injection], metrics_path: str) -> ChaosReport:
    records = read_records(metrics_path, missing_ok=True)  # missing: the run never trained a step
    steps = [r for r in records if "event" not in r]
    recoveries = [r for r in records if r.get("event") == "recovery" and r.get("lost")]  # not joins
    lost = []
    for inj in injections:
        after = [r["time"] for r in steps if r["time"] > inj.time]
        if after:
            lost.append(min(after) - inj.time)
    injected = {kind: sum(1 for i in injections if i.kind == kind) for kind in KINDS}
    # a follow-up (the second node of kill_in_recovery or kill_two) is part of its injection
    for kind in ("kill_in_recovery", "kill_two"):
        injected[kind] = math.ceil(injected[kind] / 2)
    finals = [r for r in records if r.get("event") == "final"]
    return ChaosReport(injected=injected, nodes_failed=len(injections),
                       recoveries_in_memory=sum(1 for r in recoveries if r.get("restored_from") is None),
                       fallbacks=sum(1 for r in recoveries if r.get("restored_from") is not None),
                       lost_s=tuple(lost), steps_redone=len(steps) - len({r["step"] for r in steps}),
                       steps=len({r["step"] for r in steps}), final=finals[-1] if finals else None)


# --- the comparison with a failure-free run -----------------------------------------------------

def job_args(script_args: list[str], out: str, name: str) -> list[str]:
    """The script's arguments with the record's paths under `out`/`name` and no resume."""
    paths = {"monitoring.metrics_path": f"{out}/{name}/metrics.jsonl",
             "monitoring.tensorboard_dir": f"{out}/{name}/tb", "checkpoint.dir": f"{out}/{name}/checkpoints"}
    return [*script_args, *(a for k, v in paths.items() for a in ("--set", f"{k}={v}")),
            "--set", "checkpoint.resume=never"]


def orphans(run_id: str) -> list[int]:
    found = []
    for proc in psutil.process_iter():
        try:
            if run_id_of(proc) == run_id and proc.pid != os.getpid():
                found.append(proc.pid)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return found


def reference_run(script: str, args: list[str], out: str) -> None:
    """The failure-free run: the same script, alone (one process trains the whole job)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OOBLECK_")}
    proc = subprocess.run([sys.executable, script, *args], env=env, capture_output=True, text=True, timeout=7200)
    if proc.returncode != 0:
        raise OobleckError(f"the failure-free reference run failed:\n{proc.stderr[-2000:]}")


def _relative(diff: float, scale: float) -> float:
    return diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)


def compare_losses(records: list[dict], reference: list[dict]) -> tuple[int, float, int | None]:
    """(step records compared, largest relative loss difference, its step): every step the run
    logged, including those later redone, against the reference's record of that step."""
    theirs = {r["step"]: r["loss"] for r in reference if "event" not in r and "loss" in r}
    diffs = [(_relative(abs(r["loss"] - theirs[r["step"]]), abs(theirs[r["step"]])) if r["step"] in theirs
              else math.inf, r["step"]) for r in records if "event" not in r and "loss" in r]
    worst, at = max(diffs, default=(0.0, None))
    return len(diffs), worst, at


def compare_weights(job_dir: str, ref_dir: str, final: dict | None, reference: dict | None) -> tuple[float, str]:
    """(largest relative difference, what was compared): both checkpoints of the last step, per
    tensor ||ours - theirs|| / ||theirs||. A run must end with its last step's checkpoint
    published, so a missing one is a failure of the run (infinite difference), not a reason to
    compare something weaker."""
    if final is None or reference is None or final.get("steps") != reference.get("steps"):
        return math.inf, "the runs' final records differ in length or are missing"
    step = final["steps"]
    try:
        layers = read_manifest(job_dir, step)["layers"]
    except (OSError, ValueError) as exc:
        return math.inf, f"the run's checkpoint of its last step {step} is missing or unreadable ({exc})"
    try:
        read_manifest(ref_dir, step)
    except (OSError, ValueError) as exc:
        return math.inf, f"the failure-free run's checkpoint of step {step} is missing or unreadable ({exc})"
    ours, theirs = load_model_state(job_dir, step, layers), load_model_state(ref_dir, step, layers)
    if ours.keys() != theirs.keys():
        return math.inf, f"the checkpoints of step {step} hold different tensors"
    worst = 0.0
    for name, t in theirs.items():
        if t.is_floating_point():
            a, b = ours[name].double(), t.double()
            worst = max(worst, _relative(torch.linalg.vector_norm(a - b).item(), torch.linalg.vector_norm(b).item()))
        elif not torch.equal(ours[name], t):
            worst = math.inf
    return worst, f"each tensor of the checkpoints of step {step}"
