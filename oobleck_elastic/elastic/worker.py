"""A training worker under the oobleck agent: joins the run, plans, trains, reports.

Every worker reads the same generation record and the same profile (measured once, by the
first worker of the first node, and published in the store), so all compute the same plan.
Global rank 0 writes the metrics log, TensorBoard and the progress record.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import signal
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from oobleck_elastic.config import JobConfig
from oobleck_elastic.errors import ConfigError, LayersLostError, OobleckError, PlanningError
from oobleck_elastic.elastic.checkpoints import RunCheckpoints
from oobleck_elastic.testing.faults import FaultInjector
from oobleck_elastic.elastic.process import check_lease, stop_or_die, watch_parent
from oobleck_elastic.elastic.membership import (
    Fenced,
    LeaseWatcher,
    check_same_job,
    StepAborted,
    commit_step,
    current_generation,
    decide_abort,
    propose_generation,
    report_ready,
    request_stop,
    roll_call,
)
from oobleck_elastic.elastic.store import MembershipStore, connect_store, host_store
from oobleck_elastic.monitoring.run_report import RunReport
from oobleck_elastic.planning import (
    Instantiation,
    ModelProfile,
    TemplateSet,
    WorkerRef,
    check_instantiation,
    fresh_layout,
    instantiate,
    layer_holders,
    plan_templates,
    plan_transfers,
    reconfigure,
)
from oobleck_elastic.planning.job import make_cluster
from oobleck_elastic.planning.values import from_jsonable, to_jsonable
from oobleck_elastic.runtime.checkpoint import plain
from oobleck_elastic.runtime.model import DTYPES, ModelSpec, model_fingerprint
from oobleck_elastic.runtime.plan import GenerationPlan
from oobleck_elastic.runtime.profiler import load_or_profile
from oobleck_elastic.runtime.trainer import Dataset, Trainer

__all__ = ["WorkerEnv", "run_worker"]

logger = logging.getLogger(__name__)

MAX_REPLAYS_WITHOUT_LOSS = 3


@dataclass(frozen=True)
class WorkerEnv:
    """What the agent tells a worker through its environment."""

    store_url: str
    run_id: str
    node: int
    local_rank: int
    local_world_size: int

    @classmethod
    def from_environ(cls) -> WorkerEnv | None:
        if "OOBLECK_STORE" not in os.environ:
            return None
        return cls(store_url=os.environ["OOBLECK_STORE"], run_id=os.environ["OOBLECK_RUN_ID"],
                   node=int(os.environ["OOBLECK_NODE_ID"]), local_rank=int(os.environ["LOCAL_RANK"]),
                   local_world_size=int(os.environ["LOCAL_WORLD_SIZE"]))


class RunFinished(Exception):
    """The run ended while this worker waited to join it: nothing is left to do."""


def _flatten(prefix: str, value: object) -> dict[str, object]:
    if isinstance(value, dict):
        return {k: v for key, sub in value.items() for k, v in _flatten(f"{prefix}.{key}", sub).items()}
    return {prefix: value}


def _profile(store: MembershipStore, env: WorkerEnv, first_node: int, model: ModelSpec, cfg: JobConfig) -> ModelProfile:
    if env.node == first_node and env.local_rank == 0:
        profile, _ = load_or_profile(model, directory=cfg.planner.profile_dir,
                                     microbatch_size=cfg.train.microbatch_size, dtype=cfg.train.dtype,
                                     seed=cfg.train.seed, iterations=cfg.planner.profile_iterations,
                                     optimizer=cfg.train.optimizer)
        store.set_json("profile", to_jsonable(profile))
        return profile
    return from_jsonable(ModelProfile, store.get_json("profile", cfg.elastic.join_timeout_s))


class _Run:
    """One worker's view of the run across generations: plans, trains, recovers.

    Every generation record in the store carries its instantiation and its `base`: the last
    generation every member finished building, from which it was reconfigured. So all workers
    derive the same transfers, and a generation whose build failed part-way (a node died while
    layers were moving) is skipped: the next one is planned from its base again.
    """

    def __init__(self, model: ModelSpec, dataset: Dataset, cfg: JobConfig, env: WorkerEnv,
                 store: MembershipStore, fault: FaultInjector | None, eval_dataset: Dataset | None = None) -> None:
        self.model, self.cfg, self.env, self.store = model, cfg, env, store
        self.me = WorkerRef(env.node, env.local_rank)
        self.fault = fault
        self.watcher = LeaseWatcher(store, cfg.elastic.lease_timeout_s)
        self.trainer = Trainer(model=model, dataset=dataset, cfg=cfg, me=self.me, store=store.torch_store(),
                               fault=fault, eval_dataset=eval_dataset)
        self.evaluated: int | None = None  # the step after which this worker last evaluated
        self.report: RunReport | None = None
        self.templates: TemplateSet | None = None
        self.plan: GenerationPlan | None = None
        self.records: dict[int, dict] = {}
        self.last_transfers: list = []
        self.failed_at: float | None = None
        self.max_nodes: int | None = None  # the job's limit on nodes, read once at the start
        self.retries: dict[int, int] = {}  # step -> replays after failures in which no node was lost
        self.fingerprint = model_fingerprint(model, DTYPES[cfg.train.dtype])
        self.checkpoints = RunCheckpoints(model, cfg, env.run_id, len(dataset),
                                          f"node {env.node} rank {env.local_rank}", store, fault)
        self.stop_requested = False  # set by SIGTERM in a worker running alone (run_worker)
        self.stopped = False  # a committed stop: the final checkpoint is written, the run ends
        self.last_error: str | None = None  # the traceback of the last failure, as text
        self.last_step: tuple | None = None  # (stats, plan) of the last committed step

    def _job(self) -> dict[str, object]:
        """What every node of the run must agree on (flat dotted keys, JSON values)."""
        cfg = self.cfg
        sections = {"train": cfg.train, "data": cfg.data, "planner": cfg.planner, "checkpoint": cfg.checkpoint,
                    "eval": cfg.eval}
        flat = {"model.fingerprint": f"{self.model.name}:{self.fingerprint}", "fault_tolerance": cfg.fault_tolerance}
        for name, section in sections.items():
            flat.update(_flatten(name, plain(section)))
        for local in ("planner.profile_dir", "planner.profile_iterations", "checkpoint.dir"):
            del flat[local]  # a machine's own paths and its profiling effort may differ
        return flat

    def start(self) -> None:
        check_same_job(self.store, self._job())
        record = self.store.get_json("generation", self.cfg.elastic.join_timeout_s)
        self.max_nodes = (self.store.try_get_json("limits") or {}).get("max_nodes")  # written before it
        first = self.store.try_get_json("generation/0") or record
        nodes = first["nodes"]
        profile = _profile(self.store, self.env, min(nodes), self.model, self.cfg)
        cluster = make_cluster(self.cfg.planner, profile, self.env.local_world_size)
        self.templates = plan_templates(profile, cluster, max_nodes=len(nodes),
                                        fault_tolerance=self.cfg.fault_tolerance,
                                        total_microbatches=self.cfg.train.num_microbatches,
                                        virtual_stages=self.cfg.train.stages_per_worker)
        # Note: [frozen heap] Each teardown runs gc.collect() so that nothing of the old
        # generation keeps its gloo sockets open (generation.py). With torch imported a full
        # collection scans ~1e6 objects (0.4 s here, most of a recovery); freezing what exists
        # now (imports, config, plans; no layers or groups yet) leaves only objects created
        # since for each collection to scan (< 1 ms).
        gc.collect()
        gc.freeze()
        # the rendezvous's bare record of the first members stays the pointer until the first
        # change: a node not among them joins, however the pointer reads
        if record["generation"] == 0 and "instantiation" not in record and self.me.node in nodes:
            if (self.env.node, self.env.local_rank) == (min(nodes), 0):
                self.store.create_json("generation/0", self._first_record(record, nodes))
            first = self._wait_first_record()
            self.checkpoints.note_first(first)
            failure = self._adopt(first)
        else:
            self.checkpoints.note_first(self.store.try_get_json("generation/0") or {})
            failure = self._join()
        if failure:  # a node died while the first generation (or this joiner's) was built
            self.recover(failure)

    def _first_record(self, record: dict, nodes: list[int]) -> dict:
        """Generation 0, by the first worker of the first node: its instantiation, and the
        checkpoint it resumes from (checkpoint.resume) if any. A checkpoint that cannot be
        resumed is published as `start_error`, so every worker fails with the same line."""
        inst = instantiate(self.templates, nodes, self.cfg.train.global_batch_size, self.cfg.train.microbatch_size)
        first = {**record, "base": None, "cause": None, "instantiation": to_jsonable(inst)}
        return {**first, **(self.checkpoints.resume_record() or {})}

    def _wait_first_record(self) -> dict:
        deadline = time.monotonic() + self.cfg.elastic.join_timeout_s
        while (first := self.store.try_get_json("generation/0")) is None:
            if (failed := self.store.try_get_json("start_error")) is not None:
                raise OobleckError(failed["error"])
            if time.monotonic() > deadline:
                raise OobleckError(f"generation 0 was not written within {self.cfg.elastic.join_timeout_s:.0f} s "
                                   "(elastic.join_timeout_s): the first node's first worker did not get there")
            time.sleep(self.store.poll_s)
        return first

    def _join(self) -> str | None:
        """A node started after the run began: gets ready, waits to be admitted, receives its layers."""
        report_ready(self.store, self.me.node, self.env.local_world_size)
        logger.info("[node %d] ready to join; waiting for admission", self.me.node)
        deadline = time.monotonic() + self.cfg.elastic.join_timeout_s
        while True:
            record = current_generation(self.store, self.cfg.elastic.join_timeout_s)
            if self.me.node in record["nodes"]:
                break
            if self.store.try_get_json("done") is not None:
                raise RunFinished(f"[node {self.me.node}] the run finished before this node was admitted")
            if time.monotonic() > deadline:
                raise OobleckError(f"node {self.me.node} was not admitted within {self.cfg.elastic.join_timeout_s:.0f} s")
            time.sleep(0.05)
        return self._adopt(record)

    def _adopt(self, record: dict) -> str | None:
        """Builds the generation of the record that won the compare-and-set, whatever this worker
        proposed: a restore record is restored from the checkpoint, any other is built from its
        base with the transfers every member derives alike. A worker left out, or at another
        step than the record, is fenced. Returns a failure cause, or None once built."""
        g = self._check_record(record)
        if self.me.node not in record["nodes"]:
            raise Fenced(f"[node {self.me.node}] fenced: not a member of generation {g} ({record['cause']})")
        self.records[g] = record
        inst = self._instantiation(g)
        if record.get("restored_from") is not None:
            self.last_transfers = []
            self.checkpoints.saved_step = record["start_step"]
            return self._enter(g, record["start_step"], inst, (), restore_from=self.cfg.checkpoint.dir)
        if self.trainer.layers.layers and record["start_step"] != self.trainer.completed_steps:
            raise Fenced(f"[node {self.me.node}] fenced: generation {g} starts at step {record['start_step']} "
                         f"but this worker has completed {self.trainer.completed_steps}")
        transfers = []
        if record["base"] is not None:
            base = self._record(record["base"])
            base_inst = from_jsonable(Instantiation, base["instantiation"])
            # what this worker held in the base: drops partial copies of a build that failed
            self.trainer.layers.keep_only(layer_holders(base_inst, self.templates).get(self.me, ()))
            transfers = plan_transfers(self.templates, base_inst, inst, set(base_inst.nodes) - set(inst.nodes))
        self.last_transfers = transfers
        return self._enter(g, record["start_step"], inst, transfers)

    def _record(self, generation: int) -> dict:
        if generation not in self.records:
            record = self.store.get_json(f"generation/{generation}", 10.0)
            self._check_record(record)
            self.records[generation] = record
        return self.records[generation]

    def _check_record(self, record: dict) -> int:
        """The record's generation, once the record is one this job could have written: the
        store is shared state, and nothing read from it is acted on unchecked (README: trust
        model)."""
        train = self.cfg.train
        try:
            g, base, start = record["generation"], record["base"], record["start_step"]
            inst = from_jsonable(Instantiation, record["instantiation"])
            check_instantiation(inst, self.templates, train.global_batch_size, train.microbatch_size)
            if sorted(record["nodes"]) != list(inst.nodes):
                raise ValueError(f"its nodes {record['nodes']} are not its instantiation's {list(inst.nodes)}")
            if not (isinstance(start, int) and 0 <= start <= train.steps):
                raise ValueError(f"start step {start!r} is outside the run's 0..{train.steps}")
            if base is not None and not (isinstance(base, int) and 0 <= base < g):
                raise ValueError(f"base {base!r} is not an earlier generation")
        except (KeyError, TypeError, ValueError, PlanningError) as exc:
            raise OobleckError(f"generation record {record.get('generation')!r} in the membership store is not one "
                               f"this job wrote ({exc}); only the job's own nodes may write to its store "
                               "(README: trust model)") from None
        return g

    def _enter(self, generation: int, start_step: int, inst: Instantiation, transfers,
               restore_from: str | None = None) -> str | None:
        """Builds a generation and waits until every member has; returns a failure cause."""
        plan = GenerationPlan(generation=generation, start_step=start_step,
                              workers_per_node=self.env.local_world_size, instantiation=inst,
                              templates=self.templates)
        self.plan = plan
        if self.fault and self.fault.step < 0:  # before any step: faults of the build count from the first
            self.fault.step = start_step
        # Slow is not dead: each replay of a step that failed with every node alive doubles the
        # collective timeout, so a transfer or step slower than elastic.collective_timeout_s
        # gets through (Note: [roll call] in elastic/membership.py).
        self.trainer.set_timeout(self.cfg.elastic.collective_timeout_s * 2 ** self.retries.get(start_step, 0))
        cause = None
        try:
            self.moved = self.trainer.build(plan, transfers, settle=False, restore_from=restore_from)
            self._built_barrier(plan)
        except (RuntimeError, StepAborted) as exc:
            cause = f"{type(exc).__name__} while building generation {generation}: {str(exc).splitlines()[0][:160]}"
        if cause:
            return cause
        self.trainer.settle()
        if plan.rank_of(self.me) == 0 and self.report is None:
            self.report = RunReport(self.cfg, self.store, self.model.num_layers)
            if self.last_step is not None:  # rank 0 died after a commit, maybe before its line
                self.report.catch_up(*self.last_step)
        if self.report:
            self.report.generation(plan, self.templates)
            if generation == 0 and self.records[0].get("resumed"):
                self.report.resumed(self.records[0], self.cfg.checkpoint.dir)
        return None

    def _built_barrier(self, plan: GenerationPlan) -> None:
        key = f"gen{plan.generation}/built"
        self.store.add(key, 1)
        deadline = time.monotonic() + self.cfg.elastic.agreement_timeout_s
        while self.store.add(key, 0) < len(plan.members):
            if self.watcher.dead(plan.instantiation.nodes) or time.monotonic() > deadline:
                raise StepAborted(f"a member of generation {plan.generation} died while it was built")
            time.sleep(self.store.poll_s)

    def _complete(self, generation: int) -> bool:
        inst = self._instantiation(generation)
        return self.store.add(f"gen{generation}/built", 0) >= len(inst.nodes) * self.env.local_world_size

    def _instantiation(self, generation: int) -> Instantiation:
        return from_jsonable(Instantiation, self.records[generation]["instantiation"])

    def step(self) -> None:
        plan = self.plan
        if self.fault:
            self.fault.step = self.trainer.completed_steps
        computed = self.trainer.compute()
        if self.fault:
            self.fault("commit")
        if self.stop_requested:  # before this worker reports ready, so this step's commit carries it
            request_stop(self.store, f"node {self.me.node} (SIGTERM)")
            self.stop_requested = False
        joiners, stop = commit_step(self.store, plan.generation, computed.stats.step, len(plan.members),
                                    plan.instantiation.nodes, self.watcher, self.cfg.elastic.agreement_timeout_s,
                                    self.max_nodes)
        if self.fault:
            self.fault("committed")
        self.last_step = (computed.stats, plan)
        if self.report:
            self.report.step(computed.stats, plan)
        self.trainer.apply(computed)
        self._checkpoint(final=stop)
        # only once its checkpoint is written (a failure before then is recovered); a stop at the
        # last step is the run's normal end
        self.stopped = stop and self.trainer.completed_steps < self.cfg.train.steps
        if joiners:
            self.grow(joiners)

    def _checkpoint(self, final: bool = False) -> None:
        self.checkpoints.save(self.plan, self.plan.rank_of(self.me), self.trainer.layers, self.trainer.completed_steps,
                              final)

    def grow(self, joiners: list[int]) -> None:
        """Admits ready joiners at this step boundary: every member does the same, in step."""
        started = time.perf_counter()
        self.failed_at = None
        old = self.plan
        step = self.trainer.completed_steps
        self.trainer.close()
        if self.fault:
            self.fault("grow")
        # A member that died after the commit (in its optimizer step) is left out when its death
        # is known already (its agent marked it); if not, the build fails and recovery drops it.
        dead = sorted(self.watcher.dead(old.instantiation.nodes))
        try:
            recon = reconfigure(self.templates, old.instantiation, lost=dead, joined=joiners)
        except LayersLostError:  # the build will fail and the recovery fall back to the checkpoint
            dead, recon = [], reconfigure(self.templates, old.instantiation, joined=joiners)
        cause = f"node(s) {joiners} joined" + (f"; node(s) {dead} lost after step {step - 1}" if dead else "")
        proposal = {"generation": old.generation + 1, "nodes": list(recon.instantiation.nodes), "start_step": step,
                    "lost": dead, "joined": joiners, "base": old.generation, "cause": cause,
                    "actions": list(recon.actions), "instantiation": to_jsonable(recon.instantiation)}
        record = propose_generation(self.store, old.generation + 1, proposal, self.cfg.elastic.agreement_timeout_s)
        if self.fault:
            self.fault("admit")
        t1 = time.perf_counter()
        failure = self._adopt(record)
        phases = {"agree": t1 - started, **self.trainer.last_build_s}
        if failure:  # a joiner or member died while layers moved: recover from the base
            self.recover(failure, phases, started, first_generation=old.generation)
        else:
            self._report(old.generation, phases, started)

    def recover(self, cause: str, phases: dict[str, float] | None = None, started: float | None = None,
                first_generation: int | None = None) -> None:
        """Agrees on the next generation and rebuilds into it (Note: [roll call]); repeats while
        nodes keep failing during the recovery itself."""
        started = started or time.perf_counter()
        self.evaluated = None  # an evaluation cut short on some workers is run again by all
        if self.report:
            self.report.flush_recovery()  # a failure before the last recovery's replay finished
        first_generation = self.plan.generation if first_generation is None else first_generation
        phases = phases if phases is not None else {}
        while cause is not None:
            cause = self._recover_once(cause, phases)
        self._report(first_generation, phases, started)

    def _report(self, first_generation: int, phases: dict[str, float], started: float) -> None:
        """Hands the reporter the change from `first_generation` to the current generation."""
        if not self.report:
            return
        before = set(self._instantiation(first_generation).nodes)
        lost = before - set(self.plan.instantiation.nodes)
        signs = [t for t in map(self.watcher.failed_at, sorted(lost)) if t is not None]
        self.report.recovery(plan=self.plan, record=self.records[self.plan.generation],
                             first_generation=first_generation, before=before, transfers=self.last_transfers,
                             phases=phases, total_s=time.perf_counter() - started, failed_at=self.failed_at,
                             first_failure=min(signs) if signs else None)

    def _recover_once(self, cause: str, phases: dict[str, float]) -> str | None:
        t0 = time.perf_counter()
        old = self.plan
        step = self.trainer.completed_steps
        self.trainer.close()  # frees gloo sockets: peers blocked on us fail fast
        t1 = time.perf_counter()
        if decide_abort(self.store, old.generation, step) == "commit":
            raise AssertionError("a committed step cannot fail before apply(): apply is local")
        self.trainer.discard()
        if self.fault:
            self.fault("agreement")
        alive, dead = roll_call(self.store, old.generation, (self.me.node, self.me.local_rank),
                                list(old.instantiation.nodes), self.env.local_world_size, self.watcher,
                                self.cfg.elastic.agreement_timeout_s, self.cfg.elastic.rollcall_window_s)
        base = old.generation if self._complete(old.generation) else self.records[old.generation]["base"]
        if base is None:  # the first generation failed, or one restored from a checkpoint
            fresh = self.records[old.generation].get("restored_from") is None
            return self._restart(old, alive, dead, cause, phases, t0, fresh=fresh)
        base_inst = from_jsonable(Instantiation, self._record(base)["instantiation"])
        lost = sorted(set(base_inst.nodes) - set(alive))
        # joiners of a failed admission that answered the roll call are admitted again
        joined = sorted(set(alive) - set(base_inst.nodes))
        if not lost and not dead:  # slow is not dead: the step is replayed by the same nodes
            self._count_retry(step, cause)
        if lost or joined:
            try:
                recon = reconfigure(self.templates, base_inst, lost=lost, joined=joined)
            except LayersLostError as exc:
                return self._restart(old, alive, dead, f"{cause}; {exc}", phases, t0)
            inst, actions = recon.instantiation, list(recon.actions)
        elif dead:  # only nodes the base does not have (joiners) were lost: back to the base's layout
            inst, actions = base_inst, [f"node(s) {dead} lost before they were built in: generation {base}'s layout"]
        else:
            inst, actions = base_inst, ["every node answered the roll call: rebuilt with the same nodes"]
        proposal = {"generation": old.generation + 1, "nodes": list(inst.nodes), "start_step": step,
                    "lost": dead, "joined": joined, "base": base, "cause": cause, "actions": actions,
                    "instantiation": to_jsonable(inst)}
        # Every survivor proposes; compare-and-set keeps the first, so losing any one of them (the
        # "coordinator") cannot stall the agreement, and everyone acts on the record that won.
        record = propose_generation(self.store, old.generation + 1, proposal, self.cfg.elastic.agreement_timeout_s)
        t2 = time.perf_counter()
        failure = self._adopt(record)
        for name, value in (("teardown", t1 - t0), ("agree", t2 - t1), *self.trainer.last_build_s.items()):
            phases[name] = phases.get(name, 0.0) + value
        return failure

    def _eval_due(self) -> bool:
        interval, done = self.cfg.eval.interval, self.trainer.completed_steps
        return bool(interval) and done > 0 and done % interval == 0 and self.evaluated != done

    def _evaluate(self) -> None:
        """The eval loss after this step: eval.steps batches forward only, their token-weighted
        mean. A collective like a step: a failure here is recovered and the evaluation run again."""
        done = self.trainer.completed_steps
        if self.fault:
            self.fault("eval", step=done)
        loss_sum = tokens = 0
        started = time.perf_counter()
        for batch in range(self.cfg.eval.steps):
            loss, count = self.trainer.evaluate(batch)
            loss_sum, tokens = loss_sum + loss * count, tokens + count
        self.evaluated = done
        if self.report:
            self.report.evaluation(done, loss_sum / tokens if tokens else float("nan"), tokens,
                                   perplexity=self.model.vocab_size is not None,
                                   seconds=time.perf_counter() - started)

    def _count_retry(self, step: int, cause: str) -> None:
        """A step that keeps failing with every node alive is not a node failure (a bug, out of
        memory): it ends the run after a few replays instead of looping."""
        self.retries[step] = self.retries.get(step, 0) + 1
        if self.retries[step] > MAX_REPLAYS_WITHOUT_LOSS:
            raise OobleckError(f"step {step} failed {self.retries[step]} times with every node alive, so it is "
                               f"not a node failure: {cause}\nThe last failure, whole:\n{self.last_error or cause}")

    def _restart(self, old: GenerationPlan, alive: list[int], dead: list[int], cause: str,
                 phases: dict[str, float], t0: float, fresh: bool = False) -> str | None:
        """More failures than replicas: every survivor restarts from the latest checkpoint. With
        `fresh`, the first generation failed before it trained: the survivors start it again."""
        if fresh:
            step, restored, action = 0, None, "started the run again on nodes {nodes}"
        else:
            step = self.checkpoints.fallback_step()
            if step is None:
                raise OobleckError(f"{cause}. There is no complete checkpoint of this run in "
                                   f"{self.cfg.checkpoint.dir!r} (checkpoint.interval) to fall back to: the run "
                                   "cannot continue")
            logger.warning("[node %d] layers lost: restoring the checkpoint of step %d", self.me.node, step)
            restored, action = step, f"restored the checkpoint of step {step} on nodes {{nodes}}"
        inst = fresh_layout(self.templates, alive, self.cfg.train.global_batch_size, self.cfg.train.microbatch_size)
        proposal = {"generation": old.generation + 1, "nodes": list(inst.nodes), "start_step": step, "lost": dead,
                    "joined": [], "base": None, "restored_from": restored, "cause": cause,
                    "actions": [action.format(nodes=list(inst.nodes))], "instantiation": to_jsonable(inst)}
        record = propose_generation(self.store, old.generation + 1, proposal, self.cfg.elastic.agreement_timeout_s)
        t2 = time.perf_counter()
        failure = self._adopt(record)
        phases["restore"] = phases.get("restore", 0.0) + time.perf_counter() - t2
        phases["agree"] = phases.get("agree", 0.0) + t2 - t0
        return failure

    def run(self) -> None:
        self.start()
        while True:
            cause = None
            try:
                if self.stopped:
                    break
                if self._eval_due():
                    self._evaluate()
                elif self.trainer.completed_steps < self.cfg.train.steps:
                    self.step()
                else:  # the end is a collective too: a failure here is recovered like any other
                    self._checkpoint(final=True)
                    sums, norms = self.trainer.layer_summaries()
                    break
            except (RuntimeError, StepAborted) as exc:  # gloo errors are RuntimeErrors
                cause = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                self.failed_at = time.time()
                self.last_error = "".join(traceback.format_exception(exc))  # text: holds no frame
            if cause is not None:
                # Recover only after leaving the except block: until then the exception and
                # its traceback keep the dead generation's groups (and their sockets) alive,
                # and peers blocked on them would wait for the collective timeout.
                logger.warning("[node %d rank %d] step %d failed (%s); recovering", self.me.node,
                               self.me.local_rank, self.trainer.completed_steps, cause)
                self.recover(cause)
        if self.report and self.stopped:
            self.report.stopped(self.trainer.completed_steps, self.cfg.checkpoint.dir)
        elif self.report:
            self.report.final(self.trainer.completed_steps, sums, norms)

    def close(self) -> None:
        self.checkpoints.close()
        self.trainer.shutdown()
        if self.report:
            self.report.close()


def run_worker(model: ModelSpec, dataset: Dataset, cfg: JobConfig, env: WorkerEnv | None = None,
               eval_dataset: Dataset | None = None) -> None:
    """Trains `model` on `dataset` as one worker of the run described by the environment; with
    no oobleck environment, trains alone (one node, one worker: the single-process reference).
    `eval_dataset`: the held-out data of eval.interval."""
    if cfg.eval.interval and eval_dataset is None:
        raise ConfigError("eval.interval is set but the job has no eval data: set data.eval_tokens to a token file, "
                          "or pass eval_dataset to run_worker")
    env = env or WorkerEnv.from_environ()
    local_server = None
    fault = None
    if env is None:
        local_server = host_store("127.0.0.1", 0, "standalone")
        env = WorkerEnv(local_server.url, "standalone", 0, 0, 1)
        local_server.set_json("generation", {"generation": 0, "nodes": [0], "start_step": 0})
        if cfg.fault_tolerance:
            logger.warning("running alone: fault_tolerance=%d needs more nodes, using 0", cfg.fault_tolerance)
            cfg = dataclasses.replace(cfg, fault_tolerance=0)
    else:
        watch_parent()
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    store = connect_store(env.store_url, env.run_id, timeout=cfg.elastic.join_timeout_s)
    if local_server is None:
        check_lease(store, env.node, cfg)
        fault = FaultInjector.from_environ(env.node, store)
    run = _Run(model, dataset, cfg, env, store, fault, eval_dataset if cfg.eval.interval else None)
    if local_server is not None:  # alone, SIGTERM stops after the step too (Note: [stop on request])
        signal.signal(signal.SIGTERM, lambda signum, frame: setattr(run, "stop_requested", True))
    else:
        signal.signal(signal.SIGTERM, lambda signum, frame: stop_or_die(
            env.node, env.local_world_size, lambda: setattr(run, "stop_requested", True)))
    fenced = False
    try:
        run.run()
    except RunFinished as exc:
        logger.warning("%s", exc)
    except Fenced as exc:  # the others go on without this node; it leaves the run's state alone
        logger.error("%s", exc)
        fenced = True
    except (dist.DistNetworkError, dist.DistStoreError) as exc:
        raise OobleckError(
            f"the membership store at {store.url} is unreachable ({str(exc).splitlines()[0][:120]}); "
            "the embedded store does not outlive the process hosting it. Host it on a machine that stays "
            "up (the launcher does for local jobs) or use the etcd store") from None
    finally:
        run.close()
        del local_server
    if fenced:
        raise SystemExit(3)  # after cleanup: the agent sees this worker leave as fenced
