"""The trace simulator: replays a trace against a job, for our runtime and each baseline.

Note: [simulated time]
    Each system trains in steps of its current layout's step time. Between two events the
    steps run back to back (with the system's checkpoint writes when they fall due); an event
    arriving mid-step interrupts it, and the part already done is lost (`lost_s`). The change
    then costs what the system's model says: time not training (`recovery_s`), and, when the
    system falls back to its newest checkpoint, the training done since is thrown away
    (`fallback_s`) and its steps are run again. An event arriving while a system is still
    recovering is handled once it is done. The partition is exact:

        duration = useful + lost + recovery + fallback + checkpoint writes + idle
                   (+ the step still under way when the trace ends)

    so `effective_fraction` (useful / duration) says where the time went, and samples/s is
    the committed steps times the global batch over the duration.

Our runtime is simulated with the planner's own functions, called exactly as the runtime
calls them: `planning.job.plan_job` (templates, and the first generation's `instantiate`, as
elastic/job.py and elastic/run.py do), then on every change `planning.recovery.plan_next` from
the last generation and `transfers_between` for the layer copies (elastic/run.py `_propose`
and `adopt`). With `layouts="per-count"` each (node count, kind of change) is planned once
and its outcome reused: planning is deterministic given its inputs, and which node of a given
count fails changes the layout little, but it is then no longer the exact layout of every
event (use it at scale: at 1,024 nodes one exact change takes ~0.1-0.2 s).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from oobleck_elastic.errors import ConfigError, PlanningError
from oobleck_elastic.planning import Cluster, Instantiation, ModelProfile, TemplateSet, instantiate
from oobleck_elastic.planning.job import JobPlan, plan_job
from oobleck_elastic.planning.recovery import Base, NextLayout, plan_next, transfers_between
from oobleck_elastic.planning.templates import plan_templates
from oobleck_elastic.simulation.baselines import Baselines
from oobleck_elastic.simulation.recovery_cost import RecoveryConstants, transfer_seconds
from oobleck_elastic.simulation.trace import Trace, TraceEvent

__all__ = ["SimJob", "SystemResult", "Change", "simulate", "SYSTEMS", "OobleckModel", "layout_step_model"]

SYSTEMS = ("oobleck", "restart", "redundant", "torchrun")
_BASELINES = Baselines()  # simulate()'s default (frozen, so one instance serves every call)


@dataclass(frozen=True, kw_only=True)
class SimJob:
    """The job every system trains: what the planner needs, plus our runtime's checkpoints."""

    profile: ModelProfile
    cluster: Cluster
    fault_tolerance: int
    global_batch: int
    microbatch: int
    wide: bool = False
    virtual_stages: int = 1
    checkpoint_interval_steps: int = 50
    """Our runtime's checkpoint.interval (steps; 0: none, a fallback restarts from step 0)."""
    checkpoint_write_s: float = 0.0
    """Training stall per checkpoint of our runtime (0: not modelled)."""
    host_cores: int = 0
    """0: every worker has a device of its own (a cluster). K > 0: every worker of the job shares
    one host of K cores (a local CPU job), so a step also takes at least the whole model's
    forward and backward for every microbatch, spread over the K cores."""

    def __post_init__(self) -> None:
        if self.checkpoint_interval_steps < 0:
            raise ConfigError(f"--checkpoint-interval must be >= 0 steps, got {self.checkpoint_interval_steps}")
        if self.checkpoint_write_s < 0:
            raise ConfigError(f"--checkpoint-write must be >= 0 s, got {self.checkpoint_write_s}")
        if self.host_cores < 0:
            raise ConfigError(f"--host-cores must be >= 0, got {self.host_cores}")

    def step_seconds(self, iteration_ms: float) -> float:
        """A step of a layout whose cost-model iteration takes `iteration_ms`, bounded below by
        the shared host's cores."""
        seconds = iteration_ms / 1e3
        if self.host_cores:
            work_ms = self.global_batch // self.microbatch * sum(layer.compute_ms for layer in self.profile.layers)
            seconds = max(seconds, work_ms / 1e3 / self.host_cores)
        return seconds

    def plan(self, nodes: int) -> JobPlan:
        """Templates for `nodes` nodes and the first generation: what the runtime plans."""
        return plan_job(self.profile, self.cluster, nodes=list(range(nodes)), fault_tolerance=self.fault_tolerance,
                        global_batch=self.global_batch, microbatch_size=self.microbatch, wide=self.wide,
                        virtual_stages=self.virtual_stages)


def layout_step_model(job: SimJob) -> Callable[[dict], float | None]:
    """Seconds of one step of a metrics log's generation record (its pipelines' node counts
    and microbatches) by the cost model (`SimJob.step_seconds`), with the templates the runtime
    planned for the first generation's node count: what `fit_constants` subtracts to find the
    step overhead."""
    planned: dict[str, TemplateSet] = {}

    def model(record: dict) -> float | None:
        if "templates" not in planned:
            planned["templates"] = job.plan(len(record["nodes"])).templates
        by_nodes = planned["templates"].by_nodes()
        pipelines = record.get("pipelines", [])
        if not pipelines or any(len(p["nodes"]) not in by_nodes for p in pipelines):
            return None
        return job.step_seconds(max(by_nodes[len(p["nodes"])].iteration_ms_at(p["microbatches"]) for p in pipelines))
    return model


@dataclass(frozen=True, kw_only=True)
class Change:
    """One membership change as our runtime handles it (for tests and the layout check)."""

    time_s: float
    kind: str
    node: int
    layout: NextLayout | None
    """None: no pipeline can be formed from the live nodes; the run fails."""
    transfer_s: float


@dataclass(frozen=True, kw_only=True)
class SystemResult:
    """What one system did with one trace."""

    system: str
    trace: str
    duration_s: float
    steps: int
    samples: int
    samples_per_s: float
    failure_free_samples_per_s: float
    useful_s: float
    lost_s: float
    recovery_s: float
    fallback_s: float
    checkpoint_s: float
    idle_s: float
    recoveries: int
    fallbacks: int
    progress: tuple[tuple[float, float, int], ...]
    """(start, end, steps) of the training that was kept: what a rollback threw away is left out."""
    finished_at: float | None = None
    """With a step goal: when the last step completed."""
    note: str = ""
    changes: tuple[Change, ...] = ()

    @property
    def effective_fraction(self) -> float:
        return self.useful_s / self.duration_s if self.duration_s else 0.0


@dataclass
class _Ledger:
    """One system's clock and accounts (Note: [simulated time])."""

    batch: int
    goal_steps: int | None = None
    free: bool = False
    """Changes cost nothing (the failure-free reference: same node counts, free changes)."""
    t: float = 0.0
    steps: int = 0
    checkpoint_step: int = 0
    since_checkpoint_s: float = 0.0
    useful_s: float = 0.0
    lost_s: float = 0.0
    recovery_s: float = 0.0
    fallback_s: float = 0.0
    checkpoint_s: float = 0.0
    idle_s: float = 0.0
    recoveries: int = 0
    fallbacks: int = 0
    finished_at: float | None = None
    segments: list[list] = field(default_factory=list)
    """[start, end, steps, kept] of each stretch of training."""
    checkpoint_segment: int = 0
    """Segments before this index were saved by the newest checkpoint."""
    last_sink: str = "idle_s"
    """The account the clock last advanced in (what `clip` takes back from)."""

    @property
    def done(self) -> bool:
        return self.finished_at is not None

    def train_until(self, target: float, step_s: float, every_steps: int, every_s: float, write_s: float) -> None:
        """Whole steps until `target` (or the goal), with checkpoints when due."""
        while not self.done and self.t + step_s <= target * (1 + 1e-12):
            n = int(min((target - self.t) / step_s * (1 + 1e-12), 2**62))
            if every_steps:
                n = min(n, every_steps - self.steps % every_steps)
            if every_s:
                n = min(n, max(1, math.ceil((every_s - self.since_checkpoint_s) / step_s - 1e-9)))
            if self.goal_steps is not None:
                n = min(n, self.goal_steps - self.steps)
            n = max(n, 1)
            self.segments.append([self.t, self.t + n * step_s, n, True])
            self.t += n * step_s
            self.steps += n
            self.useful_s += n * step_s
            self.last_sink = "useful_s"
            self.since_checkpoint_s += n * step_s
            if self.goal_steps is not None and self.steps >= self.goal_steps:
                self.finished_at = self.t
                return
            due = ((every_steps and self.steps % every_steps == 0)
                   or (every_s and self.since_checkpoint_s >= every_s - 1e-9))
            if due:
                self.checkpoint(write_s)

    def checkpoint(self, write_s: float) -> None:
        self.t += write_s
        self.checkpoint_s += write_s
        self.last_sink = "checkpoint_s"
        self.checkpoint_step = self.steps
        self.checkpoint_segment = len(self.segments)
        self.since_checkpoint_s = 0.0

    def interrupt(self, at: float) -> None:
        """The step under way when a failure hits at `at` is lost."""
        if self.free:
            return
        if at > self.t:
            self.lost_s += at - self.t
            self.t = at

    def pause(self, seconds: float) -> None:
        if self.free:
            return
        self.t += seconds
        self.recovery_s += seconds
        self.recoveries += 1
        self.last_sink = "recovery_s"

    def idle_until(self, target: float) -> None:
        if target > self.t:
            self.idle_s += target - self.t
            self.t = target
            self.last_sink = "idle_s"

    def clip(self, end: float) -> None:
        """A recovery or checkpoint still under way at the end of the trace counts up to it."""
        if self.t > end and self.finished_at is None:
            setattr(self, self.last_sink, getattr(self, self.last_sink) - (self.t - end))
            self.t = end

    def rollback(self) -> None:
        """Back to the newest checkpoint: the training since is thrown away."""
        if self.free:
            return
        self.useful_s -= self.since_checkpoint_s
        self.fallback_s += self.since_checkpoint_s
        self.steps = self.checkpoint_step
        self.since_checkpoint_s = 0.0
        self.fallbacks += 1
        for segment in self.segments[self.checkpoint_segment:]:
            segment[3] = False


class _System:
    """A system under simulation: its step time and what each change costs it."""

    name = ""
    loses_partial_step = True
    restarts_on_add = False

    def __init__(self, nodes: int) -> None:
        self.live = set(range(nodes))
        self.step_s: float | None = None
        self.every_steps = 0
        self.every_s = 0.0
        self.write_s = 0.0
        self.note = ""

    def remove(self, node: int, ledger: _Ledger) -> None:
        raise NotImplementedError

    def add(self, node: int, ledger: _Ledger) -> None:
        raise NotImplementedError

    def advance(self, ledger: _Ledger, target: float) -> None:
        if self.step_s is None:
            ledger.idle_until(target)
        else:
            ledger.train_until(target, self.step_s, self.every_steps, self.every_s, self.write_s)


class OobleckModel(_System):
    """Our runtime: the planner's own functions on every change (module docstring)."""

    name = "oobleck"

    def __init__(self, job: SimJob, plan: JobPlan, constants: RecoveryConstants, nodes: int,
                 layouts: str = "exact", cache: dict | None = None) -> None:
        super().__init__(nodes)
        self.job, self.templates, self.constants = job, plan.templates, constants
        self.inst: Instantiation | None = plan.instantiation
        self.generation = 0
        self.every_steps, self.write_s = job.checkpoint_interval_steps, job.checkpoint_write_s
        # (node count, change) -> its outcome, shared by the runs of one simulation
        self.cache: dict[tuple[int, str], tuple[NextLayout | None, float]] | None = None
        if layouts == "per-count":
            self.cache = {} if cache is None else cache.setdefault(("oobleck layouts", id(plan.templates)), {})
        self.changes: list[Change] = []
        self.keep_changes = layouts == "exact"
        self._set_step()

    def _set_step(self) -> None:
        self.step_s = (None if self.inst is None
                       else self.job.step_seconds(self.inst.iteration_ms) + self.constants.step_overhead_s)

    def _next(self, alive: list[int], dead: list[int], step: int,
              checkpoint_step: int) -> tuple[NextLayout | None, float]:
        base = Base(self.generation, self.inst) if self.inst is not None else None
        try:
            layout = plan_next(self.templates, base, alive=alive, dead=dead, step=step,
                               checkpoint=lambda: checkpoint_step, global_batch=self.job.global_batch,
                               microbatch=self.job.microbatch)
        except PlanningError:
            return None, 0.0
        before = None if layout.base is None else self.inst
        transfers = transfers_between(self.templates, before, layout.instantiation)
        return layout, transfer_seconds(transfers, self.job.cluster.inter_node_bandwidth)

    def _change(self, kind: str, node: int, ledger: _Ledger) -> None:
        alive = sorted(self.live)
        dead = [node] if kind == "remove" else []
        key = (len(alive) + (1 if kind == "remove" else -1), kind)
        if self.cache is not None and key in self.cache:
            layout, transfer_s = self.cache[key]
        else:
            layout, transfer_s = self._next(alive, dead, ledger.steps, ledger.checkpoint_step)
            if self.cache is not None:
                self.cache[key] = (layout, transfer_s)
        if self.keep_changes:
            self.changes.append(Change(time_s=ledger.t, kind=kind, node=node, layout=layout, transfer_s=transfer_s))
        if layout is None:
            self.inst = None
            self.note = f"the run failed at {ledger.t:.0f} s: no pipeline fits the {len(alive)} live node(s)"
            self._set_step()
            return
        if self.cache is not None:  # the cached outcome's nodes stand for the live ones
            self.live = set(layout.instantiation.nodes)
        self.inst, self.generation = layout.instantiation, self.generation + 1
        if layout.restored_from is not None:
            ledger.pause(self.constants.fallback_s())
            ledger.rollback()
        else:
            ledger.pause(self.constants.in_memory_s(transfer_s, detect=kind == "remove"))
        self._set_step()

    def remove(self, node: int, ledger: _Ledger) -> None:
        self.live.discard(node)
        if self.inst is not None:
            self._change("remove", node, ledger)

    def add(self, node: int, ledger: _Ledger) -> None:
        if self.step_s is not None:
            # admitted at the next step boundary: the step under way completes
            ledger.train_until(ledger.t + self.step_s, self.step_s, self.every_steps, 0.0, self.write_s)
        self.live.add(node)
        if self.inst is not None:
            self._change("add", node, ledger)


class _Replanned(_System):
    """A baseline that restarts on the live nodes with the fastest fresh layout (>= 1 pipeline)."""

    def __init__(self, job: SimJob, templates: TemplateSet, nodes: int, times: dict, slowdown: float = 0.0) -> None:
        super().__init__(nodes)
        self.job, self.templates, self.slowdown = job, templates, slowdown
        self._times = times  # (templates, node count) -> seconds per step: shared by every run of a simulation
        self._set_step()

    def _set_step(self) -> None:
        key = (id(self.templates), len(self.live))
        if key not in self._times:
            try:
                inst = instantiate(self.templates, sorted(self.live), self.job.global_batch, self.job.microbatch,
                                   min_pipelines=1)
                self._times[key] = self.job.step_seconds(inst.iteration_ms)
            except PlanningError:
                self._times[key] = None
        seconds = self._times[key]
        self.step_s = None if seconds is None else seconds * (1 + self.slowdown)


class _Restart(_Replanned):
    name = "restart"
    restarts_on_add = True

    def __init__(self, job: SimJob, templates: TemplateSet, nodes: int, times: dict, restart_s: float,
                 cfg, rollback_on_join: bool) -> None:
        super().__init__(job, templates, nodes, times)
        self.restart_s, self.write_s = restart_s, cfg.checkpoint_write_s
        self.every_steps, self.every_s = cfg.checkpoint_interval_steps, cfg.checkpoint_interval_s
        self.rollback_on_join = rollback_on_join

    def remove(self, node: int, ledger: _Ledger) -> None:
        self.live.discard(node)
        ledger.pause(self.restart_s)
        ledger.rollback()
        self._set_step()

    def add(self, node: int, ledger: _Ledger) -> None:
        self.live.add(node)
        if self.rollback_on_join:
            ledger.pause(self.restart_s)
            ledger.rollback()
        else:  # a planned restart: checkpoint first, lose nothing
            if not ledger.free:
                ledger.checkpoint(self.write_s)
            ledger.pause(self.restart_s)
        self._set_step()


class _Redundant(_Replanned):
    name = "redundant"
    loses_partial_step = False

    def __init__(self, job: SimJob, templates: TemplateSet, nodes: int, times: dict, cfg) -> None:
        super().__init__(job, templates, nodes, times, slowdown=cfg.slowdown)
        self.cfg, self.write_s = cfg, cfg.checkpoint_write_s
        self.every_steps, self.every_s = cfg.checkpoint_interval_steps, cfg.checkpoint_interval_s
        self.protected_at = 0.0

    def remove(self, node: int, ledger: _Ledger) -> None:
        self.live.discard(node)
        if ledger.t < self.protected_at:  # the shadow of this failure is not rebuilt yet
            ledger.pause(self.cfg.restart_s)
            ledger.rollback()
        else:
            ledger.pause(self.cfg.failover_s)
        self.protected_at = ledger.t + self.cfg.reprotect_s
        self._set_step()

    def add(self, node: int, ledger: _Ledger) -> None:
        self.live.add(node)
        ledger.pause(self.cfg.failover_s)
        self.protected_at = ledger.t + self.cfg.reprotect_s
        self._set_step()


def _pick(system: _System, event: TraceEvent, rng: random.Random, next_id: list[int], exact: bool) -> int:
    if event.kind == "add":
        node = event.node if event.node is not None else next_id[0]
        if exact and node in system.live:
            raise ConfigError(f"the trace adds node {node} at {event.time_s:g} s, but it is live already")
        next_id[0] = max(next_id[0], node + 1)
        return node
    if not system.live:
        raise ConfigError(f"the trace removes a node at {event.time_s:g} s, but no node is left")
    if event.node is None or not exact:
        return rng.choice(sorted(system.live))
    if event.node not in system.live:
        raise ConfigError(f"the trace removes node {event.node} at {event.time_s:g} s, but it is not live "
                          f"(live: {sorted(system.live)[:10]}{'...' if len(system.live) > 10 else ''})")
    return event.node


def _replay(system: _System, trace: Trace, batch: int, seed: int, goal_steps: int | None, exact: bool,
            free: bool = False) -> _Ledger:
    ledger = _Ledger(batch=batch, goal_steps=goal_steps, free=free)
    rng = random.Random(seed)
    next_id = [trace.nodes]
    end = math.inf if goal_steps is not None else trace.duration_s
    for event in trace.events:
        if event.time_s >= end or ledger.t >= end:
            break
        system.advance(ledger, event.time_s)
        if ledger.done:
            break
        node = _pick(system, event, rng, next_id, exact)
        if event.kind == "remove":
            if system.loses_partial_step and system.step_s is not None:
                ledger.interrupt(event.time_s)
            system.remove(node, ledger)
        else:
            if system.restarts_on_add and system.step_s is not None:
                ledger.interrupt(event.time_s)
            system.add(node, ledger)
    if goal_steps is not None and system.step_s is None:
        raise ConfigError(f"{system.name} cannot train on the nodes the trace leaves, so it never reaches "
                          f"{goal_steps} steps; add nodes to the trace or drop --steps")
    if not ledger.done:
        system.advance(ledger, end)
        ledger.clip(end)
    return ledger


def _result(system: _System, trace: Trace, ledger: _Ledger, free: _Ledger | None, batch: int) -> SystemResult:
    duration = ledger.finished_at if ledger.finished_at is not None else trace.duration_s
    free_rate = free.steps * batch / trace.duration_s if free is not None else 0.0
    changes = tuple(getattr(system, "changes", ()))
    return SystemResult(system=system.name, trace=trace.name, duration_s=duration, steps=ledger.steps,
                        samples=ledger.steps * batch,
                        samples_per_s=ledger.steps * batch / duration if duration else 0.0,
                        failure_free_samples_per_s=free_rate, useful_s=ledger.useful_s, lost_s=ledger.lost_s,
                        recovery_s=ledger.recovery_s, fallback_s=ledger.fallback_s, checkpoint_s=ledger.checkpoint_s,
                        idle_s=ledger.idle_s, recoveries=ledger.recoveries, fallbacks=ledger.fallbacks,
                        progress=tuple((a, b, n) for a, b, n, kept in ledger.segments if kept),
                        finished_at=ledger.finished_at, note=system.note, changes=changes)


def _systems(job: SimJob, plan: JobPlan, nodes: int, constants: RecoveryConstants, baselines: Baselines,
             names: Sequence[str], layouts: str, cache: dict) -> list[_System | str]:
    out: list[_System | str] = []
    times = cache.setdefault("step_s", {})
    for name in names:
        if name == "oobleck":
            out.append(OobleckModel(job, plan, constants, nodes, layouts, cache))
        elif name == "restart":
            restart = baselines.restart
            out.append(_Restart(job, plan.templates, nodes, times, restart.restart_s, restart,
                                rollback_on_join=False))
        elif name == "torchrun":
            torchrun = baselines.torchrun
            system = _Restart(job, plan.templates, nodes, times, torchrun.restart_s + torchrun.checkpoint_read_s,
                              torchrun, rollback_on_join=True)
            system.name = "torchrun"
            out.append(system)
        elif name == "redundant":
            out.append(_redundant(job, nodes, baselines, cache))
        else:
            raise ConfigError(f"unknown system {name!r}; choose from {', '.join(SYSTEMS)}")
    return out


def _redundant(job: SimJob, nodes: int, baselines: Baselines, cache: dict) -> _System | str:
    """The Bamboo-like system, or why it cannot hold the model (a string)."""
    cfg = baselines.redundant
    key = ("redundant templates", nodes, cfg.memory_factor)
    if key not in cache:
        cluster = replace(job.cluster, memory_per_worker=int(job.cluster.memory_per_worker / cfg.memory_factor))
        try:
            cache[key] = plan_templates(job.profile, cluster, max_nodes=nodes, fault_tolerance=0,
                                        total_microbatches=job.global_batch // job.microbatch, wide=job.wide,
                                        virtual_stages=job.virtual_stages)
        except PlanningError as exc:
            cache[key] = f"does not fit with {cfg.memory_factor:g}x model state per worker: {exc}"
    if isinstance(cache[key], str):
        return cache[key]
    return _Redundant(job, cache[key], nodes, cache.setdefault("step_s", {}), cfg)


def _unfit(name: str, trace: Trace, why: str) -> SystemResult:
    return SystemResult(system=name, trace=trace.name, duration_s=trace.duration_s, steps=0, samples=0,
                        samples_per_s=0.0, failure_free_samples_per_s=0.0, useful_s=0.0, lost_s=0.0, recovery_s=0.0,
                        fallback_s=0.0, checkpoint_s=0.0, idle_s=trace.duration_s, recoveries=0, fallbacks=0,
                        progress=(), note=why)


def simulate(job: SimJob, trace: Trace, constants: RecoveryConstants, *, baselines: Baselines = _BASELINES,
             systems: Sequence[str] = SYSTEMS, seed: int = 0, layouts: str = "exact",
             goal_steps: int | None = None, plan: JobPlan | None = None,
             cache: dict | None = None) -> list[SystemResult]:
    """Every system on `trace`, each beside its failure-free reference: the same system on the
    same node counts over time with changes that cost nothing (so the reference shows the
    capacity the trace leaves, and the gap to it what the changes cost)."""
    if layouts not in ("exact", "per-count"):
        raise ConfigError(f"--layouts must be exact or per-count, got {layouts!r}")
    plan = plan or job.plan(trace.nodes)
    cache = {} if cache is None else cache  # planning shared by the runs of one job: pass it on to reuse it
    results = []
    for run, free in zip(_systems(job, plan, trace.nodes, constants, baselines, systems, layouts, cache),
                         _systems(job, plan, trace.nodes, constants, baselines, systems, layouts, cache)):
        if isinstance(run, str):
            results.append(_unfit("redundant", trace, run))
            continue
        assert not isinstance(free, str), "the reference is the same system"
        ledger = _replay(run, trace, job.global_batch, seed, goal_steps, layouts == "exact")
        free_ledger = _replay(free, trace, job.global_batch, seed, None, layouts == "exact", free=True)
        results.append(_result(run, trace, ledger, free_ledger, job.global_batch))
    return results
