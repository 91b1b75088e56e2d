"""The executor of one worker's run: carries out what the controller (elastic/controller.py)
decides (join, build a generation, train a step, evaluate, recover, grow, finish) and reports
each outcome back as an event.

The failure path reads in three places: detection and agreement are elastic/protocol/'s
(Note: [step transaction], Note: [roll call]), the next layout is planning/recovery.py's
(Note: [next generation]), and the repair (tear down, adopt the record that won, move layers)
is here. Every generation record carries its instantiation and its `base`: the last generation
every member finished building. So all workers derive the same transfers, and a generation
whose build failed part-way is skipped: the next one is planned from its base again. What a
failure means (a failed step or build, this worker's device, the run's end) is
elastic/step_errors.py's (Note: [failed build]); how a worker enters the run is
elastic/joining.py's, how it ends elastic/ending.py's.
"""

from __future__ import annotations

import logging
import time

from oobleck_elastic.config import JobConfig
from oobleck_elastic.elastic.change_clock import ChangeClock
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
from oobleck_elastic.elastic.ending import Ending
from oobleck_elastic.elastic.job import WorkerIdentity
from oobleck_elastic.elastic.joining import Joining
from oobleck_elastic.elastic.logs import Prefixed, worker_prefix
from oobleck_elastic.elastic.peer_watch import PeerWatch
from oobleck_elastic.elastic.proposing import Proposer
from oobleck_elastic.elastic.protocol import CheckpointSide, Fenced, WorkerSide
from oobleck_elastic.elastic.records import GenerationRecord, Outcome
from oobleck_elastic.elastic.run_checkpoints import RunCheckpoints
from oobleck_elastic.elastic.step_errors import STEP_ERRORS, cause_of, device_error
from oobleck_elastic.elastic.stores import MembershipStore
from oobleck_elastic.errors import OobleckError
from oobleck_elastic.monitoring.report_seat import ReportSeat
from oobleck_elastic.planning import Instantiation, TemplateSet, WorkerRef, layer_holders
from oobleck_elastic.planning.recovery import Base, is_replay, transfers_between
from oobleck_elastic.runtime.checkpoint import CheckpointUnreadable
from oobleck_elastic.runtime.fault_hook import NO_FAULTS, FaultHook
from oobleck_elastic.runtime.model import ModelSpec
from oobleck_elastic.runtime.plan import GenerationPlan
from oobleck_elastic.runtime.reach import unreachable
from oobleck_elastic.runtime.trainer import Dataset, Trainer

__all__ = ["Run"]

logger = logging.getLogger(__name__)


def _layout(record: GenerationRecord) -> Instantiation:
    """A checked record's instantiation (check() refuses the rendezvous's bare record)."""
    assert record.instantiation is not None, f"generation {record.generation}'s record has no layout"
    return record.instantiation


class Run:
    """One worker's run across generations."""

    def __init__(self, model: ModelSpec, dataset: Dataset, cfg: JobConfig, who: WorkerIdentity,
                 store: MembershipStore, fault: FaultHook = NO_FAULTS,
                 eval_dataset: Dataset | None = None) -> None:
        self.model, self.cfg, self.who, self.fault = model, cfg, who, fault
        self.log = Prefixed(logger, lambda: worker_prefix(who.run_id, self.plan.generation if self.plan else None,
                                                          who.node, who.local_rank))
        self.me = WorkerRef(who.node, who.local_rank)
        self.protocol = WorkerSide(store, cfg.elastic.lease_timeout_s)
        self.controller = Controller(cfg.train.steps, cfg.eval.interval)
        self.trainer = Trainer(model=model, dataset=dataset, cfg=cfg, me=self.me, store=store.torch_store(),
                               fault=fault, eval_dataset=eval_dataset, store_address=(store.host, store.port))
        self.watch = PeerWatch.for_run(store, who.run_id, who.node, who.local_rank, cfg.elastic)  # [silent members]
        self.checkpoints = RunCheckpoints(model, cfg, who.run_id, len(dataset),
                                          worker_prefix(who.run_id, None, who.node, who.local_rank),
                                          CheckpointSide(store), fault)
        self.seat = ReportSeat(cfg, self.protocol, model.num_layers, who.run_id)
        self.proposer = Proposer(cfg, self.protocol, self.checkpoints, self.log)
        self.joining = Joining(cfg, model, who, self.protocol, self.checkpoints, self.proposer, self.log, fault)
        self.ending = Ending(cfg, self.protocol, self.checkpoints, self.trainer, self.seat, fault)
        self.change = ChangeClock()
        self.templates: TemplateSet | None = None  # planned in start()
        self.plan: GenerationPlan | None = None
        self.records: dict[int, GenerationRecord] = {}
        self.last_transfers: list = []
        self.max_nodes: int | None = None
        self.stop_requested = False  # set on SIGTERM (Note: [stop on request])
        self.forgotten = 0  # the store holds no working keys of the generations before it
        self.last_step: tuple | None = None  # (stats, plan) of the last committed step

    def run(self) -> str:
        """Runs until the controller says exit; returns why ("done", "stopped", "fenced", "run over")."""
        action = self.controller.handle(self.start())
        while not isinstance(action, Exit):
            action = self.controller.handle(self.execute(action))
        if action.reason in ("done", "stopped"):
            self.seat.draw_throughput(self.trainer.completed_steps)
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
        try:
            if isinstance(action, Train):
                return self.step()
            if isinstance(action, Evaluate):
                return self.evaluate()
            return self.ending.finish(action.stopped, lambda: self.save_checkpoint(final=True))
        except STEP_ERRORS as exc:
            own = device_error(exc, self.cfg, self.trainer.completed_steps)
            if own is not None:
                raise own from None
            cause, error = cause_of(exc)
            self.change.step_failed()
        assert self.plan is not None, "work runs in a built generation"
        cause = self._silence(cause)
        if isinstance(action, Finish) and self.ending.recorded_anyway(self.plan):
            self.log.warning("a peer failed after the run's end was recorded (%s); nothing is left to do", cause)
            return Finished()
        self.log.warning("step %d failed (%s); recovering", self.trainer.completed_steps, cause)
        return StepFailed(cause, error)

    # --- joining (elastic/joining.py) ---------------------------------------------------------

    def start(self) -> Started:
        started = self.joining.start()
        self.templates, self.max_nodes = self.joining.templates, self.joining.max_nodes
        return started

    def join(self) -> object:
        outcome = self.joining.join()
        if isinstance(outcome, RunOver):
            self.log.warning("the run finished before this node was admitted")
            return outcome
        if outcome.generation > 0:  # a change, reported by whoever is its rank 0 (maybe this node)
            self.change.begin(outcome.generation - 1)
        return Admitted(outcome)

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
            self.checkpoints.note_restored(record.start_step)
            self.trainer.keep_layers(())
            transfers, restore_from = [], self.cfg.checkpoint.dir if record.restored_from else None
        elif self.trainer.holds_layers() and record.start_step != self.trainer.completed_steps:
            raise Fenced(f"node {self.me.node} fenced: generation {g} starts at step {record.start_step} "
                         f"but this worker has completed {self.trainer.completed_steps}")
        else:
            base = self._record(record.base).instantiation if record.base is not None else None
            if base is not None:  # what this worker held in the base: drops partial copies of a failed build
                self.trainer.keep_layers(layer_holders(base, self.templates).get(self.me, ()))
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
        # Slow is not dead: each replay of a step that failed with every node alive doubles the
        # collective timeout, so a transfer or step slower than elastic.collective_timeout_s
        # gets through (Note: [roll call] in elastic/protocol/worker_side.py).
        self.trainer.set_timeout(self.cfg.elastic.collective_timeout_s * timeout_factor)
        self.watch.arm(plan.generation, plan.instantiation.nodes, self.trainer.cut)
        started = time.perf_counter()
        cause: str | None  # why the build failed; None: it did not
        try:
            if restore_from is not None:
                self.checkpoints.check_restorable(plan.start_step)
            self.trainer.build(plan, transfers, settle=False, restore_from=restore_from)
            self.protocol.built(plan.generation, len(plan.members), plan.instantiation.nodes,
                                self.cfg.elastic.agreement_timeout_s, silent=lambda: self.watch.cut(plan.generation))
        except OobleckError:  # this worker or the run must stop (Note: [failed build])
            raise
        except Exception as exc:  # whatever torch or the store raised: a failed build
            if isinstance(exc, CheckpointUnreadable) and exc.damaged:  # no fallback takes it again
                self.checkpoints.mark_damaged(exc.step, exc.why)
            cause, error = cause_of(exc, f" while building generation {record.generation}")
        else:
            cause = None
        # the phases of a change under way
        self.change.add({"restore": time.perf_counter() - started} if record.restored_from is not None
                        else self.trainer.last_build_s)
        if cause:
            cause = self._silence(cause)
            self.log.warning("%s; recovering", cause)
            return BuildFailed(cause, error)
        self.trainer.settle()
        self._report_generation(record)
        return Built(record)

    def _silence(self, cause: str) -> str:
        """The cause of a failure, led by the peer watch's finding when it cut the generation."""
        silence = self.watch.found(self.plan.generation) if self.plan is not None else None
        return cause if silence is None else f"{silence}: {cause}"

    def _report_generation(self, record: GenerationRecord) -> None:
        plan = self.plan
        assert plan is not None and self.templates is not None, "called once the generation is built"
        self.seat.sit(plan.rank_of(self.me) == 0, record.generation, self.last_step)
        self.seat.generation(plan, self.templates)
        if record.generation == 0 and record.resumed:
            self.seat.resumed(record.to_json(), self.cfg.checkpoint.dir)
        change = self.change.finish()
        if change is None or not self.seat.held:
            return
        before = set(self._record(change.first_generation).nodes)
        lost = before - set(plan.instantiation.nodes)
        signs = [t for t in map(self.protocol.liveness.failed_at, sorted(lost)) if t is not None]
        self.seat.recovery(plan=plan, record=record.to_json(), first_generation=change.first_generation,
                           before=before, transfers=self.last_transfers, phases=change.phases,
                           total_s=change.total_s, failed_at=change.failed_at,
                           first_failure=min(signs) if signs else None)

    # --- training -----------------------------------------------------------------------------

    def step(self) -> StepDone:
        plan = self.plan
        assert plan is not None, "steps run in a built generation"
        computed = self.trainer.compute()
        self.fault("commit", computed.stats.step)
        if self.stop_requested:  # before this worker reports ready, so this step's commit carries it
            self.protocol.request_stop(f"node {self.me.node} (SIGTERM)")
            self.stop_requested = False
        decision = self.protocol.commit_step(plan.generation, computed.stats.step, len(plan.members),
                                             plan.instantiation.nodes, self.cfg.elastic.agreement_timeout_s,
                                             self.max_nodes, silent=lambda: self.watch.cut(plan.generation))
        self.fault("committed", computed.stats.step)
        self.last_step = (computed.stats, plan)
        self.seat.step(computed.stats, plan)
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
        self.fault("eval", done)
        loss_sum: float = 0
        tokens = 0
        started = time.perf_counter()
        for batch in range(self.cfg.eval.steps):
            loss, count = self.trainer.evaluate(batch)
            loss_sum, tokens = loss_sum + loss * count, tokens + count
        if self.seat.held:
            self.seat.evaluation(done, loss_sum / tokens if tokens else float("nan"), tokens,
                                   perplexity=self.model.vocab_size is not None,
                                   seconds=time.perf_counter() - started)
            self.protocol.record_evaluation(done)
        return EvalDone(done)

    # --- changing membership ------------------------------------------------------------------

    def grow(self, joiners: list[int]) -> Proposed:
        """Admits ready joiners at this step boundary: every member does the same, in step."""
        started = time.perf_counter()
        old, step = self.plan, self.trainer.completed_steps
        assert old is not None and self.templates is not None, "nodes join a built generation"
        self.watch.disarm()
        self.trainer.close()
        self.fault("grow", self.trainer.fault_step)
        # A member that died after the commit (in its optimizer step) is left out when its death
        # is known already (its agent marked it); if not, the build fails and recovery drops it.
        dead = sorted(self.protocol.liveness.dead(old.instantiation.nodes))
        alive = sorted((set(old.instantiation.nodes) - set(dead)) | set(joiners))
        cause = f"node(s) {joiners} joined" + (f"; node(s) {dead} lost after step {step - 1}" if dead else "")
        record = self.proposer.propose(self.templates, old.generation + 1, Base(old.generation, old.instantiation),
                                       alive, dead, step, cause)
        self.fault("admit", self.trainer.fault_step)
        self.change.begin(old.generation, started, fresh=True)
        self.change.add({"agree": time.perf_counter() - started})
        return Proposed(record)

    def recover(self, cause: str) -> Proposed:
        """Tears the failed generation down, aborts its step, takes the roll call and proposes
        the next generation (Note: [roll call]); adopting the record that won is the next action."""
        t0 = time.perf_counter()
        assert self.plan is not None and self.templates is not None, "a generation failed, so one was built"
        if self.change.begin(self.plan.generation, t0):
            self.seat.flush_recovery()  # a failure before the last recovery's replay finished
        old, step, ela = self.plan, self.trainer.completed_steps, self.cfg.elastic
        self.watch.disarm()
        self.trainer.close()  # frees gloo sockets: peers blocked on us fail fast
        t1 = time.perf_counter()
        if self.protocol.moved_on_without(old.generation, self.me.node):  # woken from a hang, say
            raise Fenced(f"node {self.me.node} fenced: generation {old.generation + 1} was chosen without it")
        if self.protocol.decide_abort(old.generation, step).outcome is Outcome.COMMIT:
            raise AssertionError("a committed step cannot fail before apply(): apply is local")
        self.trainer.discard()
        self.fault("agreement", self.trainer.fault_step)
        alive, dead = self.protocol.roll_call(old.generation, (self.me.node, self.me.local_rank),
                                              list(old.instantiation.nodes), self.who.local_world_size,
                                              ela.agreement_timeout_s, ela.rollcall_window_s,
                                              silence.nodes if (silence := self.watch.found(old.generation)) else (),
                                              probe=unreachable)  # Note: [gray failures]
        failed = self.records[old.generation]
        complete = self.protocol.complete(old.generation, len(old.members))
        base_g = old.generation if complete else failed.base
        base = Base(base_g, _layout(self._record(base_g))) if base_g is not None else None
        if self.me.node not in alive:  # taken for dead while it hung, or behind the others
            raise Fenced(f"node {self.me.node} fenced: the roll call of generation {old.generation} left it out "
                         "(it did not answer in time, or was cut off from the others)")
        if len(alive) < self.templates.min_nodes:
            alive = alive + self.proposer.await_joiners(self.templates, old.generation, alive, self.max_nodes)
        record = self.proposer.propose(self.templates, old.generation + 1, base, alive, dead, step, cause,
                                       fresh=failed.restored_from is None)
        replay = is_replay(base, alive, dead)
        self.change.add({"teardown": t1 - t0, "agree": time.perf_counter() - t1})
        return Proposed(record, replay)

    def close(self) -> None:
        self.watch.close()
        self.checkpoints.close()
        self.trainer.shutdown()
        self.seat.close()
