"""A run's checkpoints as one worker sees them: the checkpoint a starting job resumes from,
writing them (at the interval in the background, after the last step or a stop in the
foreground), and the one the fallback restores when more nodes fail than replicas cover. The
files themselves are runtime/checkpoint/'s (Note: [checkpoint manifest])."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from oobleck_elastic.config import JobConfig
from oobleck_elastic.elastic.protocol import CheckpointSide
from oobleck_elastic.elastic.records import GenerationRecord, Resumed
from oobleck_elastic.errors import OobleckError
from oobleck_elastic.runtime.checkpoint import (
    BackgroundWriter,
    CheckpointUnreadable,
    check_dir,
    checkpoint_id,
    find_resume,
    host_copy,
    identity,
    latest_checkpoint,
    mark_complete,
    published,
    read_manifest,
    remove_partials,
    save_layers,
)
from oobleck_elastic.runtime.fault_hook import NO_FAULTS, FaultHook
from oobleck_elastic.runtime.layers import LayerStore
from oobleck_elastic.runtime.model import ModelSpec
from oobleck_elastic.runtime.plan import GenerationPlan

__all__ = ["Resume", "RunCheckpoints"]

logger = logging.getLogger(__name__)

WRITE_TIMEOUT_S = 600.0  # longest wait for the previous checkpoint's write


@dataclass(frozen=True, kw_only=True)
class Resume:
    """The checkpoint a job's first generation continues from, and how its record says so."""

    step: int
    origin: Resumed
    cause: str
    action: str


class RunCheckpoints:
    """One worker's part in its run's checkpoints."""

    def __init__(self, model: ModelSpec, cfg: JobConfig, run_id: str, samples: int, name: str,
                 protocol: CheckpointSide, fault: FaultHook = NO_FAULTS) -> None:
        self.cfg, self.steps, self.model = cfg.checkpoint, cfg.train.steps, model
        self.settle_s = cfg.elastic.agreement_timeout_s / 2  # the longest a fallback waits for a write
        self.protocol, self.fault, self.name, self.run_id = protocol, fault, name, run_id
        self.ident = checkpoint_id(run_id, model, cfg, samples)
        self.restored_step: int | None = None  # the step of the checkpoint the layers were restored from
        self.writer = BackgroundWriter(name)

    def start(self, instance: tuple[str, float]) -> None:
        """This start of the run (WorkerSide.instance: its id and when it began): what its
        checkpoints carry."""
        self.ident = dataclasses.replace(self.ident, instance=instance[0], instance_started=instance[1])

    def resume(self) -> Resume | None:
        """The checkpoint generation 0 resumes from (checkpoint.resume), or None to start
        afresh. A checkpoint that cannot be resumed, or a checkpoint.dir holding another job's
        checkpoints, is published as the run's start error, so that every worker fails with
        the same line, and raised."""
        ck = self.cfg
        try:
            found = None if ck.resume == "never" else find_resume(ck.dir, self.ident, load_step=ck.load_step,
                                                                    max_step=self.steps)
            check_dir(ck.dir, self.ident)
        except OobleckError as exc:
            self.protocol.refuse_start(str(exc))
            raise
        if found is None:
            return None
        step, manifest = found
        remove_partials(ck.dir, manifest["run_id"])  # what the stopped run left half-written
        return Resume(step=step, origin=Resumed(manifest["run_id"], step), cause=f"resumed from step {step}",
                      action=f"resumed from the checkpoint of step {step} (run {manifest['run_id']}) in {ck.dir}")

    def note_first(self, first: GenerationRecord | None) -> None:
        """A resumed run may fall back to the checkpoint it resumed from, though another run wrote it."""
        if first is not None and first.resumed is not None:
            self.ident = dataclasses.replace(self.ident, resumed=(first.resumed.run_id, first.resumed.step))

    def note_restored(self, step: int) -> None:
        """The layers are about to be restored from the checkpoint of `step` (or built afresh at
        step 0): that checkpoint is not written again."""
        self.restored_step = step

    def fallback_step(self) -> int | None:
        """The newest checkpoint of this run (or the one it resumed from) not found damaged;
        before the first one, step 0: the initial state, which every worker rebuilds exactly
        (Note: [layer initialisation] in runtime/model.py); None for a resumed run whose
        checkpoint is gone."""
        self.settle(self.settle_s)  # what this worker's last write publishes, the fallback sees
        step = latest_checkpoint(self.cfg.dir, self.ident, damaged=self.protocol.damaged())
        if step is None and self.ident.resumed is None:
            return 0
        return step

    def published(self, step: int) -> bool:
        """Whether the checkpoint of `step` is on disk, published by this run (or the one it
        resumed from) and not found damaged: what a run may say it has."""
        return published(self.cfg.dir, step, self.ident, self.protocol.damaged())

    def mark_damaged(self, step: int, why: str) -> None:
        """The checkpoint of `step` did not match its checksums as it was loaded: its current
        publication is never taken again (Note: [newest checkpoint] in runtime/checkpoint/manifest.py)."""
        try:
            publication = identity(read_manifest(self.cfg.dir, step))
        except (OSError, ValueError):
            return  # gone meanwhile: no fallback finds it
        self.protocol.mark_damaged(step, publication, why)

    def save(self, plan: GenerationPlan, rank: int, layers: LayerStore, done: int, final: bool = False) -> None:
        """Every checkpoint.interval steps, and after the last step or a stop (`final`): copies
        the layers this rank owns and writes them (in the background unless `final` or
        checkpoint.background is false); whoever completes the set publishes the checkpoint.

        Note: [final checkpoint]
            The count of written layers is the generation's (`CheckpointSide.checkpoint_written`),
            so parts written in a generation that failed never complete in the next one: a
            final checkpoint (the last step's, or a stop's) that a failure interrupted is
            written again, whole, by the next generation's owners, unless it was published
            meanwhile. Every worker decides alike: the publication, if any, happened before
            the failed generation's survivors built the next one. A state restored from a
            checkpoint, and a published step, are not written again. A final step is never
            also written at its interval (a stop at an interval step is the Finish's alone):
            two writes of one step would share its partial directory. A step marked damaged
            (Note: [newest checkpoint]) counts as not published. The end is recorded only once
            rank 0 has seen the checkpoint published (elastic/run.py)."""
        ck = self.cfg
        if not final and (done == self.steps or not ck.interval or done % ck.interval):
            return
        failed = self.writer.wait(WRITE_TIMEOUT_S)  # one write at a time
        if failed is not None and final:
            logger.warning("[%s] an earlier checkpoint was not written (%s); the final one is", self.name, failed)
        if done == self.restored_step or (final and self.published(done)):
            return
        states = {i: host_copy(layers[i]) for i, r in plan.layer_owner.items() if r == rank}

        def write() -> None:
            written = save_layers(ck.dir, done, states, self.run_id)
            self.fault("checkpoint", done)
            if self.protocol.checkpoint_written(plan.generation, done, written, final) == self.model.num_layers:
                mark_complete(ck.dir, done, self.ident, self.model.export, keep=ck.keep,
                              protect=self.protocol.restoring)
                self.protocol.checkpoint_published(plan.generation, done, final)

        if ck.background and not final:
            self.writer.submit(write, WRITE_TIMEOUT_S)
            return
        try:  # a failed write is the same in the foreground: logged, the checkpoint not published
            write()
        except OobleckError:  # the setup is wrong (a checkpoint.dir not shared, another job's step): say so
            raise
        except Exception as exc:  # for a final one, rank 0 sees it unpublished and the end is done again
            logger.error("[%s] writing the checkpoint of step %d failed; it is not published: %s", self.name, done,
                         str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__)

    def settle(self, timeout: float) -> None:
        """Before a fallback is chosen: this worker's checkpoint write under way is finished (up
        to `timeout`), so the fallback sees what it publishes. Only a fallback waits: an
        in-memory recovery does not wait for a write. A write still going (another worker's)
        may publish while the next generation restores: `keep` spares the step being restored,
        and a restore that fails anyway is a failed build, tried again."""
        try:
            failed = self.writer.wait(timeout)
        except OobleckError as exc:
            logger.warning("[%s] %s; recovering meanwhile", self.name, exc)
            return
        if failed is not None:
            logger.warning("[%s] the last checkpoint was not written (%s)", self.name, failed)

    def check_restorable(self, step: int) -> None:
        """Before a generation restores `step`: its checkpoint is this run's (or the one it
        resumed from) and this job's, as the record says; a node whose checkpoint.dir holds
        another run's `step_<k>`, or none, fails the build instead of loading it."""
        if not self.published(step):
            raise CheckpointUnreadable(step, f"{self.cfg.dir!r} holds no checkpoint of step {step} of run "
                                             f"{self.ident.run_id}: gone, or another run's")

    def close(self) -> None:
        """Finishes a checkpoint under way (it is not cut short by the process ending)."""
        self.writer.wait(WRITE_TIMEOUT_S)
