"""The run's protocol on the membership store: the only module that knows its keys and calls
(propose, fence, commit, decide, roll call, join, leases). Every wait goes through
`wait_until`, with a deadline, the store's poll interval and an error naming what was awaited.
Values are elastic/records.py's.

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

Note: [lease age]
    A lease that stands still is judged by two clocks. The reader's own: the lease has not
    moved for the whole timeout since the reader first saw its value. And the writer's: each
    beat carries its agent's wall time, so a reader that first looks after a failure (the roll
    call) knows the lease had already stood still before it looked. The writer's time alone
    would let a reader whose clock runs ahead take a live node for dead, so it counts only
    once the reader itself has seen the lease stand still for two thirds of the timeout (two
    beats of the roll call's three). A node killed just after a beat is then dead about
    2/3 of the window after the roll call starts, not a whole window (torch's own rendezvous
    compares its nodes' wall-clock heartbeats the same way, without the guard).

Note: [store keys]
    A run's records stay in the store after it ends (RECORDS: the generation records, the
    recoveries, the end record, each node's registration and its end); everything else is
    working state and goes. Generation g's keys (`gen<g>/`: its steps, its build count and
    torch's process-group bootstrap; `rollcall/<g>/`) are deleted by generation g+k's rank 0
    after its first commit: every member has built g+k by then, so nobody still in the run reads
    them, and a stale member of g that wakes up finds no commit to join (a fresh `ready` count
    cannot reach g's world size without the others) and is fenced. A checkpoint's count of
    written layers goes when the checkpoint is published (a background write may still add to
    it after its generation ended; a count left by a failure goes at the end). What the agents use (leases,
    readiness, torch's agent bookkeeping) goes when the last node leaves a finished run.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Callable, Iterable
from typing import TypeVar

from oobleck_elastic.elastic.records import DeadMark, GenerationRecord, Outcome, StepDecision
from oobleck_elastic.elastic.stores import MembershipStore
from oobleck_elastic.errors import OobleckError

__all__ = ["Fenced", "Protocol", "StepAborted", "WaitTimeout", "wait_until"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
# The keys a run leaves behind (Note: [store keys]); docs/launching.md, "etcd keys".
RECORDS = re.compile(r"generation(/\d+)?|recovery/\d+|progress|done|resumed|failed|start_error|stop|closed"
                     r"|limits|job|instance|profile|nodes/next|nodes/\d+(/dead|/left)?|checkpoint/\d+/damaged")
# a generation's working keys, but its checkpoint counts: a background write may still add to one
_GENERATION_KEY = re.compile(r"(?:gen|rollcall/)(\d+)/(?!checkpoint\d+$)")
LIVENESS_CHECK_S = 0.05  # how often a commit wait looks for dead members (store round trips)


class StepAborted(Exception):
    """The step was aborted by another worker (a member failed before the commit)."""


class Fenced(OobleckError):
    """This worker is not part of the generation that won: it must stop without touching the
    run's state (its node was taken for dead, or it is behind the others)."""


class WaitTimeout(OobleckError):
    """Something awaited on the store did not happen in time."""


def wait_until(what: str, check: Callable[[], T | None], timeout: float, poll_s: float, *,
               clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> T:
    """The first value of `check()` that is not None (or False), polled every `poll_s` seconds
    until `timeout`; then WaitTimeout naming `what` (say what should have happened)."""
    deadline = clock() + timeout
    while True:
        value = check()
        if value is not None and value is not False:
            return value
        if clock() > deadline:
            raise WaitTimeout(f"timed out after {timeout:.0f} s waiting for {what}")
        sleep(poll_s)


class Protocol:
    """One worker's (or agent's) side of the run's protocol on `store`. `lease_timeout`: how
    long a lease may stand still before its node is dead. `clock`/`sleep` are injectable so
    the protocol runs on a fake store and a fake clock in tests."""

    def __init__(self, store: MembershipStore, lease_timeout: float = 30.0, *,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 wall: Callable[[], float] = time.time) -> None:
        self.store, self.lease_timeout = store, lease_timeout
        self.clock, self.sleep, self.wall = clock, sleep, wall
        self._seen: dict[int, tuple[object, float]] = {}  # node -> (lease beat, when it last moved)
        self._beats: dict[int, int] = {}  # the beats this protocol renewed, per node

    def wait(self, what: str, check: Callable[[], T | None], timeout: float) -> T:
        return wait_until(what, check, timeout, self.store.poll_s, clock=self.clock, sleep=self.sleep)

    # --- the job ------------------------------------------------------------------------------

    def check_same_job(self, job: dict[str, object]) -> None:
        """Every node must train the same job: the first to get here publishes its description
        (a flat {dotted key: value} of the model's fingerprint and the config that shapes
        training and plans); anyone else whose description differs is refused, naming the keys."""
        self.store.create_json("job", job)
        run = self.store.get_json("job", 10.0)
        differ = sorted(k for k in set(run) | set(job) if run.get(k) != job.get(k))
        if differ:
            shown = "; ".join(f"{k} = {job.get(k)!r} here, {run.get(k)!r} in the run" for k in differ[:5])
            more = f" (and {len(differ) - 5} more)" if len(differ) > 5 else ""
            raise OobleckError(f"this node was started with another job than the run it joins: {shown}{more}. "
                               "Start every node with the same model and config, or give this job its own --rdzv-id")

    def instance(self) -> tuple[str, float]:
        """This start of the run: one random id and the wall time it began, the first worker's,
        that every worker and joiner reads (runtime/checkpoint.py Note: [newest checkpoint])."""
        self.store.create_json("instance", {"id": uuid.uuid4().hex[:12], "at": self.wall()})
        record = self.store.get_json("instance", 10.0)
        return str(record["id"]), float(record["at"])

    def max_nodes(self) -> int | None:
        """The job's limit on nodes (torchrun's --nnodes=MIN:MAX), written before generation 0."""
        return (self.store.try_get_json("limits") or {}).get("max_nodes")

    def publish_profile(self, profile: object) -> None:
        self.store.set_json("profile", profile)

    def profile(self, timeout: float) -> object:
        return self.store.get_json("profile", timeout)

    def finished(self) -> bool:
        return self.done() is not None

    def publish_failure(self, error: str, by: str) -> None:
        """The run cannot go on (a worker's fatal error): joiners stop waiting, the launcher
        stops the job and says why. The first failure stands."""
        self.store.create_json("failed", {"error": error, "by": by, "at": self.wall()})

    def failure(self) -> dict | None:
        return self.store.try_get_json("failed")

    # --- generations --------------------------------------------------------------------------

    def pointer(self, timeout: float) -> GenerationRecord:
        """The `generation` pointer: the rendezvous's bare record until the first change."""
        return GenerationRecord.from_json(self.store.get_json("generation", timeout))

    def record(self, generation: int, timeout: float = 10.0) -> GenerationRecord:
        return GenerationRecord.from_json(self.store.get_json(f"generation/{generation}", timeout))

    def try_record(self, generation: int) -> GenerationRecord | None:
        data = self.store.try_get_json(f"generation/{generation}")
        return None if data is None else GenerationRecord.from_json(data)

    def current(self, timeout: float) -> GenerationRecord:
        """The newest generation record. The pointer is a hint that may lag (it is written after
        each compare-and-set, not with it), so the records after it are looked for."""
        record = self.pointer(timeout)
        while (newer := self.try_record(record.generation + 1)) is not None:
            record = newer
        return record

    def propose(self, record: GenerationRecord, timeout: float) -> GenerationRecord:
        """Writes generation/<g> if nobody has (compare-and-set) and returns the record that won.
        The pointer only moves forward: a stale proposer that lost never rolls it back."""
        g = record.generation
        self.store.create_json(f"generation/{g}", record.to_json())
        won = self.store.get_json(f"generation/{g}", timeout)
        if self.store.try_get_json(f"generation/{g + 1}") is None:
            self.store.set_json("generation", won)
        return GenerationRecord.from_json(won)

    def publish_first(self, record: GenerationRecord) -> None:
        """Generation 0, planned, by the first node's first worker (the pointer stays the
        rendezvous's bare record until the first change: that is how a joiner knows it joins)."""
        self.store.create_json("generation/0", record.to_json())

    def refuse_start(self, error: str) -> None:
        """Generation 0 cannot be written (its checkpoint cannot be resumed): every worker fails
        with the same line."""
        self.store.set_json("start_error", {"error": error})

    def first(self, timeout: float) -> GenerationRecord:
        """Generation 0 as the first node's first worker wrote it."""
        def check() -> GenerationRecord | None:
            if (failed := self.store.try_get_json("start_error")) is not None:
                raise OobleckError(failed["error"])
            return self.try_record(0)
        return self.wait("generation 0 (the first node's first worker writes it; elastic.join_timeout_s)",
                         check, timeout)

    def built(self, generation: int, workers: int, nodes: Iterable[int], timeout: float) -> None:
        """Counts this worker built into `generation` and waits for all `workers` to be; a member
        dying meanwhile aborts the build (StepAborted)."""
        key = f"gen{generation}/built"
        self.store.add(key, 1)
        nodes = list(nodes)

        def check() -> bool:
            if self.dead(nodes):
                raise StepAborted(f"a member of generation {generation} died while it was built")
            if self.store.try_get_json(f"rollcall/{generation}/started"):  # a member's build failed
                raise StepAborted(f"a member of generation {generation} failed to build it and is recovering")
            return self.store.add(key, 0) >= workers
        try:
            self.wait(f"every member of generation {generation} to build it", check, timeout)
        except WaitTimeout as exc:
            raise StepAborted(str(exc)) from exc

    def complete(self, generation: int, workers: int) -> bool:
        """Whether all `workers` of `generation` finished building it."""
        return self.store.add(f"gen{generation}/built", 0) >= workers

    # --- steps --------------------------------------------------------------------------------

    def request_stop(self, by: str) -> None:
        """Asks the run to stop after the step being computed (the next commit carries it)."""
        self.store.set_json("stop", {"by": by, "at": self.wall()})

    def stop_requested(self) -> bool:
        return self.store.try_get_json("stop") is not None

    def commit_step(self, generation: int, step: int, world_size: int, members: Iterable[int], timeout: float,
                    max_nodes: int | None = None) -> StepDecision:
        """Reports this worker ready for `step` and waits for the decision (Note: [step
        transaction]); raises StepAborted if the step was aborted."""
        key = f"gen{generation}/step{step}"
        members = list(members)
        if self.store.add(f"{key}/ready", 1) == world_size:
            # a stop requested before any worker reported ready is seen here (it was written first)
            stop = self.store.try_get_json("stop") is not None
            joiners = () if stop else tuple(self.ready_joiners(members, max_nodes))
            if self.store.create_json(f"{key}/decision", StepDecision(Outcome.COMMIT, joiners, stop).to_json()):
                # Everyone reported ready for this step, so everyone has read the previous
                # step's decision: its keys can go (a long run would otherwise pile up two a step).
                for name in ("ready", "decision"):
                    self.store.delete(f"gen{generation}/step{step - 1}/{name}")
        deadline = self.clock() + timeout
        next_check = self.clock() + LIVENESS_CHECK_S

        def check() -> StepDecision | None:
            nonlocal next_check
            if (decision := self.store.try_get_json(f"{key}/decision")) is not None:
                return StepDecision.from_json(decision)
            now = self.clock()
            if now > deadline or (now > next_check and (
                    self.store.try_get_json(f"rollcall/{generation}/started") or self.dead(members))):
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
        key = f"gen{generation}/step{step}/decision"
        self.store.create_json(key, StepDecision(Outcome.ABORT).to_json())
        return StepDecision.from_json(self.store.get_json(key, 10.0))

    def aborted(self, generation: int, step: int) -> bool:
        """Whether a worker has aborted `step` of `generation` (began a recovery from it)."""
        decision = self.store.try_get_json(f"gen{generation}/step{step}/decision")
        return decision is not None and StepDecision.from_json(decision).outcome is Outcome.ABORT

    @staticmethod
    def _written_key(generation: int, step: int, final: bool) -> str:
        # a final write of a step counts apart from its interval write in the same generation:
        # one may follow the other (a stop at a checkpoint interval whose write failed)
        return f"gen{generation}/{'final' if final else 'checkpoint'}{step}"

    def record_evaluation(self, step: int) -> None:
        """Rank 0 has the evaluation after `step` (every worker took part in it): a failure
        after it does not run it again (Built.evaluated)."""
        self.store.set_json(f"evaluated/{step}", True)

    def evaluated(self, step: int) -> bool:
        return self.store.try_get_json(f"evaluated/{step}") is not None

    def checkpoint_written(self, generation: int, step: int, layers: int, final: bool = False) -> int:
        """Counts `layers` more layers of the checkpoint after `step` written; returns the total."""
        return self.store.add(self._written_key(generation, step, final), layers)

    def mark_damaged(self, step: int, publication: str, why: str) -> None:
        """That publication of the checkpoint of `step` (runtime.checkpoint.identity) failed its
        checksum: no fallback takes it again, though the step may be published anew (runtime/
        checkpoint.py Note: [newest checkpoint])."""
        self.store.set_json(f"checkpoint/{step}/damaged", {"publication": publication, "why": why, "at": self.wall()})

    def damaged(self) -> dict[int, str]:
        """step -> the publication of its checkpoint found damaged."""
        out = {}
        for key in self.store.keys():
            if (m := re.fullmatch(r"checkpoint/(\d+)/damaged", key)) and (mark := self.store.try_get_json(key)):
                out[int(m.group(1))] = str(mark.get("publication"))
        return out

    def restoring(self) -> set[int]:
        """The checkpoint step the newest generation restores, if it restores one: `keep` must
        not retire it while its members load it."""
        record = self.try_pointer()
        if record is None:
            return set()
        record = self.current(10.0)
        return {record.restored_from} if record.restored_from else set()

    def checkpoint_published(self, generation: int, step: int, final: bool = False) -> None:
        """The checkpoint after `step` is complete: its count can go (Note: [store keys])."""
        self.store.delete(self._written_key(generation, step, final))

    # --- membership ---------------------------------------------------------------------------

    def report_ready(self, node: int, workers: int) -> None:
        """One worker of a joining node is ready (profiled, planned): the node is ready once all
        `workers` of it are, not when its first one is."""
        self.store.set_json(f"nodes/{node}/workers", workers)
        self.store.add(f"nodes/{node}/ready", 1)

    def ready_joiners(self, members: Iterable[int], max_nodes: int | None = None) -> list[int]:
        """Registered nodes, not members and not dead, whose workers are all ready, the oldest
        first and no more than `max_nodes` leaves room for: the others wait, ready, until a
        member is lost."""
        members = set(members)
        ready = [n for n in range(self.store.add("nodes/next", 0))
                 if n not in members and self._is_ready(n) and not self.dead([n])]
        return ready if max_nodes is None else ready[:max(0, max_nodes - len(members))]

    def _is_ready(self, node: int) -> bool:
        workers = self.store.try_get_json(f"nodes/{node}/workers")
        return workers is not None and self.store.add(f"nodes/{node}/ready", 0) >= workers

    def mark_dead(self, node: int, why: str) -> None:
        self.store.set_json(f"nodes/{node}/dead", DeadMark(why, self.wall()).to_json())

    def roll_call(self, generation: int, me: tuple[int, int], members: list[int], workers_per_node: int,
                  timeout: float, suspect_after: float) -> tuple[list[int], list[int]]:
        """Checks in and waits for the roll call (Note: [roll call]); returns (alive, dead) nodes.
        A failure is known here, so a member that has not checked in is dead as soon as its
        lease has stood still for `suspect_after` seconds (a few heartbeats), not a whole lease
        timeout. The dead are marked so (a node that joined once and died is never admitted),
        and a node marked dead is dead here even if it answers (its workers fence themselves)."""
        self.store.set_json(f"rollcall/{generation}/started", True)
        self.store.set_json(f"rollcall/{generation}/{me[0]}/{me[1]}", True)
        deadline = self.clock() + timeout
        while True:
            present = {n for n in members if all(self.store.try_get_json(f"rollcall/{generation}/{n}/{w}")
                                                 for w in range(workers_per_node))}
            # a death mark is final, even on a node that answers: another survivor's roll call
            # took it for dead (late on a loaded machine) and every build with it would abort
            # (the chaos run found survivors replaying such a generation until they gave up)
            present -= {n for n in present if self.store.try_get_json(f"nodes/{n}/dead") is not None}
            dead = self.dead(set(members) - present, timeout=suspect_after)
            if present | dead == set(members) or self.clock() > deadline:
                absent = sorted(set(members) - present)
                # A worker whose own node is not among those present (marked dead while it hung,
                # its check-in cleared since) is stale: it is fenced, and marks nobody. Woken
                # past its deadline, it would otherwise mark every live node dead, whose keys
                # of this old roll call are gone (two chaos runs lost their last survivors so).
                for node in absent if me[0] in present else ():
                    if self.store.try_get_json(f"nodes/{node}/dead") is None:
                        # who marked whom, and on what evidence: a mark is final (see above)
                        seen = self._seen.get(node)
                        logger.warning("[node %d] roll call of generation %d: node %d missed it (lease %s, "
                                       "unchanged for %.2f s here); marking it dead", me[0], generation, node,
                                       seen[0] if seen else None, self.clock() - seen[1] if seen else -1.0)
                        self.mark_dead(node, f"missed the roll call of generation {generation}")
                return sorted(present), absent
            self.sleep(max(0.005, self.store.poll_s))

    # --- liveness -----------------------------------------------------------------------------

    def dead(self, nodes: Iterable[int], timeout: float | None = None) -> set[int]:
        """The nodes marked dead or whose lease stood still for `timeout` (default: the lease
        timeout; shorter where a failure is already known)."""
        timeout = self.lease_timeout if timeout is None else timeout
        now, out = self.clock(), set()
        for node in nodes:
            if self.store.try_get_json(f"nodes/{node}/dead") is not None:
                out.add(node)
                continue
            beat = self.store.try_get_json(f"lease/{node}")
            last = self._seen.get(node)
            if last is None or last[0] != beat:
                self._seen[node] = (beat, now)
                continue
            still = now - last[1]
            at = beat.get("at") if isinstance(beat, dict) else None
            if still > timeout or (at is not None and still >= timeout * 2 / 3 and self.wall() - at > timeout):
                out.add(node)  # Note: [lease age]
        return out

    def failed_at(self, node: int) -> float | None:
        """Wall time of the first sign of `node`'s failure: a fault injector's record of the
        kill; else the earlier of its lease's last renewal (a node that fails silently gives no
        other sign: its lease stands still from then; the time is the writer's clock) and its
        mark of death; else its last renewal observed here."""
        kill = self.store.try_get_json(f"faults/{node}")
        if isinstance(kill, dict) and isinstance(kill.get("time"), (int, float)):
            return float(kill["time"])
        signs = []
        for key, field in ((f"lease/{node}", "at"), (f"nodes/{node}/dead", "at")):
            record = self.store.try_get_json(key)
            if isinstance(record, dict) and isinstance(record.get(field), (int, float)):
                signs.append(float(record[field]))
        if signs:
            return min(signs)
        if node in self._seen:
            beat, seen = self._seen[node]
            if isinstance(beat, dict) and isinstance(beat.get("at"), (int, float)):
                return float(beat["at"])
            return self.wall() - (self.clock() - seen)
        return None

    def renew_lease(self, node: int) -> None:
        """One beat of `node`'s lease: a plain write of the beat's number and the writer's wall
        time (one etcd request, where a counter takes a read and a compare-and-set); readers look
        for it to change, and at its time once it stands still (Note: [lease age])."""
        self._beats[node] = self._beats.get(node, 0) + 1
        self.store.set_json(f"lease/{node}", {"beat": self._beats[node], "at": self.wall()})

    def record_kill(self, node: int, record: dict) -> None:
        """A fault injector's kill (the first sign of the failure, for `failed_at`)."""
        self.store.set_json(f"faults/{node}", record)

    # --- nodes, for agents and the launcher ---------------------------------------------------

    def register(self, info: dict[str, object]) -> int:
        """A new node id (an agent's), with what it says of itself (host, pid, heartbeat)."""
        node = self.store.add("nodes/next", 1) - 1
        self.store.set_json(f"nodes/{node}", info)
        return node

    def registered(self) -> int:
        return self.store.add("nodes/next", 0)

    def node_info(self, node: int) -> dict | None:
        return self.store.try_get_json(f"nodes/{node}")

    def limits(self) -> dict | None:
        return self.store.try_get_json("limits")

    def begin(self, min_nodes: int, max_nodes: int) -> None:
        """The run's limits and generation 0's bare record (its first members), once."""
        self.store.create_json("limits", {"min_nodes": min_nodes, "max_nodes": max_nodes})
        self.store.create_json("generation", GenerationRecord(generation=0, nodes=tuple(range(min_nodes))).to_json())

    def begun(self) -> bool:
        return self.store.try_get_json("generation") is not None

    def try_pointer(self) -> GenerationRecord | None:
        data = self.store.try_get_json("generation")
        return None if data is None else GenerationRecord.from_json(data)

    def leave(self, node: int) -> None:
        self.store.set_json(f"nodes/{node}/left", True)

    def has_left(self, node: int) -> bool:
        return self.store.try_get_json(f"nodes/{node}/left") is not None

    def close(self) -> None:
        self.store.set_json("closed", True)

    def closed(self) -> bool:
        return self.store.try_get_json("closed") is not None

    def forget_generations_before(self, generation: int) -> int:
        """Deletes the working keys of the generations before `generation` (Note: [store
        keys]); how many went. Only once every member has built `generation`."""
        return self.store.delete_keys(k for k in self.store.keys()
                                      if (m := _GENERATION_KEY.match(k)) and int(m.group(1)) < generation)

    def forget_working_state(self) -> int:
        """Deletes every key but the run's RECORDS, once no node is left in a finished run."""
        return self.store.delete_keys(k for k in self.store.keys() if not RECORDS.fullmatch(k))

    def everyone_left(self) -> bool:
        """Whether every node that registered has left or is marked dead."""
        return all(self.has_left(n) or self.store.try_get_json(f"nodes/{n}/dead") is not None
                   for n in range(self.registered()))

    # --- the reporting worker's mirror, read by the launcher ----------------------------------

    def publish_progress(self, record: dict) -> None:
        self.store.set_json("progress", record)

    def progress(self) -> dict | None:
        return self.store.try_get_json("progress")

    def publish_recovery(self, record: dict) -> None:
        self.store.set_json(f"recovery/{record['generation']}", record)

    def recovery(self, generation: int) -> dict | None:
        return self.store.try_get_json(f"recovery/{generation}")

    def publish_resumed(self, record: dict) -> None:
        self.store.set_json("resumed", record)

    def resumed(self) -> dict | None:
        return self.store.try_get_json("resumed")

    def publish_done(self, record: dict) -> None:
        self.store.set_json("done", record)

    def done(self) -> dict | None:
        """The run's end record (steps, and whether it stopped on request), or None."""
        return self.store.try_get_json("done")
