"""How a worker enters its run: the job check, the plan every worker makes alike, generation 0
for the first members, and for a node started later, readiness and the wait to be admitted
(or the take-over of an orphaned run).

Note: [orphaned run]
    Members propose every generation, so a run whose members are all dead at once (more kills
    than survivors, or survivors fenced) has nobody left to admit the nodes waiting to join:
    they used to wait out elastic.join_timeout_s and the job ended with the last checkpoint on
    disk. Instead, a ready joiner that sees every member of the newest generation dead (marked
    by its launcher or agent, or its lease still for elastic.lease_timeout_s) proposes the next
    generation itself once enough joiners are ready for the smallest pipeline: the newest
    checkpoint restored on the ready joiners, exactly as survivors restore it after more than
    f failures. Compare-and-set keeps one proposal; a joiner left out of it keeps waiting.
"""

from __future__ import annotations

import dataclasses
import gc
from typing import cast

from oobleck_elastic.config import JobConfig
from oobleck_elastic.elastic.controller import RunOver, Started
from oobleck_elastic.elastic.job import WorkerIdentity, job_description, plan_run
from oobleck_elastic.elastic.logs import Prefixed
from oobleck_elastic.elastic.proposing import Proposer
from oobleck_elastic.elastic.protocol import WorkerSide
from oobleck_elastic.elastic.records import GenerationRecord
from oobleck_elastic.elastic.run_checkpoints import RunCheckpoints
from oobleck_elastic.planning import TemplateSet, WorkerRef, instantiate
from oobleck_elastic.planning.recovery import NextLayout
from oobleck_elastic.runtime.fault_hook import NO_FAULTS, FaultHook
from oobleck_elastic.runtime.model import ModelSpec

__all__ = ["Joining"]


class Joining:
    """One worker's way into the run. `start()` first, then `join()` for a node that is not
    among the first members."""

    def __init__(self, cfg: JobConfig, model: ModelSpec, who: WorkerIdentity, protocol: WorkerSide,
                 checkpoints: RunCheckpoints, proposer: Proposer, log: Prefixed, fault: FaultHook = NO_FAULTS) -> None:
        self.cfg, self.model, self.who, self.protocol = cfg, model, who, protocol
        self.checkpoints, self.proposer, self.log, self.fault = checkpoints, proposer, log, fault
        self.me = WorkerRef(who.node, who.local_rank)
        self.templates: TemplateSet | None = None  # planned in start()
        self.max_nodes: int | None = None  # the job's limit on nodes, read in start()

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

    def join(self) -> GenerationRecord | RunOver:
        """A node started after the run began: gets ready and waits to be admitted; the record
        that admits it, or RunOver if the run ended first."""
        self.fault("join", 0)  # before it says it is ready (a slow joiner, in tests)
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
        return cast("GenerationRecord | RunOver", self.protocol.wait(
            f"node {self.me.node} to be admitted (elastic.join_timeout_s)", admitted, timeout))

    def _take_over(self, orphaned: GenerationRecord) -> GenerationRecord | None:
        """Every member of the newest generation is dead (Note: [orphaned run]): the ready
        joiners propose the next generation themselves, restoring the newest checkpoint on them;
        the record that won if it has this node, else None (it keeps waiting)."""
        assert self.templates is not None, "planned in start()"
        ready = self.protocol.ready_joiners((), self.max_nodes)
        if len(ready) < self.templates.min_nodes or self.me.node not in ready:
            return None  # too few to train yet: more may get ready within elastic.join_timeout_s
        g = orphaned.generation
        cause = f"every member of generation {g} ({list(orphaned.nodes)}) was lost"
        self.log.warning("%s: the nodes waiting to join restore the newest checkpoint", cause)
        won = self.proposer.propose(self.templates, g + 1, None, ready, list(orphaned.nodes), 0, cause)
        return won if self.me.node in won.nodes else None
