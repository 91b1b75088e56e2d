"""Liveness and agreement on the membership store: leases, step commits, roll calls.

Note: [step transaction]
    Step k of generation g is committed when every member worker has finished its collectives
    for it: each adds 1 to `gen<g>/step<k>/ready`; the one that brings it to the world size
    writes `gen<g>/step<k>/decision` = "commit" with compare-and-set, with the node ids of
    joiners that are ready (everyone then grows the job at the same step boundary), or with
    `stop` when a stop was requested (`request_stop`: everyone then writes the final checkpoint
    after this step and exits; Note: [stop on request] in elastic/worker.py). A worker that fails, or
    that sees a member dead while waiting, writes "abort" with the same compare-and-set, so a
    late commit cannot race an abort: exactly one decision exists. Committed: every survivor
    applies its optimizer step (local work, nothing can fail remotely). Aborted: gradients are
    dropped everywhere and the step is replayed with the same samples in generation g+1.
    The worker whose commit wins deletes the keys of step k-1, which everyone has read by then.

Note: [roll call]
    After a failure every surviving worker checks in under `rollcall/<g>/<node>/<rank>`. The
    roll call is complete when every member node of g has all its workers checked in or is
    known dead (marked dead by its launcher or its agent, or its heartbeat lease stood still
    for `elastic.rollcall_window_s`: a failure is known by then, so a silent agent is not given
    the whole lease timeout), or at `elastic.agreement_timeout_s`. The heartbeat runs in the
    agent, not in the workers, so a live node whose workers are slow to notice the failure
    keeps its lease moving and is waited for. The lowest complete node proposes generation g+1 (its
    complete nodes, the committed step count) with compare-and-set on `generation/<g+1>`;
    everyone adopts whatever won. A worker whose node is not in it is fenced and exits.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable

from oobleck_elastic.elastic.store import MembershipStore
from oobleck_elastic.errors import OobleckError

__all__ = ["Fenced", "Heartbeat", "check_same_job", "LeaseWatcher", "StepAborted", "commit_step", "current_generation",
           "decide_abort", "roll_call", "propose_generation", "mark_dead", "ready_joiners", "report_ready", "request_stop"]

logger = logging.getLogger(__name__)


class StepAborted(Exception):
    """The step was aborted by another worker (a member failed before the commit)."""


class Fenced(Exception):
    """This worker is not part of the generation that won: it must stop without touching the
    run's state (its node was taken for dead, or it is behind the others)."""


def mark_dead(store: MembershipStore, node: int, why: str) -> None:
    store.set_json(f"nodes/{node}/dead", {"why": why, "at": time.time()})


class Heartbeat:
    """An agent's lease: a counter bumped every `interval` seconds by a daemon thread."""

    def __init__(self, store: MembershipStore, node: int, interval: float) -> None:
        self.store, self.node, self.interval = store, node, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"oobleck-heartbeat-{node}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        failures = 0
        while not self._stop.wait(self.interval):
            try:
                self.store.add(f"lease/{self.node}", 1)
                failures = 0
            except Exception as exc:  # a store hiccup must not end the lease: try again next beat
                failures += 1
                if failures in (1, 10) or failures % 100 == 0:
                    logger.warning("[node %d] lease renewal failed (%d in a row): %s", self.node, failures,
                                   str(exc).splitlines()[0][:160])

    def stop(self) -> None:
        self._stop.set()


class LeaseWatcher:
    """Decides which nodes are dead: marked dead, or lease unchanged for `timeout` seconds
    (`dead(..., timeout=...)` takes a shorter one where a failure is already known)."""

    def __init__(self, store: MembershipStore, timeout: float) -> None:
        self.store, self.timeout = store, timeout
        self._seen: dict[int, tuple[int, float]] = {}

    def dead(self, nodes: Iterable[int], timeout: float | None = None) -> set[int]:
        timeout = self.timeout if timeout is None else timeout
        now = time.monotonic()
        out = set()
        for node in nodes:
            if self.store.try_get_json(f"nodes/{node}/dead") is not None:
                out.add(node)
                continue
            beat = self.store.add(f"lease/{node}", 0)
            last = self._seen.get(node)
            if last is None or last[0] != beat:
                self._seen[node] = (beat, now)
            elif now - last[1] > timeout:
                out.add(node)
        return out

    def failed_at(self, node: int) -> float | None:
        """Wall time of the first sign of `node`'s failure: a fault injector's record of the
        kill, else when it was marked dead, else its last observed lease renewal."""
        for key in (f"faults/{node}", f"nodes/{node}/dead"):
            if (record := self.store.try_get_json(key)) is not None:
                return record.get("time", record.get("at"))
        if node in self._seen:
            return time.time() - (time.monotonic() - self._seen[node][1])
        return None


def check_same_job(store: MembershipStore, job: dict[str, object]) -> None:
    """Every node must train the same job: the first to get here publishes its description (a
    flat {dotted key: value} of the model's fingerprint and the config that shapes training and
    plans); anyone else whose description differs is refused, naming the keys."""
    store.create_json("job", job)
    run = store.get_json("job", 10.0)
    differ = sorted(k for k in set(run) | set(job) if run.get(k) != job.get(k))
    if differ:
        shown = "; ".join(f"{k} = {job.get(k)!r} here, {run.get(k)!r} in the run" for k in differ[:5])
        more = f" (and {len(differ) - 5} more)" if len(differ) > 5 else ""
        raise OobleckError(f"this node was started with another job than the run it joins: {shown}{more}. "
                           "Start every node with the same model and config, or give this job its own --rdzv-id")


def report_ready(store: MembershipStore, node: int, workers: int) -> None:
    """One worker of a joining node is ready (profiled, planned): the node is ready once all
    `workers` of it are, not when its first one is."""
    store.set_json(f"nodes/{node}/workers", workers)
    store.add(f"nodes/{node}/ready", 1)


def _is_ready(store: MembershipStore, node: int) -> bool:
    workers = store.try_get_json(f"nodes/{node}/workers")
    return workers is not None and store.add(f"nodes/{node}/ready", 0) >= workers


def ready_joiners(store: MembershipStore, members: Iterable[int], max_nodes: int | None = None,
                  watcher: LeaseWatcher | None = None) -> list[int]:
    """Registered nodes, not members and not dead (marked, or with `watcher`, a lease that has
    stood still), whose workers are ready to be admitted, the oldest first and no more than
    `max_nodes` (the job's `limits`, torchrun's `--nnodes=MIN:MAX`) leaves room for: the others
    wait, ready, until a member is lost."""
    members = set(members)
    ready = [n for n in range(store.add("nodes/next", 0))
             if n not in members and _is_ready(store, n)
             and store.try_get_json(f"nodes/{n}/dead") is None
             and not (watcher is not None and watcher.dead([n]))]
    return ready if max_nodes is None else ready[:max(0, max_nodes - len(members))]


def request_stop(store: MembershipStore, by: str) -> None:
    """Asks the run to stop after the step being computed (the next commit carries it); `by`
    says who asked, for the logs."""
    store.set_json("stop", {"by": by, "at": time.time()})


def commit_step(store: MembershipStore, generation: int, step: int, world_size: int, members: Iterable[int],
                watcher: LeaseWatcher, timeout: float, max_nodes: int | None = None) -> tuple[list[int], bool]:
    """Reports this worker ready for `step` and waits for the decision (Note: [step transaction]).
    Returns the nodes to admit after this step and whether the run stops after it; raises
    StepAborted if the step was aborted."""
    key = f"gen{generation}/step{step}"
    members = list(members)
    if store.add(f"{key}/ready", 1) == world_size:
        # a stop requested before any worker reported ready is seen here (it was written first)
        stop = store.try_get_json("stop") is not None
        joiners = [] if stop else ready_joiners(store, members, max_nodes, watcher)
        if store.create_json(f"{key}/decision", {"outcome": "commit", "join": joiners, "stop": stop}):
            # Everyone reported ready for this step, so everyone has read the previous step's
            # decision: its keys can go (a long run would otherwise pile up two keys a step).
            for name in ("ready", "decision"):
                store.delete(f"gen{generation}/step{step - 1}/{name}")
    deadline = time.monotonic() + timeout
    next_check = time.monotonic() + 0.05
    while True:
        decision = store.try_get_json(f"{key}/decision")
        if decision is not None:
            break
        now = time.monotonic()
        if now > deadline or (now > next_check and (  # liveness costs store round trips
                store.try_get_json(f"rollcall/{generation}/started") or watcher.dead(members))):
            decide_abort(store, generation, step)
            continue  # read whichever decision won
        if now > next_check:
            next_check = now + 0.05
        time.sleep(store.poll_s)
    if decision["outcome"] != "commit":
        raise StepAborted(f"step {step} of generation {generation} was aborted")
    return decision["join"], bool(decision.get("stop"))


def decide_abort(store: MembershipStore, generation: int, step: int) -> str:
    """Aborts the step unless it is already committed; returns the outcome that stands."""
    key = f"gen{generation}/step{step}/decision"
    store.create_json(key, {"outcome": "abort", "join": []})
    return store.get_json(key, 10.0)["outcome"]


def roll_call(store: MembershipStore, generation: int, me: tuple[int, int], members: list[int],
              workers_per_node: int, watcher: LeaseWatcher, timeout: float,
              suspect_after: float) -> tuple[list[int], list[int]]:
    """Checks in and waits for the roll call (Note: [roll call]); returns (alive, dead) nodes.
    A failure is known here, so a member that has not checked in is dead as soon as its lease
    has stood still for `suspect_after` seconds (a few heartbeats), not a whole lease timeout.
    The dead are marked so (a node that joined once and died is never admitted again)."""
    store.set_json(f"rollcall/{generation}/started", True)
    store.set_json(f"rollcall/{generation}/{me[0]}/{me[1]}", True)
    deadline = time.monotonic() + timeout
    while True:
        present = {n for n in members if all(store.try_get_json(f"rollcall/{generation}/{n}/{w}")
                                             for w in range(workers_per_node))}
        dead = watcher.dead(set(members) - present, timeout=suspect_after)
        if present | dead == set(members) or time.monotonic() > deadline:
            absent = sorted(set(members) - present)
            for node in absent:
                if store.try_get_json(f"nodes/{node}/dead") is None:
                    mark_dead(store, node, f"missed the roll call of generation {generation}")
            return sorted(present), absent
        time.sleep(max(0.005, store.poll_s))


def current_generation(store: MembershipStore, timeout: float) -> dict:
    """The newest generation record. The `generation` pointer is a hint that may lag (it is
    written after each compare-and-set, not with it), so the records after it are looked for."""
    record = store.get_json("generation", timeout)
    while (newer := store.try_get_json(f"generation/{record['generation'] + 1}")) is not None:
        record = newer
    return record


def propose_generation(store: MembershipStore, generation: int, record: dict, timeout: float) -> dict:
    """Writes generation/<g> if nobody has (compare-and-set) and returns the record that won.
    The pointer only moves forward: a stale proposer that lost never rolls it back."""
    store.create_json(f"generation/{generation}", record)
    won = store.get_json(f"generation/{generation}", timeout)
    if store.try_get_json(f"generation/{generation + 1}") is None:
        store.set_json("generation", won)
    return won

