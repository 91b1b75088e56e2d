"""Proposing the next generation: planning it from the nodes that are left (planning/recovery.py
`plan_next`) with what its members must agree on besides the layout, and the compare-and-set
that keeps one proposal; and, when too few nodes survived for the smallest pipeline, the wait
for nodes joining to make up the difference."""

from __future__ import annotations

import dataclasses

from oobleck_elastic.config import JobConfig
from oobleck_elastic.elastic.logs import Prefixed
from oobleck_elastic.elastic.protocol import WaitTimeout, WorkerSide
from oobleck_elastic.elastic.records import GenerationRecord
from oobleck_elastic.elastic.run_checkpoints import RunCheckpoints
from oobleck_elastic.errors import RunFailed
from oobleck_elastic.planning import TemplateSet
from oobleck_elastic.planning.recovery import Base, NoCheckpointError, plan_next

__all__ = ["Proposer"]


class Proposer:
    def __init__(self, cfg: JobConfig, protocol: WorkerSide, checkpoints: RunCheckpoints, log: Prefixed) -> None:
        self.cfg, self.protocol, self.checkpoints, self.log = cfg, protocol, checkpoints, log

    def propose(self, templates: TemplateSet, generation: int, base: Base | None, alive: list[int],
                dead: list[int], step: int, cause: str, fresh: bool = False) -> GenerationRecord:
        """Plans generation `generation` and proposes it; the record that won."""
        train = self.cfg.train
        try:
            layout = plan_next(templates, base, alive=alive, dead=dead, step=step, fresh=fresh,
                               checkpoint=self.checkpoints.fallback_step, global_batch=train.global_batch_size,
                               microbatch=train.microbatch_size)
        except NoCheckpointError as exc:
            raise RunFailed(f"{cause}. {exc} (in {self.cfg.checkpoint.dir!r})") from exc
        if layout.restored_from is not None:
            self.log.warning("layers lost: %s", layout.actions[0])
        proposal = self.with_run_state(GenerationRecord.next(generation, layout, cause))
        # Every survivor proposes; compare-and-set keeps the first, so losing any one of them (the
        # "coordinator") cannot stall the agreement, and everyone acts on the record that won.
        return self.protocol.propose(proposal, self.cfg.elastic.agreement_timeout_s)

    def with_run_state(self, record: GenerationRecord) -> GenerationRecord:
        """A proposal with what its members must agree on besides the layout: whether the
        evaluation after its start step was recorded, and whether a stop was requested."""
        return dataclasses.replace(record, evaluated=self.protocol.evaluated(record.start_step),
                                   stopping=self.protocol.stop_requested())

    def await_joiners(self, templates: TemplateSet, generation: int, alive: list[int],
                      max_nodes: int | None) -> list[int]:
        """Too few nodes survived `generation` for the smallest pipeline: waits
        (elastic.join_timeout_s) for ready joiners, replacements say, to make up the difference,
        and returns them (they are in the next generation like any node that joins). The chaos
        run found a single survivor crashing the run where a replacement was already waiting."""
        need, timeout = templates.min_nodes, self.cfg.elastic.join_timeout_s
        self.log.warning("only %d node(s) left and the smallest pipeline needs %d: waiting up to %.0f s for "
                         "nodes to join (elastic.join_timeout_s)", len(alive), need, timeout)

        def enough() -> list[int] | None:
            if self.protocol.try_record(generation + 1) is not None:
                return []  # another survivor moved on first: its record wins, and this worker adopts it
            # room up to --nnodes' maximum counts the survivors only (the lost members are marked dead)
            ready = self.protocol.ready_joiners(alive, max_nodes)
            return ready if len(alive) + len(ready) >= need else None
        try:
            return self.protocol.wait(f"{need - len(alive)} more node(s) to join", enough, timeout)
        except WaitTimeout as exc:
            raise RunFailed(f"only {len(alive)} node(s) are left and no other node joined within "
                            f"elastic.join_timeout_s ({timeout:.0f} s); the smallest pipeline needs {need}. Start "
                            "the job again on enough nodes: it resumes from its newest checkpoint") from exc
