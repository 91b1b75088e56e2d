"""The run's end: the final checkpoint, the layers' summaries, the end record written by rank 0,
and the barrier every worker passes before it leaves.

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

from collections.abc import Callable

from oobleck_elastic.config import JobConfig
from oobleck_elastic.elastic.controller import Finished
from oobleck_elastic.elastic.protocol import WaitTimeout, WorkerSide
from oobleck_elastic.elastic.run_checkpoints import RunCheckpoints
from oobleck_elastic.elastic.step_errors import CheckpointMissing
from oobleck_elastic.monitoring.report_seat import ReportSeat
from oobleck_elastic.runtime.fault_hook import NO_FAULTS, FaultHook
from oobleck_elastic.runtime.plan import GenerationPlan
from oobleck_elastic.runtime.trainer import Trainer

__all__ = ["Ending"]


class Ending:
    """One worker's part in the run's end. `finish()` raises what a step raises when a peer
    fails; `recorded_anyway()` then says whether the end was recorded all the same."""

    def __init__(self, cfg: JobConfig, protocol: WorkerSide, checkpoints: RunCheckpoints, trainer: Trainer,
                 seat: ReportSeat, fault: FaultHook = NO_FAULTS) -> None:
        self.cfg, self.protocol, self.checkpoints, self.trainer = cfg, protocol, checkpoints, trainer
        self.seat, self.fault = seat, fault
        self.at_barrier = False  # in the final barrier: the end may be recorded already

    def finish(self, stopped: bool, save_final: Callable[[], None]) -> Finished:
        self.at_barrier = False
        save_final()  # the end is a collective too
        # a collective: once it returns, every worker has written its part (Note: [final checkpoint])
        summaries = self.trainer.layer_summaries()
        self.fault("finish", self.trainer.completed_steps)
        recorded = True
        if self.seat.held and not self.protocol.finished():  # Note: [the end is recorded before anyone leaves]
            recorded = self._record_end(stopped, summaries)
        self.at_barrier = True
        # rank 0's verdict rides on the barrier: a live rank 0 that cannot record the end
        # would otherwise leave the others in it until the roll call's timeout
        if not self.trainer.barrier(recorded):
            self.at_barrier = False
            raise CheckpointMissing(f"the checkpoint of step {self.trainer.completed_steps} was not published: "
                                    "a worker's part of it was not written (its log says why); the end is done "
                                    "again")
        return Finished()

    def _record_end(self, stopped: bool, summaries: tuple[list[float], list[float]]) -> bool:
        """Rank 0: records the run's end once the checkpoint of the step it ended at is
        published; whether it did. A part that was not written (a write that failed) fails the
        end for everyone (the final barrier's verdict), so the end is done again in the next
        generation, and a run never says it has a checkpoint that is not there."""
        done = self.trainer.completed_steps
        if not self.checkpoints.published(done):
            return False
        if stopped:
            self.seat.stopped(done, self.cfg.checkpoint.dir)
        else:
            self.seat.final(done, *summaries)
        return True

    def recorded_anyway(self, plan: GenerationPlan) -> bool:
        """After `finish()` failed: whether it got to the final barrier and rank 0 recorded the
        end. A peer that died first fails the barrier while rank 0 may still be writing it, so
        this waits for `done` as long as rank 0's node lives and nobody began a recovery (rank
        0, failed before it could record the end, say), at most elastic.agreement_timeout_s;
        otherwise the survivors recover (Note: [the end is recorded before anyone leaves])."""
        if not self.at_barrier:
            return False
        self.at_barrier = False
        node = plan.members[0].node  # global rank 0's
        generation, step = plan.generation, self.trainer.completed_steps

        def check() -> str | None:  # a wait ends on a value that is neither None nor False
            if self.protocol.finished():
                return "recorded"
            if self.protocol.liveness.dead([node]) or self.protocol.aborted(generation, step):
                return "not recorded"
            return None
        try:
            verdict = self.protocol.wait("rank 0 to record the run's end", check, self.cfg.elastic.agreement_timeout_s)
        except WaitTimeout:
            return False
        return verdict == "recorded"
