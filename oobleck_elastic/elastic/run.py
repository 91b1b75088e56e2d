"""The executor of one worker's run: carries out what the controller (elastic/controller.py)
decides (join, build a generation, train a step, evaluate, recover, grow, finish) and reports
each outcome back as an event.

The failure path reads in three files: detection and agreement are elastic/protocol/'s
(Note: [step transaction], Note: [roll call]), the next layout is planning/recovery.py's
(Note: [next generation]), and the repair (tear down, adopt the record that won, move layers)
is here. Every generation record carries its instantiation and its `base`: the last generation
every member finished building. So all workers derive the same transfers, and a generation
whose build failed part-way is skipped: the next one is planned from its base again.

Note: [failed build]
    Whatever is raised while a generation is built (its default group bootstrapping through
    the store, its subgroups, the layer transfers, a restore, the built barrier) is a failed
    build, recovered like a failed step: not only gloo's and torch's TCPStore's RuntimeErrors,
    since torch's etcd-backed c10d store times out with LookupError and python-etcd raises
    errors of its own. A joiner SIGKILLed while the generation admitting it bootstrapped (stock
    torchrun on etcd) left every member waiting for its keys; each failed with `LookupError:
    Timeout while waiting for keys in EtcdStore`, and the job was lost with nobody left to
    recover it. An OobleckError stays fatal: each means this worker or the whole run must stop,
    and building again cannot help. Fenced: this worker is out of the run and must leave its
    state alone (execute() makes it FencedOut). RunFailed: the run cannot go on, and tells the
    others. StoreUnreachable: the membership store is gone past its outage timeout, so no
    recovery could agree on anything. A checkpoint that does not load (damaged, gone, another
    run's) is not fatal: the trainer raises CheckpointUnreadable, the step is marked damaged,
    and the next fallback takes the one before it (runtime/checkpoint.py Note: [newest
    checkpoint]). A bug that fails every
    build with every node alive is a failed build too, yet cannot loop: its recoveries are
    replays (planning/recovery.py is_replay), and the controller gives up after
    MAX_REPLAYS_WITHOUT_LOSS of them with the last error whole (GiveUp, elastic/controller.py).

Note: [orphaned run]
    Members propose every generation, so a run whose members are all dead at once (more kills
    than survivors, or survivors fenced) has nobody left to admit the nodes waiting to join:
    they used to wait out elastic.join_timeout_s and the job ended with the last checkpoint on
    disk. Instead, a ready joiner that sees every member of the newest generation dead (marked
    by its launcher or agent, or its lease still for elastic.lease_timeout_s) proposes the next
    generation itself once enough joiners are ready for the smallest pipeline: the newest
    checkpoint restored on the ready joiners, exactly as survivors restore it after more than
    f failures. Compare-and-set keeps one proposal; a joiner left out of it keeps waiting.

Note: [the end is recorded before anyone leaves]
    Only rank 0 writes the final record and publishes `done`, which the launcher waits for.
    Workers used to leave as soon as the run's last collective (the layer summaries) was done,
    and rank 0 wrote the end afterwards: a rank 0 killed in between (a chaos run killed it
    while it drew the throughput figure) left a finished run that no one recorded, and the
    job failed. Now rank 0 records the end inside the Finish work, and every worker waits in
    one more collective (a barrier) before it leaves: a rank 0 that dies first fails the
    barrier, the survivors recover as from any failed step, and the next rank 0 records the
    end. A failure after the end is recorded changes nothing: the survivors leave. A peer
    other than rank 0 that dies first fails the barrier of workers that may reach it before
    rank 0 has written the end, so a worker whose barrier failed waits for `done` while rank
    0's node lives (lease beating, not marked dead) before it recovers.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
import traceback
from typing import cast

import torch

from oobleck_elastic.config import JobConfig
from oobleck_elastic.elastic.checkpoints import RunCheckpoints
from oobleck_elastic.elastic.controller import (
    Admitted,
    Build,
    BuildFailed,
    Built,
    Controller,
    EvalDone,
    Evaluate,
    Exit,
    FencedOut,
    Finish,
    Finished,
    Grow,
    Join,
    Proposed,
    Recover,
    RunOver,
    Started,
    StepDone,
    StepFailed,
    Train,
)
from oobleck_elastic.elastic.job import WorkerIdentity, job_description, plan_run
from oobleck_elastic.elastic.logs import Prefixed, worker_prefix
from oobleck_elastic.elastic.protocol import CheckpointSide, Fenced, StepAborted, WaitTimeout, WorkerSide
from oobleck_elastic.elastic.records import GenerationRecord, Outcome
from oobleck_elastic.elastic.stores import MembershipStore
from oobleck_elastic.errors import OobleckError, RunFailed
from oobleck_elastic.monitoring.run_report import RunReport
from oobleck_elastic.planning import Instantiation, TemplateSet, WorkerRef, instantiate, layer_holders
from oobleck_elastic.planning.recovery import (
    Base,
    NextLayout,
    NoCheckpointError,
    is_replay,
    plan_next,
    transfers_between,
)
from oobleck_elastic.runtime.checkpoint import CheckpointUnreadable
from oobleck_elastic.runtime.model import ModelSpec
from oobleck_elastic.runtime.plan import GenerationPlan
from oobleck_elastic.runtime.trainer import Dataset, Trainer

__all__ = ["Run"]

logger = logging.getLogger(__name__)

class CheckpointMissing(RuntimeError):
    """The checkpoint the run ends with is not published (elastic/run.py _record_end)."""


STEP_ERRORS = (RuntimeError, StepAborted)  # gloo errors are RuntimeErrors


class DeviceFailed(OobleckError):
    """This worker's GPU failed (a CUDA error leaves its context unusable): the worker ends,
    and its node is lost like any other."""


def device_error(exc: BaseException, cfg: JobConfig, step: int) -> OobleckError | None:
    """What a step's error means when it is this worker's own device, not a peer: running out
    of memory fails the run (a replay would run out again, as would every worker of the same
    plan), a CUDA error ends this worker; None for anything else (a peer's failure)."""
    first = str(exc).splitlines()[0][:200] if str(exc) else ""
    if isinstance(exc, torch.OutOfMemoryError):
        return RunFailed(f"a worker ran out of memory in step {step} ({first}); the plan assumed "
                         f"planner.memory_per_worker={cfg.planner.memory_per_worker} bytes a worker: set it to "
                         "what a worker really has free, or use a smaller train.microbatch_size")
    if isinstance(exc, torch.AcceleratorError):
        return DeviceFailed(f"this worker's device failed in step {step} ({first}); the worker ends and its "
                            "node is recovered from like a lost one")
    return None


def _cause(exc: BaseException, during: str = "") -> tuple[str, str]:
    """(one line, the whole error as text): text holds no frame, so nothing of a dead
    generation stays referenced by it."""
    line = f"{type(exc).__name__}{during}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    return line, "".join(traceback.format_exception(exc))


def _layout(record: GenerationRecord) -> Instantiation:
    """A checked record's instantiation (check() refuses the rendezvous's bare record)."""
    assert record.instantiation is not None, f"generation {record.generation}'s record has no layout"
    return record.instantiation


class Run:
    """One worker's run across generations."""

    def __init__(self, model: ModelSpec, dataset: Dataset, cfg: JobConfig, who: WorkerIdentity,
                 store: MembershipStore, fault=None, eval_dataset: Dataset | None = None) -> None:
        self.model, self.cfg, self.who, self.fault = model, cfg, who, fault
        self.log = Prefixed(logger, lambda: worker_prefix(who.run_id, self.plan.generation if self.plan else None,
                                                          who.node, who.local_rank))
        self.me = WorkerRef(who.node, who.local_rank)
        self.protocol = WorkerSide(store, cfg.elastic.lease_timeout_s)
        self.controller = Controller(cfg.train.steps, cfg.eval.interval)
        self.trainer = Trainer(model=model, dataset=dataset, cfg=cfg, me=self.me, store=store.torch_store(),
                               fault=fault, eval_dataset=eval_dataset)
        self.checkpoints = RunCheckpoints(model, cfg, who.run_id, len(dataset),
                                          worker_prefix(who.run_id, None, who.node, who.local_rank),
                                          CheckpointSide(store), fault)
        self.report: RunReport | None = None
        self.templates: TemplateSet | None = None  # planned in start()
        self.plan: GenerationPlan | None = None
        self.records: dict[int, GenerationRecord] = {}
        self.last_transfers: list = []
        self.failed_at: float | None = None  # wall time this worker's step failed
        self.change: tuple[int, dict[str, float], float] | None = None  # (from generation, phases, started)
        self.max_nodes: int | None = None
        self.stop_requested = False  # set on SIGTERM (Note: [stop on request])
        self.forgotten = 0  # the store holds no working keys of the generations before it
        self.last_step: tuple | None = None  # (stats, plan) of the last committed step
        self.summaries: tuple[list[float], list[float]] | None = None

    def run(self) -> str:
        """Runs until the controller says exit; returns why ("done", "stopped", "fenced", "run over")."""
        action = self.controller.handle(self.start())
        while not isinstance(action, Exit):
            action = self.controller.handle(self.execute(action))
        if self.report and action.reason in ("done", "stopped"):
            self.report.draw_throughput(self.trainer.completed_steps)
        return action.reason

    def execute(self, action: object) -> object:
        """Carries out one action; its outcome as the next event."""
        try:
            if isinstance(action, (Train, Evaluate, Finish)):
                return self._work(action)
            if isinstance(action, Build):
                return self.adopt(action.record, action.timeout_factor)
            if isinstance(action, Recover):
                return self.recover(action.cause)
            if isinstance(action, Grow):
                return self.grow(list(action.joiners))
            if isinstance(action, Join):
                return self.join()
        except Fenced as exc:  # the others go on without this node; it leaves the run's state alone
            self.log.error("%s", exc)
            return FencedOut(str(exc))
        raise AssertionError(f"the controller asked for {action!r}, which the executor does not know")

    def _work(self, action: Train | Evaluate | Finish) -> object:
        """A step, an evaluation or the run's end: collectives, so a failure is recovered. It is
        caught as text and handled only after the except block: until then the exception and
        its traceback keep the dead generation's groups (and their sockets) alive, and peers
        blocked on them would wait for the collective timeout."""
        at_barrier = False
        try:
            if isinstance(action, Train):
                return self.step()
            if isinstance(action, Evaluate):
                return self.evaluate()
            self.save_checkpoint(final=True)  # the end is a collective too
            # a collective: once it returns, every worker has written its part (Note: [final checkpoint])
            self.summaries = self.trainer.layer_summaries()
            if self.fault:
                self.fault("finish", step=self.trainer.completed_steps)
            recorded = True
            if self.report and not self.protocol.finished():  # Note: [the end is recorded before anyone leaves]
                recorded = self._record_end(action.stopped)
            at_barrier = True
            # rank 0's verdict rides on the barrier: a live rank 0 that cannot record the end
            # would otherwise leave the others in it until the roll call's timeout
            assert self.trainer.generation is not None, "the run ends in a built generation"
            if not self.trainer.generation.barrier(recorded):
                at_barrier = False
                raise CheckpointMissing(f"the checkpoint of step {self.trainer.completed_steps} was not published: "
                                        "a worker's part of it was not written (its log says why); the end is done "
                                        "again")
            return Finished()
        except STEP_ERRORS as exc:
            own = device_error(exc, self.cfg, self.trainer.completed_steps)
            if own is not None:
                raise own from None
            cause, error = _cause(exc)
            self.failed_at = time.time()
        if at_barrier and self._end_recorded():
            self.log.warning("a peer failed after the run's end was recorded (%s); nothing is left to do", cause)
            return Finished()
        self.log.warning("step %d failed (%s); recovering", self.trainer.completed_steps, cause)
        return StepFailed(cause, error)

    def _record_end(self, stopped: bool) -> bool:
        """Rank 0: records the run's end once the checkpoint of the step it ended at is
        published; whether it did. A part that was not written (a write that failed) fails the
        end for everyone (the final barrier's verdict), so the end is done again in the next
        generation, and a run never says it has a checkpoint that is not there."""
        done = self.trainer.completed_steps
        if not self.checkpoints.published(done):
            return False
        assert self.report is not None, "rank 0 reports"
        if stopped:
            self.report.stopped(done, self.cfg.checkpoint.dir)
        else:
            assert self.summaries is not None, "taken before the end is recorded"
            self.report.final(done, *self.summaries)
        return True

    def _end_recorded(self) -> bool:
        """After the run's final barrier failed: whether rank 0 recorded the end. A peer that
        died first fails the barrier while rank 0 may still be writing it, so this waits for
        `done` as long as rank 0's node lives and nobody began a recovery (rank 0, failed
        before it could record the end, say), at most elastic.agreement_timeout_s; otherwise
        the survivors recover (Note: [the end is recorded before anyone leaves])."""
        assert self.plan is not None, "the run ends in a built generation"
        node = self.plan.members[0].node  # global rank 0's
        generation, step = self.plan.generation, self.trainer.completed_steps

        def check() -> bool | None:
            if self.protocol.finished():
                return True
            if self.protocol.liveness.dead([node]) or self.protocol.aborted(generation, step):
                return False
            return None
        try:
            return self.protocol.wait("rank 0 to record the run's end", check, self.cfg.elastic.agreement_timeout_s)
        except WaitTimeout:
            return False

    # --- joining ------------------------------------------------------------------------------

    def start(self) -> Started:
        self.protocol.check_same_job(job_description(self.cfg, self.model, self.who.local_world_size))
        self.checkpoints.start(self.protocol.instance())
        pointer = self.protocol.pointer(self.cfg.elastic.join_timeout_s)
        self.max_nodes = self.protocol.max_nodes()  # written before the pointer
        first = self.protocol.try_record(0) or pointer
        self.templates = plan_run(self.protocol, self.who, first.nodes, self.model, self.cfg)
        # Note: [frozen heap] Each teardown runs gc.collect() so that nothing of the old
        # generation keeps its gloo sockets open (generation.py). With torch imported a full
        # collection scans ~1e6 objects (0.4 s here, most of a recovery); freezing what exists
        # now (imports, config, plans; no layers or groups yet) leaves only objects created
        # since for each collection to scan (< 1 ms).
        gc.collect()
        gc.freeze()
        # the rendezvous's bare record of the first members stays the pointer until the first
        # change: a node not among them joins, however the pointer reads
        member = pointer.generation == 0 and not pointer.planned and self.me.node in pointer.nodes
        if not member:
            self.checkpoints.note_first(self.protocol.try_record(0))
            return Started(False)
        if (self.who.node, self.who.local_rank) == (min(pointer.nodes), 0):
            self.protocol.publish_first(self._first_record(pointer))
        first = self.protocol.first(self.cfg.elastic.join_timeout_s)
        self.checkpoints.note_first(first)
        return Started(True, first)

    def _first_record(self, pointer: GenerationRecord) -> GenerationRecord:
        """Generation 0: its instantiation, and the checkpoint it resumes from (checkpoint.resume)."""
        train = self.cfg.train
        assert self.templates is not None, "planned in start()"
        inst = instantiate(self.templates, pointer.nodes, train.global_batch_size, train.microbatch_size)
        resumed = self.checkpoints.resume()
        layout = NextLayout(instantiation=inst, start_step=resumed.step if resumed else 0, base=None,
                            restored_from=resumed.step if resumed else None,
                            actions=(resumed.action,) if resumed else ())
        record = GenerationRecord.next(0, layout, resumed.cause if resumed else None)
        return dataclasses.replace(record, resumed=resumed.origin) if resumed else record

    def join(self) -> object:
        """A node started after the run began: gets ready and waits to be admitted."""
        if self.fault:
            self.fault("join", step=0)  # before it says it is ready (a slow joiner, in tests)
        self.protocol.report_ready(self.me.node, self.who.local_world_size)
        self.log.info("ready to join; waiting for admission")
        timeout = self.cfg.elastic.join_timeout_s

        def admitted() -> GenerationRecord | RunOver | None:
            record = self.protocol.current(timeout)
            if self.me.node in record.nodes:
                return record
            if self.protocol.finished() or self.protocol.failure():
                return RunOver()
            if len(self.protocol.liveness.dead(record.nodes)) == len(record.nodes):
                # generation 0's pointer is the rendezvous's bare record: its planned one is
                # the record (absent while the first node still plans it)
                planned = record if record.planned else self.protocol.try_record(record.generation)
                if planned is not None:
                    return self._take_over(planned)  # Note: [orphaned run]
            return None
        # cast: mypy solves wait()'s T for a check returning a union as object
        outcome = cast("GenerationRecord | RunOver", self.protocol.wait(
            f"node {self.me.node} to be admitted (elastic.join_timeout_s)", admitted, timeout))
        if isinstance(outcome, RunOver):
            self.log.warning("the run finished before this node was admitted")
            return outcome
        if outcome.generation > 0:  # a change, reported by whoever is its rank 0 (maybe this node)
            self.change = (outcome.generation - 1, {}, time.perf_counter())
        return Admitted(outcome)

    def _take_over(self, orphaned: GenerationRecord) -> GenerationRecord | None:
        """Every member of the newest generation is dead (Note: [orphaned run]): the ready
        joiners propose the next generation themselves, restoring the newest checkpoint on them;
        the record that won if it has this node, else None (it keeps waiting)."""
        assert self.templates is not None, "planned in start()"
        ready = self.protocol.ready_joiners((), self.max_nodes)
        if len(ready) < self.templates.min_nodes or self.me.node not in ready:
            return None  # too few to train yet: more may get ready within elastic.join_timeout_s
        g, train = orphaned.generation, self.cfg.train
        cause = f"every member of generation {g} ({list(orphaned.nodes)}) was lost"
        try:
            layout = plan_next(self.templates, None, alive=ready, dead=list(orphaned.nodes), step=0,
                               checkpoint=self.checkpoints.fallback_step, global_batch=train.global_batch_size,
                               microbatch=train.microbatch_size)
        except NoCheckpointError as exc:
            raise RunFailed(f"{cause}. {exc} (in {self.cfg.checkpoint.dir!r})") from exc
        self.log.warning("%s: the nodes waiting to join restore the newest checkpoint (%s)", cause, layout.actions[0])
        won = self.protocol.propose(self._with_run_state(GenerationRecord.next(g + 1, layout, cause)),
                                    self.cfg.elastic.agreement_timeout_s)
        return won if self.me.node in won.nodes else None

    def _with_run_state(self, record: GenerationRecord) -> GenerationRecord:
        """A proposal with what its members must agree on besides the layout: whether the
        evaluation after its start step was recorded, and whether a stop was requested."""
        return dataclasses.replace(record, evaluated=self.protocol.evaluated(record.start_step),
                                   stopping=self.protocol.stop_requested())

    # --- building -----------------------------------------------------------------------------

    def adopt(self, record: GenerationRecord, timeout_factor: int = 1) -> object:
        """Builds the generation of the record that won the compare-and-set, whatever this
        worker proposed: a restore record is restored from the checkpoint, any other is built
        from its base with the transfers every member derives alike. A worker left out, or at
        another step than the record, is fenced."""
        assert self.templates is not None, "planned in start()"
        train = self.cfg.train
        record = record.check(self.templates, global_batch=train.global_batch_size,
                              microbatch=train.microbatch_size, steps=train.steps)
        g = record.generation
        if self.me.node not in record.nodes:
            raise Fenced(f"node {self.me.node} fenced: not a member of generation {g} ({record.cause})")
        # only this generation and its base are ever read again; _record fetches any other
        self.records = {k: v for k, v in self.records.items() if k == record.base}
        self.records[g] = record
        restore_from = None
        if record.restored_from is not None:  # step 0: the initial state, built afresh
            self.checkpoints.restored_step = record.start_step
            self.trainer.layers.keep_only(())
            transfers, restore_from = [], self.cfg.checkpoint.dir if record.restored_from else None
        elif self.trainer.layers.layers and record.start_step != self.trainer.completed_steps:
            raise Fenced(f"node {self.me.node} fenced: generation {g} starts at step {record.start_step} "
                         f"but this worker has completed {self.trainer.completed_steps}")
        else:
            base = self._record(record.base).instantiation if record.base is not None else None
            if base is not None:  # what this worker held in the base: drops partial copies of a failed build
                self.trainer.layers.keep_only(layer_holders(base, self.templates).get(self.me, ()))
            transfers = transfers_between(self.templates, base, _layout(record))
        self.last_transfers = transfers
        return self._enter(record, transfers, restore_from, timeout_factor)

    def _record(self, generation: int) -> GenerationRecord:
        if generation not in self.records:
            assert self.templates is not None, "planned in start()"
            train = self.cfg.train
            self.records[generation] = self.protocol.record(generation).check(
                self.templates, global_batch=train.global_batch_size, microbatch=train.microbatch_size,
                steps=train.steps)
        return self.records[generation]

    def _enter(self, record: GenerationRecord, transfers, restore_from: str | None, timeout_factor: int) -> object:
        """Builds a generation and waits until every member has; whatever fails meanwhile, but an
        OobleckError, is a failed build (Note: [failed build])."""
        assert self.templates is not None, "planned in start()"
        plan = GenerationPlan(generation=record.generation, start_step=record.start_step,
                              workers_per_node=self.who.local_world_size, instantiation=_layout(record),
                              templates=self.templates)
        self.plan = plan
        if self.fault and self.fault.step < 0:  # before any step: faults of the build count from the first
            self.fault.step = record.start_step
        # Slow is not dead: each replay of a step that failed with every node alive doubles the
        # collective timeout, so a transfer or step slower than elastic.collective_timeout_s
        # gets through (Note: [roll call] in elastic/protocol/worker_side.py).
        self.trainer.set_timeout(self.cfg.elastic.collective_timeout_s * timeout_factor)
        started = time.perf_counter()
        cause: str | None  # why the build failed; None: it did not
        try:
            if restore_from is not None:
                self.checkpoints.check_restorable(plan.start_step)
            self.trainer.build(plan, transfers, settle=False, restore_from=restore_from)
            self.protocol.built(plan.generation, len(plan.members), plan.instantiation.nodes,
                                self.cfg.elastic.agreement_timeout_s)
        except OobleckError:  # this worker or the run must stop (Note: [failed build])
            raise
        except Exception as exc:  # whatever torch or the store raised: a failed build
            if isinstance(exc, CheckpointUnreadable) and exc.damaged:  # no fallback takes it again
                self.checkpoints.mark_damaged(exc.step, exc.why)
            cause, error = _cause(exc, f" while building generation {record.generation}")
        else:
            cause = None
        if self.change is not None:  # the phases of the change under way
            for name, value in ({"restore": time.perf_counter() - started} if record.restored_from is not None
                                else self.trainer.last_build_s).items():
                self.change[1][name] = self.change[1].get(name, 0.0) + value
        if cause:
            self.log.warning("%s; recovering", cause)
            return BuildFailed(cause, error)
        self.trainer.settle()
        self._report_generation(record)
        return Built(record)

    def _report_generation(self, record: GenerationRecord) -> None:
        plan = self.plan
        assert plan is not None and self.templates is not None, "called once the generation is built"
        if self.report and plan.rank_of(self.me) != 0:  # a node that joined ranks first now: it reports
            self.report.flush_recovery()
            self.report.close()
            self.report = None
        if plan.rank_of(self.me) == 0 and self.report is None:
            self.report = RunReport(self.cfg, self.protocol, self.model.num_layers, self.who.run_id)
            if record.generation > 0:  # a hand-over: the figure keeps the steps before it
                self.report.adopt_history()
            if self.last_step is not None:  # rank 0 died after a commit, maybe before its line
                self.report.catch_up(*self.last_step)
        if self.report:
            self.report.generation(plan, self.templates)
            if record.generation == 0 and record.resumed:
                self.report.resumed(record.to_json(), self.cfg.checkpoint.dir)
        if self.change is not None:
            self._report_change()

    # --- training -----------------------------------------------------------------------------

    def step(self) -> StepDone:
        plan = self.plan
        assert plan is not None, "steps run in a built generation"
        if self.fault:
            self.fault.step = self.trainer.completed_steps
        computed = self.trainer.compute()
        if self.fault:
            self.fault("commit")
        if self.stop_requested:  # before this worker reports ready, so this step's commit carries it
            self.protocol.request_stop(f"node {self.me.node} (SIGTERM)")
            self.stop_requested = False
        decision = self.protocol.commit_step(plan.generation, computed.stats.step, len(plan.members),
                                             plan.instantiation.nodes, self.cfg.elastic.agreement_timeout_s,
                                             self.max_nodes)
        if self.fault:
            self.fault("committed")
        self.last_step = (computed.stats, plan)
        if self.report:
            self.report.step(computed.stats, plan)
        self.trainer.apply(computed)
        if not decision.stop:  # a stop's checkpoint is the Finish's alone (Note: [final checkpoint])
            self.save_checkpoint()
        if plan.generation > self.forgotten and plan.rank_of(self.me) == 0:  # Note: [store keys]
            self.forgotten = plan.generation
            try:
                self.protocol.forget_generations_before(plan.generation)
            except (RuntimeError, OobleckError) as exc:  # housekeeping: the step is committed and applied
                self.log.warning("could not delete the keys of generations before %d: %s", plan.generation,
                                 str(exc).splitlines()[0][:160])
        return StepDone(computed.stats.step, decision.join, decision.stop)

    def save_checkpoint(self, final: bool = False) -> None:
        assert self.plan is not None, "checkpoints are saved in a built generation"
        self.checkpoints.save(self.plan, self.plan.rank_of(self.me), self.trainer.layers,
                              self.trainer.completed_steps, final)

    def evaluate(self) -> EvalDone:
        """The eval loss after this step: eval.steps batches forward only, their token-weighted
        mean. A collective like a step: a failure here is recovered and the evaluation run again."""
        done = self.trainer.completed_steps
        if self.fault:
            self.fault("eval", step=done)
        loss_sum: float = 0
        tokens = 0
        started = time.perf_counter()
        for batch in range(self.cfg.eval.steps):
            loss, count = self.trainer.evaluate(batch)
            loss_sum, tokens = loss_sum + loss * count, tokens + count
        if self.report:
            self.report.evaluation(done, loss_sum / tokens if tokens else float("nan"), tokens,
                                   perplexity=self.model.vocab_size is not None,
                                   seconds=time.perf_counter() - started)
            self.protocol.record_evaluation(done)
        return EvalDone(done)

    # --- changing membership ------------------------------------------------------------------

    def grow(self, joiners: list[int]) -> Proposed:
        """Admits ready joiners at this step boundary: every member does the same, in step."""
        started = time.perf_counter()
        self.failed_at = None
        old, step = self.plan, self.trainer.completed_steps
        assert old is not None, "nodes join a built generation"
        self.trainer.close()
        if self.fault:
            self.fault("grow")
        # A member that died after the commit (in its optimizer step) is left out when its death
        # is known already (its agent marked it); if not, the build fails and recovery drops it.
        dead = sorted(self.protocol.liveness.dead(old.instantiation.nodes))
        alive = sorted((set(old.instantiation.nodes) - set(dead)) | set(joiners))
        cause = f"node(s) {joiners} joined" + (f"; node(s) {dead} lost after step {step - 1}" if dead else "")
        record = self._propose(old, Base(old.generation, old.instantiation), alive, dead, step, cause)
        if self.fault:
            self.fault("admit")
        self.change = (old.generation, {"agree": time.perf_counter() - started}, started)
        return Proposed(record)

    def recover(self, cause: str) -> Proposed:
        """Tears the failed generation down, aborts its step, takes the roll call and proposes
        the next generation (Note: [roll call]); adopting the record that won is the next action."""
        t0 = time.perf_counter()
        assert self.plan is not None and self.templates is not None, "a generation failed, so one was built"
        if self.change is None:
            self.change = (self.plan.generation, {}, t0)
            if self.report:
                self.report.flush_recovery()  # a failure before the last recovery's replay finished
        old, step, ela = self.plan, self.trainer.completed_steps, self.cfg.elastic
        self.trainer.close()  # frees gloo sockets: peers blocked on us fail fast
        t1 = time.perf_counter()
        if self.protocol.decide_abort(old.generation, step).outcome is Outcome.COMMIT:
            raise AssertionError("a committed step cannot fail before apply(): apply is local")
        self.trainer.discard()
        if self.fault:
            self.fault("agreement")
        alive, dead = self.protocol.roll_call(old.generation, (self.me.node, self.me.local_rank),
                                              list(old.instantiation.nodes), self.who.local_world_size,
                                              ela.agreement_timeout_s, ela.rollcall_window_s)
        failed = self.records[old.generation]
        complete = self.protocol.complete(old.generation, len(old.members))
        base_g = old.generation if complete else failed.base
        base = Base(base_g, _layout(self._record(base_g))) if base_g is not None else None
        if self.me.node not in alive:  # taken for dead while it hung, or behind the others
            raise Fenced(f"node {self.me.node} fenced: it is not among the nodes that answered the roll call "
                         f"of generation {old.generation}")
        if len(alive) < self.templates.min_nodes:
            alive = alive + self._await_joiners(old, alive)
        record = self._propose(old, base, alive, dead, step, cause, fresh=failed.restored_from is None)
        replay = is_replay(base, alive, dead)
        phases = self.change[1]
        for name, value in (("teardown", t1 - t0), ("agree", time.perf_counter() - t1)):
            phases[name] = phases.get(name, 0.0) + value
        return Proposed(record, replay)

    def _await_joiners(self, old: GenerationPlan, alive: list[int]) -> list[int]:
        """Too few nodes survived for the smallest pipeline: waits (elastic.join_timeout_s) for
        ready joiners, replacements say, to make up the difference, and returns them (they are
        in the next generation like any node that joins). The chaos run found a single survivor
        crashing the run where a replacement was already waiting."""
        assert self.templates is not None, "planned in start()"
        need = self.templates.min_nodes
        self.log.warning("only %d node(s) left and the smallest pipeline needs %d: waiting up to %.0f s for "
                         "nodes to join (elastic.join_timeout_s)", len(alive), need, self.cfg.elastic.join_timeout_s)

        def enough() -> list[int] | None:
            if self.protocol.try_record(old.generation + 1) is not None:
                return []  # another survivor moved on first: its record wins, and this worker adopts it
            # room up to --nnodes' maximum counts the survivors only (the lost members are marked dead)
            ready = self.protocol.ready_joiners(alive, self.max_nodes)
            return ready if len(alive) + len(ready) >= need else None
        try:
            return self.protocol.wait(f"{need - len(alive)} more node(s) to join", enough,
                                      self.cfg.elastic.join_timeout_s)
        except WaitTimeout as exc:
            raise RunFailed(f"only {len(alive)} node(s) are left and no other node joined within "
                            f"elastic.join_timeout_s ({self.cfg.elastic.join_timeout_s:.0f} s); the smallest pipeline "
                            f"needs {need}. Start the job again on enough nodes: it resumes from its newest "
                            "checkpoint") from exc

    def _propose(self, old: GenerationPlan, base: Base | None, alive: list[int], dead: list[int], step: int,
                 cause: str, fresh: bool = False) -> GenerationRecord:
        """Plans the next generation (planning/recovery.py) and proposes it; the record that won."""
        assert self.templates is not None, "planned in start()"
        train = self.cfg.train
        try:
            layout = plan_next(self.templates, base, alive=alive, dead=dead, step=step, fresh=fresh,
                               checkpoint=self.checkpoints.fallback_step, global_batch=train.global_batch_size,
                               microbatch=train.microbatch_size)
        except NoCheckpointError as exc:
            raise RunFailed(f"{cause}. {exc} (in {self.cfg.checkpoint.dir!r})") from exc
        if layout.restored_from is not None:
            self.log.warning("layers lost: %s", layout.actions[0])
        proposal = self._with_run_state(GenerationRecord.next(old.generation + 1, layout, cause))
        # Every survivor proposes; compare-and-set keeps the first, so losing any one of them (the
        # "coordinator") cannot stall the agreement, and everyone acts on the record that won.
        return self.protocol.propose(proposal, self.cfg.elastic.agreement_timeout_s)

    def _report_change(self) -> None:
        """Hands the reporter the change from the generation before it to the current one."""
        assert self.change is not None and self.plan is not None, "called after a change's generation is built"
        first_generation, phases, started = self.change
        self.change = None
        if not self.report:
            return
        before = set(self._record(first_generation).nodes)
        lost = before - set(self.plan.instantiation.nodes)
        signs = [t for t in map(self.protocol.liveness.failed_at, sorted(lost)) if t is not None]
        self.report.recovery(plan=self.plan, record=self.records[self.plan.generation].to_json(),
                             first_generation=first_generation, before=before, transfers=self.last_transfers,
                             phases=phases, total_s=time.perf_counter() - started, failed_at=self.failed_at,
                             first_failure=min(signs) if signs else None)

    def close(self) -> None:
        self.checkpoints.close()
        self.trainer.shutdown()
        if self.report:
            self.report.close()
