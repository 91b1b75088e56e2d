"""A worker's side of the run's protocol (elastic/run.py's): the job it trains, the generations
it proposes and builds, the step transaction, the roll call after a failure, the joiners it
admits, and what the reporting worker mirrors for the launcher.

Note: [step transaction]
    Step k of generation g is committed when every member worker has finished its collectives
    for it: each adds 1 to `gen<g>/step<k>/ready`; the one that brings it to the world size
    writes `gen<g>/step<k>/decision` = commit with compare-and-set, with the node ids of
    joiners that are ready (everyone then grows the job at the same step boundary), or with
    `stop` when a stop was requested (`request_stop`: everyone then writes the final checkpoint
    after this step and exits; Note: [stop on request] in elastic/agent.py). A worker that
    fails, or that sees a member dead while waiting, writes abort with the same compare-and-set,
    so a late commit cannot race an abort: exactly one decision exists. Committed: every
    survivor applies its optimizer step (local work, nothing can fail remotely). Aborted:
    gradients are dropped everywhere and the step is replayed with the same samples in
    generation g+1. The worker whose commit wins deletes the keys of step k-1, which everyone
    has read by then.

Note: [roll call]
    After a failure every surviving worker checks in under `rollcall/<g>/<node>/<rank>`. The
    roll call is complete when every member node of g has all its workers checked in or is
    known dead (marked dead by its launcher or its agent, or its heartbeat lease stood still
    for `elastic.rollcall_window_s`: a failure is known by then, so a silent agent is not given
    the whole lease timeout), or at `elastic.agreement_timeout_s`. The heartbeat runs in the
    agent, not in the workers, so a live node whose workers are slow to notice the failure
    keeps its lease moving and is waited for. Every survivor then proposes generation g+1
    (Note: [next generation] in planning/recovery.py) with compare-and-set on
    `generation/<g+1>`; everyone adopts whatever won, and a worker whose node is not in it is
    fenced and exits.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterable, Mapping

from oobleck_elastic.elastic.protocol.keys import generation_of, key
from oobleck_elastic.elastic.protocol.side import Side
from oobleck_elastic.elastic.protocol.waits import WaitTimeout
from oobleck_elastic.elastic.reachability import left_out
from oobleck_elastic.elastic.records import GenerationRecord, Outcome, StepDecision
from oobleck_elastic.errors import OobleckError

__all__ = ["Fenced", "StepAborted", "WorkerSide"]

logger = logging.getLogger(__name__)

Probe = Callable[[Mapping[int, list[tuple[str, int]]]], set[int]]
"""Which of the nodes (each with its workers' responders) this worker cannot reach
(runtime.reach.unreachable)."""

LIVENESS_CHECK_S = 0.05  # how often a commit wait looks for dead members (store round trips)


class StepAborted(Exception):
    """The step was aborted by another worker (a member failed before the commit)."""


class Fenced(OobleckError):
    """This worker is not part of the generation that won: it must stop without touching the
    run's state (its node was taken for dead, or it is behind the others)."""


class WorkerSide(Side):
    # --- the job --------------------------------------------------------------------------

    def check_same_job(self, job: dict[str, object]) -> None:
        """Every node must train the same job: the first to get here publishes its description
        (a flat {dotted key: value} of the model's fingerprint and the config that shapes
        training and plans); anyone else whose description differs is refused, naming the keys."""
        self.store.create_json(key("job"), job)
        run = self.store.get_json(key("job"), 10.0)
        differ = sorted(k for k in set(run) | set(job) if run.get(k) != job.get(k))
        if differ:
            shown = "; ".join(f"{k} = {job.get(k)!r} here, {run.get(k)!r} in the run" for k in differ[:5])
            more = f" (and {len(differ) - 5} more)" if len(differ) > 5 else ""
            raise OobleckError(f"this node was started with another job than the run it joins: {shown}{more}. "
                               "Start every node with the same model and config, or give this job its own --rdzv-id")

    def instance(self) -> tuple[str, float]:
        """This start of the run: one random id and the wall time it began, the first worker's,
        that every worker and joiner reads (runtime/checkpoint/manifest.py Note: [newest checkpoint])."""
        self.store.create_json(key("instance"), {"id": uuid.uuid4().hex[:12], "at": self.clocks.wall()})
        record = self.store.get_json(key("instance"), 10.0)
        return str(record["id"]), float(record["at"])

    def max_nodes(self) -> int | None:
        """The job's limit on nodes (torchrun's --nnodes=MIN:MAX), written before generation 0."""
        return (self.store.try_get_json(key("limits")) or {}).get("max_nodes")

    def publish_profile(self, profile: object) -> None:
        self.store.set_json(key("profile"), profile)

    def profile(self, timeout: float) -> object:
        return self.store.get_json(key("profile"), timeout)

    # --- generations ----------------------------------------------------------------------

    def propose(self, record: GenerationRecord, timeout: float) -> GenerationRecord:
        """Writes generation/<g> if nobody has (compare-and-set) and returns the record that won.
        The pointer only moves forward: a stale proposer that lost never rolls it back."""
        g = record.generation
        self.store.create_json(key("generation", generation=g), record.to_json())
        won = self.store.get_json(key("generation", generation=g), timeout)
        if self.store.try_get_json(key("generation", generation=g + 1)) is None:
            self.store.set_json(key("pointer"), won)
        return GenerationRecord.from_json(won)

    def publish_first(self, record: GenerationRecord) -> None:
        """Generation 0, planned, by the first node's first worker (the pointer stays the
        rendezvous's bare record until the first change: that is how a joiner knows it joins)."""
        self.store.create_json(key("generation", generation=0), record.to_json())

    def first(self, timeout: float) -> GenerationRecord:
        """Generation 0 as the first node's first worker wrote it."""
        def check() -> GenerationRecord | None:
            if (failed := self.store.try_get_json(key("start_error"))) is not None:
                raise OobleckError(failed["error"])
            return self.try_record(0)
        return self.wait("generation 0 (the first node's first worker writes it; elastic.join_timeout_s)",
                         check, timeout)

    def built(self, generation: int, workers: int, nodes: Iterable[int], timeout: float,
              silent: Callable[[], bool] = lambda: False) -> None:
        """Counts this worker built into `generation` and waits for all `workers` to be; a member
        dying meanwhile aborts the build (StepAborted), as does `silent()` turning true (the
        worker's peer watch found a member silent: Note: [silent members] in elastic/peer_watch.py)."""
        built = key("built", generation=generation)
        self.store.add(built, 1)
        nodes = list(nodes)

        def check() -> bool:
            if silent() or self.liveness.dead(nodes):
                raise StepAborted(f"a member of generation {generation} died while it was built")
            if self._recovering(generation):  # a member's build failed
                raise StepAborted(f"a member of generation {generation} failed to build it and is recovering")
            return self.store.add(built, 0) >= workers
        try:
            self.wait(f"every member of generation {generation} to build it", check, timeout)
        except WaitTimeout as exc:
            raise StepAborted(str(exc)) from exc

    def complete(self, generation: int, workers: int) -> bool:
        """Whether all `workers` of `generation` finished building it."""
        return self.store.add(key("built", generation=generation), 0) >= workers

    def forget_generations_before(self, generation: int) -> int:
        """Deletes the working keys of the generations before `generation` (Note: [store
        keys]); how many went. Only once every member has built `generation`."""
        return self.store.delete_keys(k for k in self.store.keys()
                                      if (g := generation_of(k)) is not None and g < generation)

    # --- steps ----------------------------------------------------------------------------

    def commit_step(self, generation: int, step: int, world_size: int, members: Iterable[int], timeout: float,
                    max_nodes: int | None = None, silent: Callable[[], bool] = lambda: False) -> StepDecision:
        """Reports this worker ready for `step` and waits for the decision (Note: [step
        transaction]); raises StepAborted if the step was aborted. A member that dies meanwhile
        aborts it: its lease stands still, or `silent()` turns true (as in `built`)."""
        decision_key = key("decision", generation=generation, step=step)
        members = list(members)
        if self.store.add(key("ready", generation=generation, step=step), 1) == world_size:
            # a stop requested before any worker reported ready is seen here (it was written first)
            stop = self.stop_requested()
            joiners = () if stop else tuple(self.ready_joiners(members, max_nodes))
            if self.store.create_json(decision_key, StepDecision(Outcome.COMMIT, joiners, stop).to_json()):
                # Everyone reported ready for this step, so everyone has read the previous
                # step's decision: its keys can go (a long run would otherwise pile up two a step).
                for name in ("ready", "decision"):
                    self.store.delete(key(name, generation=generation, step=step - 1))
        deadline = self.clocks.clock() + timeout
        next_check = self.clocks.clock() + LIVENESS_CHECK_S

        def check() -> StepDecision | None:
            nonlocal next_check
            if (decision := self.store.try_get_json(decision_key)) is not None:
                return StepDecision.from_json(decision)
            now = self.clocks.clock()
            if now > deadline or silent() or (now > next_check and (
                    self._recovering(generation) or self.liveness.dead(members))):
                return self.decide_abort(generation, step)
            if now > next_check:
                next_check = now + LIVENESS_CHECK_S
            return None
        decision = self.wait(f"the decision on step {step} of generation {generation}", check, timeout + 10.0)
        if decision.outcome is not Outcome.COMMIT:
            raise StepAborted(f"step {step} of generation {generation} was aborted")
        return decision

    def decide_abort(self, generation: int, step: int) -> StepDecision:
        """Aborts the step unless it is already committed; returns the decision that stands."""
        decision = key("decision", generation=generation, step=step)
        self.store.create_json(decision, StepDecision(Outcome.ABORT).to_json())
        return StepDecision.from_json(self.store.get_json(decision, 10.0))

    def aborted(self, generation: int, step: int) -> bool:
        """Whether a worker has aborted `step` of `generation` (began a recovery from it)."""
        decision = self.store.try_get_json(key("decision", generation=generation, step=step))
        return decision is not None and StepDecision.from_json(decision).outcome is Outcome.ABORT


    def record_evaluation(self, step: int) -> None:
        """Rank 0 has the evaluation after `step` (every worker took part in it): a failure
        after it does not run it again (Built.evaluated)."""
        self.store.set_json(key("evaluated", step=step), True)

    def evaluated(self, step: int) -> bool:
        return self.store.try_get_json(key("evaluated", step=step)) is not None

    # --- membership -----------------------------------------------------------------------

    def report_ready(self, node: int, workers: int) -> None:
        """One worker of a joining node is ready (profiled, planned): the node is ready once all
        `workers` of it are, not when its first one is."""
        self.store.set_json(key("node workers", node=node), workers)
        self.store.add(key("node ready", node=node), 1)

    def ready_joiners(self, members: Iterable[int], max_nodes: int | None = None) -> list[int]:
        """Registered nodes, not members and not dead, whose workers are all ready, the oldest
        first and no more than `max_nodes` leaves room for: the others wait, ready, until a
        member is lost."""
        members = set(members)
        ready = [n for n in range(self.registered())
                 if n not in members and self._is_ready(n) and not self.liveness.dead([n])]
        return ready if max_nodes is None else ready[:max(0, max_nodes - len(members))]

    def _is_ready(self, node: int) -> bool:
        workers = self.store.try_get_json(key("node workers", node=node))
        return workers is not None and self.store.add(key("node ready", node=node), 0) >= workers

    def _recovering(self, generation: int) -> bool:
        """Whether a member began a recovery from `generation` (its roll call started)."""
        return bool(self.store.try_get_json(key("rollcall started", generation=generation)))

    def roll_call(self, generation: int, me: tuple[int, int], members: list[int], workers_per_node: int,
                  timeout: float, suspect_after: float, silent: Iterable[int] = (),
                  probe: Probe | None = None) -> tuple[list[int], list[int]]:
        """Checks in and waits for the roll call (Note: [roll call]); returns (alive, dead) nodes.
        A failure is known here, so a member that has not checked in is dead as soon as its
        lease has stood still for `suspect_after` seconds (a few heartbeats), not a whole lease
        timeout; at once if it is among `silent` (this worker's peer watch saw its lease stand
        still that long already: Note: [silent members] in elastic/peer_watch.py). The dead
        are marked so (a node that joined once and died is never admitted), and a node marked
        dead is dead here even if it answers (its workers fence themselves). Where every member
        answered and none is dead, `probe` (runtime.reach.unreachable) gathers the evidence of
        Note: [gray failures] (elastic/reachability.py), and the nodes it leaves out are dead."""
        silent = set(silent)
        self.store.set_json(key("rollcall started", generation=generation), True)
        self.store.set_json(key("rollcall", generation=generation, node=me[0], rank=me[1]), True)
        deadline = self.clocks.clock() + timeout
        while True:
            present = {n for n in members if all(
                self.store.try_get_json(key("rollcall", generation=generation, node=n, rank=w))
                for w in range(workers_per_node))}
            # a death mark is final, even on a node that answers: another survivor's roll call
            # took it for dead (late on a loaded machine) and every build with it would abort
            # (the chaos run found survivors replaying such a generation until they gave up)
            present -= {n for n in present if self.liveness.marked_dead(n)}
            missing = set(members) - present
            dead = (missing & silent) | self.liveness.dead(missing - silent, timeout=suspect_after)
            if (me[0] not in present or me[0] in dead) and self.moved_on_without(generation, me[0]):
                # woken after the others chose the next generation without this node: it is
                # fenced now, not at the roll call's deadline (its check-in is long gone)
                return sorted(present - {me[0]}), sorted(missing | {me[0]})
            if present | dead == set(members) or self.clocks.clock() > deadline:
                absent = sorted(missing)
                # A worker whose own node is not among those present (marked dead while it hung,
                # its check-in cleared since) is stale: it is fenced, and marks nobody. Woken
                # past its deadline, it would otherwise mark every live node dead, whose keys
                # of this old roll call are gone (two chaos runs lost their last survivors so).
                for node in absent if me[0] in present else ():
                    if not self.liveness.marked_dead(node):
                        # who marked whom, and on what evidence: a mark is final (see above)
                        seen = self.liveness.last_seen(node)
                        logger.warning("[node %d] roll call of generation %d: node %d missed it (lease %s, "
                                       "unchanged for %.2f s here); marking it dead", me[0], generation, node,
                                       seen[0] if seen else None, seen[1] if seen else -1.0)
                        self.liveness.mark_dead(node, f"missed the roll call of generation {generation}")
                if not absent and probe is not None and len(present) > 1 and me[0] in present:
                    out = set(self._cut_off(generation, me, sorted(present), workers_per_node, deadline, probe))
                    return sorted(present - out), sorted(out)
                return sorted(present), absent
            self.clocks.sleep(max(0.005, self.store.poll_s))

    def _cut_off(self, generation: int, me: tuple[int, int], present: list[int], workers_per_node: int,
                 deadline: float, probe: Probe) -> tuple[int, ...]:
        """Note: [gray failures]: this worker's probe of the other members' responders, written
        down; once every member's workers wrote theirs (or at `deadline`), the nodes to leave
        out, marked dead with the evidence."""
        endpoints = {n: [(str(e[0]), int(e[1])) for w in range(workers_per_node)
                         if (e := self.store.try_get_json(key("responder", node=n, rank=w))) is not None]
                     for n in present if n != me[0]}
        mine = probe(endpoints)
        self.store.set_json(key("reach report", generation=generation, node=me[0], rank=me[1]), sorted(mine))
        while True:
            reports: dict[int, set[int]] = {}
            missing = 0
            for n in present:
                for w in range(workers_per_node):
                    got = self.store.try_get_json(key("reach report", generation=generation, node=n, rank=w))
                    if got is None:
                        missing += 1
                    else:
                        reports.setdefault(n, set()).update(got)
            if not missing or self.clocks.clock() > deadline:
                break
            self.clocks.sleep(max(0.005, self.store.poll_s))
        out = left_out(present, reports)
        for node in out:
            by = sorted(n for n, them in reports.items() if node in them)
            if node == me[0]:
                logger.error("[node %d] cut off from the other nodes on the data network (nodes %s could not reach "
                             "it, it could not reach %s); leaving the run", node, by, sorted(mine))
            elif not self.liveness.marked_dead(node):
                logger.warning("[node %d] roll call of generation %d: node %d is cut off on the data network "
                               "(nodes %s could not reach it); marking it dead", me[0], generation, node, by)
                self.liveness.mark_dead(node, f"cut off on the data network in the roll call of generation "
                                              f"{generation}: nodes {by} could not reach it")
        return out

    def moved_on_without(self, generation: int, node: int) -> bool:
        """Whether generation `generation` + 1 was decided, and without `node`: a worker of that
        node that finds this (woken from a hang, back from a partition) is fenced before it
        writes anything for the old generation, whose keys the others may have swept."""
        record = self.try_record(generation + 1)
        return record is not None and node not in record.nodes

    # --- what the reporting worker mirrors for the launcher (monitoring.run_report.Mirror) ---

    def publish_progress(self, record: dict) -> None:
        self.store.set_json(key("progress"), record)

    def progress(self) -> dict | None:
        return self.store.try_get_json(key("progress"))

    def publish_recovery(self, record: dict) -> None:
        self.store.set_json(key("recovery", generation=record["generation"]), record)

    def publish_resumed(self, record: dict) -> None:
        self.store.set_json(key("resumed"), record)

    def publish_done(self, record: dict) -> None:
        self.store.set_json(key("done"), record)

