"""The run's protocol (elastic/protocol/, a worker's side) on a fake store and a fake clock: what other
workers do meanwhile is scheduled on the clock, so races, deaths and timeouts are exact and
take no real time. tests/store/test_membership.py runs the same protocol on a real store."""

from __future__ import annotations

import heapq
import itertools
from types import SimpleNamespace
from typing import Any

import pytest
from generation_records import record

from oobleck_elastic.config import load_config
from oobleck_elastic.elastic.ending import Ending
from oobleck_elastic.elastic.protocol import CheckpointSide, Clocks, StepAborted, WaitTimeout, WorkerSide, wait_until
from oobleck_elastic.elastic.protocol.keys import key
from oobleck_elastic.elastic.records import GenerationRecord, Outcome, RecordError, StepDecision
from oobleck_elastic.elastic.stores import MembershipStore, StoreTimeout, StoreUnreachable
from oobleck_elastic.errors import OobleckError
from oobleck_elastic.planning import WorkerRef


class FakeClock:
    """Monotonic time that moves only when someone sleeps; events scheduled `at` a time run
    when the clock passes it (another worker writing, a lease renewed)."""

    def __init__(self) -> None:
        self.now, self.slept = 0.0, 0
        self._events: list = []
        self._order = itertools.count()

    def __call__(self) -> float:
        return self.now

    def at(self, when: float, action) -> None:
        heapq.heappush(self._events, (when, next(self._order), action))

    def every(self, interval: float, action, until: float) -> None:
        for i in range(1, int(until / interval) + 1):
            self.at(i * interval, action)

    def sleep(self, seconds: float) -> None:
        self.slept += 1
        self.now += max(seconds, 1e-3)
        while self._events and self._events[0][0] <= self.now:
            heapq.heappop(self._events)[2]()


class FakeStore(MembershipStore):
    """The membership store as a dict, JSON in and out like the real ones."""

    run_id, poll_s = "fake", 0.01

    def __init__(self, clock: FakeClock) -> None:
        self.data: dict[str, Any] = {}
        self.clock = clock
        self.down = False

    @property
    def url(self) -> str:
        return "fake:0"

    def _up(self) -> None:
        if self.down:
            raise StoreUnreachable("the store does not answer")

    def set_json(self, key: str, value: Any) -> None:
        self._up()
        self.data[key] = value

    def try_get_json(self, key: str) -> Any | None:
        self._up()
        return self.data.get(key)

    def get_json(self, key: str, timeout: float) -> Any:
        deadline = self.clock() + timeout
        while (value := self.try_get_json(key)) is None:
            if self.clock() > deadline:
                raise StoreTimeout(f"waited {timeout:.0f} s for store key '{key}'")
            self.clock.sleep(self.poll_s)
        return value

    def add(self, key: str, amount: int) -> int:
        self._up()
        self.data[key] = self.data.get(key, 0) + amount
        return self.data[key]

    def create_json(self, key: str, value: Any) -> bool:
        self._up()
        if key in self.data:
            return False
        self.data[key] = value
        return True

    def delete(self, key: str) -> None:
        self._up()
        self.data.pop(key, None)

    def torch_store(self):
        raise NotImplementedError("no process groups on a fake store")

    def keys(self) -> list[str]:
        self._up()
        return list(self.data)

    def delete_keys(self, keys) -> int:
        self._up()
        return sum(self.data.pop(k, None) is not None for k in list(keys))


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(clock) -> FakeStore:
    return FakeStore(clock)


def protocol(store: FakeStore, clock: FakeClock, lease_timeout: float = 30.0) -> WorkerSide:
    return WorkerSide(store, lease_timeout, Clocks(clock, clock.sleep, clock))


def test_wait_until_returns_the_first_value_and_times_out_naming_what_it_awaited(clock):
    clock.at(0.5, lambda: values.append("ready"))
    values: list[str] = []
    assert wait_until("the value", lambda: values[0] if values else None, 10.0, 0.1,
                      clock=clock, sleep=clock.sleep) == "ready"
    assert 0.5 <= clock.now < 0.7
    with pytest.raises(WaitTimeout, match="timed out after 3 s waiting for node 7 to be admitted"):
        wait_until("node 7 to be admitted", lambda: None, 3.0, 0.1, clock=clock, sleep=clock.sleep)
    assert 3.5 < clock.now < 3.8


def test_a_wait_polls_at_once_then_less_often_up_to_its_longest_pause(clock):
    pauses: list[float] = []

    def sleep(seconds: float) -> None:
        pauses.append(seconds)
        clock.sleep(seconds)
    with pytest.raises(WaitTimeout):
        wait_until("nothing", lambda: None, 0.2, 0.002, poll_max_s=0.01, clock=clock, sleep=sleep)
    assert pauses[:5] == pytest.approx([0.002, 0.003, 0.0045, 0.00675, 0.01])
    assert set(pauses[5:]) == {0.01}, "no pause beyond the longest"


def test_the_last_worker_ready_commits_with_the_ready_joiners_and_clears_the_previous_step(store, clock):
    p = protocol(store, clock)
    store.add("nodes/next", 3)
    p.report_ready(2, 1)
    store.add("gen0/step4/ready", 1)  # the other member is ready already
    store.set_json("gen0/step3/decision", StepDecision(Outcome.COMMIT).to_json())
    assert p.commit_step(0, 4, 2, [0, 1], timeout=10.0) == StepDecision(Outcome.COMMIT, (2,))
    assert store.try_get_json("gen0/step3/decision") is None


def test_a_member_dead_while_others_wait_aborts_the_step_and_a_late_committer_sees_the_abort(store, clock):
    """Exactly one decision: node 1's worker, ready last after node 1 was taken for dead,
    cannot commit over the abort."""
    waiter = protocol(store, clock, lease_timeout=2.0)
    clock.every(0.5, lambda: store.add("lease/0", 1), until=60)  # node 0's agent beats; node 1's does not
    with pytest.raises(StepAborted, match="step 0 of generation 0 was aborted"):
        waiter.commit_step(0, 0, 2, [0, 1], timeout=60.0)
    assert 2.0 < clock.now < 3.0, "aborted once node 1's lease stood still for the lease timeout"
    late = protocol(store, clock)
    with pytest.raises(StepAborted):
        late.commit_step(0, 0, 2, [0, 1], timeout=60.0)
    assert store.try_get_json("gen0/step0/decision")["outcome"] == "abort"


def test_a_step_with_no_decision_by_the_timeout_is_aborted(store, clock):
    p = protocol(store, clock)
    clock.every(0.5, lambda: (store.add("lease/0", 1), store.add("lease/1", 1)), until=60)
    with pytest.raises(StepAborted):
        p.commit_step(0, 0, 2, [0, 1], timeout=5.0)
    assert 5.0 < clock.now < 5.5


def test_two_proposers_race_and_both_act_on_the_record_that_won(store, clock):
    a, b = protocol(store, clock), protocol(store, clock)
    store.set_json("generation", record(0).to_json())
    mine, theirs = record(1, nodes=((0, 1), (2,)), cause="a"), record(1, nodes=((0, 1),), cause="b")
    assert a.propose(mine, 1.0) == mine
    assert b.propose(theirs, 1.0) == mine, "the compare-and-set keeps the first"
    assert a.current(1.0) == mine


def test_a_stale_proposer_never_moves_the_pointer_back_and_readers_find_the_newest_record(store, clock):
    p = protocol(store, clock)
    store.set_json("generation", record(0).to_json())
    p.propose(record(1), 1.0)
    p.propose(record(2, nodes=((0, 1),)), 1.0)
    store.set_json("generation", record(1).to_json())  # a pointer write that lagged behind
    assert p.current(1.0).generation == 2, "the pointer lags; readers follow the records after it"
    assert p.propose(record(2, nodes=((2, 3),)), 1.0).nodes == (0, 1), "it lost: it adopts generation 2"
    p.propose(record(1, nodes=((2, 3),)), 1.0)  # a worker waking up with a proposal for an old generation
    assert store.try_get_json("generation")["generation"] == 2, "the pointer never moves back"


def test_a_stale_member_waking_up_aborts_nothing_committed_and_is_told_the_step_failed(store, clock):
    """A worker paused (SIGSTOP) through a failure wakes in its commit wait: the others took the
    roll call of its generation, so its step is aborted and it must recover (where it is fenced)."""
    store.set_json("gen0/step2/decision", StepDecision(Outcome.COMMIT).to_json())
    store.set_json("rollcall/0/started", True)
    stale = protocol(store, clock)
    assert stale.commit_step(0, 2, 2, [0, 1], 10.0).outcome is Outcome.COMMIT, "a commit stands"
    with pytest.raises(StepAborted):
        stale.commit_step(0, 3, 2, [0, 1], 10.0)
    assert stale.decide_abort(0, 2).outcome is Outcome.COMMIT, "an abort never overwrites a commit"


def test_the_roll_call_waits_for_beating_members_and_drops_silent_ones_after_the_window(store, clock):
    p = protocol(store, clock)
    clock.every(0.2, lambda: store.add("lease/3", 1), until=60)
    store.set_json("rollcall/0/1/0", True)
    clock.at(4.0, lambda: store.set_json("rollcall/0/3/0", True))  # node 3 notices late; node 2 is gone
    alive, dead = p.roll_call(0, (0, 0), [0, 1, 2, 3], 1, timeout=60.0, suspect_after=0.5)
    assert (alive, dead) == ([0, 1, 3], [2]) and 4.0 <= clock.now < 4.1
    assert store.try_get_json("nodes/2/dead")["why"] == "missed the roll call of generation 0"
    assert p.liveness.failed_at(2) == store.try_get_json("nodes/2/dead")["at"]


def test_the_first_sign_of_a_failure_is_the_earliest_of_the_kill_the_still_lease_and_the_mark(store, clock):
    """A node that dies silently gives no sign but its lease standing still: its recovery's
    detection time counts from the lease's last renewal, not from the roll call's mark of death
    (which comes after the survivors' step has failed, so detection read 0)."""
    p = protocol(store, clock)
    store.set_json("lease/4", {"beat": 17, "at": 1000.0})
    store.set_json("nodes/4/dead", {"why": "missed the roll call of generation 2", "at": 1011.5})
    assert p.liveness.failed_at(4) == 1000.0
    store.set_json("faults/4", {"time": 1000.4, "node": 4, "step": 3, "phase": "forward"})
    assert p.liveness.failed_at(4) == 1000.4, "an injected kill's own record is exact"
    store.set_json("lease/5", {"beat": 3, "at": 1020.0})  # its agent beat on after the worker died
    store.set_json("nodes/5/dead", {"why": "left", "at": 1012.0})
    assert p.liveness.failed_at(5) == 1012.0
    assert p.liveness.failed_at(6) is None


def test_a_lease_that_stood_still_before_the_roll_call_is_dead_sooner_but_never_on_the_writers_clock_alone(
        store, clock):
    wall = [1000.0]
    p = WorkerSide(store, clocks=Clocks(clock, clock.sleep, lambda: wall[0] + clock.now))
    store.set_json("lease/1", {"beat": 7, "at": 1000.0 - 0.4})  # node 1's last beat, 0.4 s before the roll call
    store.set_json("lease/2", {"beat": 3, "at": 1000.0 + 5.0})  # node 2's clock runs 5 s ahead of ours
    store.set_json("lease/3", 4)  # a beat without its time: the reader's clock only
    alive, dead = p.roll_call(0, (0, 0), [0, 1], 1, timeout=60.0, suspect_after=0.6)
    assert (alive, dead) == ([0], [1]) and 0.4 <= clock.now < 0.45, "2/3 of the window, not all of it"
    q = WorkerSide(store, clocks=Clocks(clock, clock.sleep, lambda: wall[0] + clock.now))
    start = clock.now
    assert q.roll_call(1, (0, 0), [0, 2, 3], 1, timeout=60.0, suspect_after=0.6) == ([0], [2, 3])
    assert 0.6 <= clock.now - start < 0.65, "a future or missing time waits the whole window"
    # a live node's lease moves within the window, however old its (wrong) time says it is
    clock.every(0.2, lambda: store.set_json("lease/4", {"beat": clock.now, "at": 0.0}), until=clock.now + 60)
    for _ in range(20):
        clock.sleep(0.1)
        assert not q.liveness.dead([4], timeout=0.6)


def test_the_roll_call_ends_at_its_timeout_and_marks_the_absent_dead(store, clock):
    p = protocol(store, clock)
    clock.every(0.2, lambda: store.add("lease/1", 1), until=60)  # beating, but its workers never check in
    assert p.roll_call(0, (0, 0), [0, 1], 1, timeout=5.0, suspect_after=0.5) == ([0], [1])
    assert 5.0 < clock.now < 5.1 and store.try_get_json("nodes/1/dead") is not None


def test_a_stale_worker_woken_past_its_roll_call_marks_nobody(store, clock):
    # node 0 hung through its roll call of generation 3 and was marked dead by the others, who
    # moved on (the keys of that roll call are gone); woken past the deadline it is fenced, and
    # must not mark the live node 1 dead for missing a roll call it answered long ago (two chaos
    # runs lost their last survivors to such marks)
    p = protocol(store, clock)
    clock.every(0.2, lambda: store.add("lease/1", 1), until=60)
    p.liveness.mark_dead(0, "missed the roll call of generation 3")
    assert p.roll_call(3, (0, 0), [0, 1], 1, timeout=5.0, suspect_after=0.5) == ([], [0, 1])
    assert store.try_get_json("nodes/1/dead") is None


def test_a_node_marked_dead_by_another_roll_call_is_dead_even_if_it_answers(store, clock):
    # survivor A's roll call took node 2 for dead (late on a loaded machine) while survivor B's
    # saw it and won the proposal: every build with node 2 aborts on its mark, so the next roll
    # call must leave it out, or the survivors replay the generation until they give up
    p = protocol(store, clock)
    p.liveness.mark_dead(2, "missed the roll call of generation 4")
    for node in (1, 2):
        store.set_json(f"rollcall/5/{node}/0", True)
    assert p.roll_call(5, (0, 0), [0, 1, 2], 1, timeout=60.0, suspect_after=0.5) == ([0, 1], [2])
    assert clock.now < 0.1


def test_a_roll_call_that_finds_everyone_present_leaves_out_the_node_cut_off_on_the_data_network(store, clock):
    """Note: [gray failures]: every member answered and every lease beats, so the probe's
    reports decide; the isolated node is marked dead with the evidence, and the node itself
    reads the same decision. Without a failed probe, or with a dead member, nobody is probed
    out."""
    for node in (1, 2, 3):
        store.set_json(f"reach/{node}/0", ["198.18.0.1", 9000 + node])
        store.set_json(f"rollcall/6/{node}/0", True)
    clock.at(0.3, lambda: [store.set_json(f"rollcall/6/reach/{n}/0", [2]) for n in (1, 3)])
    clock.at(0.5, lambda: store.set_json("rollcall/6/reach/2/0", [0, 1, 3]))
    asked = []

    def probe(endpoints):
        asked.append(endpoints)
        return {2}

    assert protocol(store, clock).roll_call(6, (0, 0), [0, 1, 2, 3], 1, timeout=60.0, suspect_after=0.5,
                                            probe=probe) == ([0, 1, 3], [2])
    assert asked == [{n: [("198.18.0.1", 9000 + n)] for n in (1, 2, 3)}] and 0.5 <= clock.now < 0.6
    assert store.try_get_json("rollcall/6/reach/0/0") == [2]
    assert "nodes [0, 1, 3] could not reach it" in store.try_get_json("nodes/2/dead")["why"]
    # node 2 itself decides the same from the same reports: it is out, and marks nobody
    store.set_json("rollcall/6/0/0", True)
    assert protocol(store, clock).roll_call(6, (2, 0), [0, 1, 2, 3], 1, timeout=60.0, suspect_after=0.5,
                                            probe=lambda endpoints: {0, 1, 3})[1] == [2]
    # everyone reached: the same nodes go on
    for node in (1, 3):
        store.set_json(f"rollcall/7/{node}/0", True)
        store.set_json(f"rollcall/7/reach/{node}/0", [])
    assert protocol(store, clock).roll_call(7, (0, 0), [0, 1, 3], 1, timeout=60.0, suspect_after=0.5,
                                            probe=lambda endpoints: set()) == ([0, 1, 3], [])


def test_a_build_waits_for_every_member_and_fails_when_one_dies_or_time_runs_out(store, clock):
    p = protocol(store, clock)
    clock.at(1.0, lambda: store.add("gen1/built", 1))
    p.built(1, 2, [0, 1], timeout=10.0)
    clock.at(clock.now + 1.0, lambda: p.liveness.mark_dead(1, "its agent exited"))
    with pytest.raises(StepAborted, match="a member of generation 2 died while it was built"):
        p.built(2, 2, [0, 1], timeout=10.0)
    clock.every(0.2, lambda: store.add("lease/1", 1), until=clock.now + 60)
    with pytest.raises(StepAborted, match="every member of generation 3 to build it"):
        p.built(3, 2, [0], timeout=10.0)
    assert p.complete(1, 2) and not p.complete(3, 2)


def test_generation_0_or_its_start_error_reaches_every_waiting_worker(store, clock):
    p = protocol(store, clock)
    clock.at(1.0, lambda: p.publish_first(record(0)))
    assert p.first(10.0) == record(0)
    other = FakeStore(clock)
    q = protocol(other, clock)
    clock.at(clock.now + 1.0, lambda: CheckpointSide(other).refuse_start("checkpoint step 7 of run a is damaged"))
    with pytest.raises(OobleckError, match="checkpoint step 7 of run a is damaged"):
        q.first(10.0)
    with pytest.raises(WaitTimeout, match="generation 0"):
        protocol(FakeStore(clock), clock).first(3.0)


def test_a_forged_record_in_the_store_is_refused_when_read(store, clock):
    store.set_json("generation/1", {"generation": 1, "nodes": [0], "start_step": 0})
    with pytest.raises(RecordError, match="no instantiation"):
        protocol(store, clock).record(1)
    store.set_json("gen0/step0/decision", {"outcome": "maybe"})
    with pytest.raises(RecordError, match="step decision"):
        protocol(store, clock).decide_abort(0, 0)


def test_an_unreachable_store_is_an_error_not_an_abort_or_a_hang(store, clock):
    p = protocol(store, clock)
    clock.at(1.0, lambda: setattr(store, "down", True))
    with pytest.raises(StoreUnreachable):
        p.commit_step(0, 0, 2, [0, 1], timeout=60.0)
    assert clock.now < 1.1
    with pytest.raises(StoreUnreachable):
        p.roll_call(0, (0, 0), [0, 1], 1, timeout=60.0, suspect_after=0.5)


def test_joiners_are_admitted_oldest_first_up_to_max_nodes_and_dead_ones_never(store, clock):
    p = protocol(store, clock, lease_timeout=1.0)
    store.add("nodes/next", 6)
    for node in (3, 4, 5):
        p.report_ready(node, 1)
    p.liveness.mark_dead(4, "test")
    assert p.ready_joiners([0, 1, 2]) == [3, 5]
    assert p.ready_joiners([0, 1, 2], max_nodes=4) == [3]
    clock.every(0.2, lambda: store.add("lease/5", 1), until=60)
    clock.sleep(2.0)
    assert p.ready_joiners([0, 1, 2]) == [5], "node 3's lease stood still: it got ready and died"


def test_a_joiner_stops_waiting_when_the_run_failed(store, clock):
    """Joining.join on the protocol: a published failure (RunFailed in a member) is the run's end
    for a node not yet admitted, not a wait until elastic.join_timeout_s."""
    import logging

    from oobleck_elastic.config import load_config
    from oobleck_elastic.elastic.controller import RunOver
    from oobleck_elastic.elastic.job import WorkerIdentity
    from oobleck_elastic.elastic.joining import Joining

    cfg = load_config(None, ["elastic.join_timeout_s=300"])
    joining = Joining(cfg, None, WorkerIdentity("run", 5, 0, 1), protocol(store, clock), None, None,
                      logging.getLogger("test"))
    store.set_json("generation", record(0).to_json())
    clock.at(2.0, lambda: joining.protocol.publish_failure("GiveUp: step 3 failed 4 times", "node 0 rank 0"))
    assert isinstance(joining.join(), RunOver) and clock.now < 2.5
    assert joining.protocol.failure()["by"] == "node 0 rank 0"
    store.delete("failed")
    clock.at(clock.now + 1.0, lambda: joining.protocol.propose(record(1, nodes=((0, 1), (5,))), 1.0))
    admitted = joining.join()
    assert isinstance(admitted, GenerationRecord) and admitted.generation == 1


@pytest.mark.parametrize("rank_0, recorded, waited", [
    ("dead", False, False),      # it died before it recorded the end: recover at once
    ("records", True, False),    # it recorded the end: leave
    ("silent", False, True),     # alive, and nothing happens: the agreement timeout ends the wait
])
def test_a_worker_whose_final_barrier_failed_waits_for_the_end_only_while_rank_0_lives(store, clock, rank_0,
                                                                                      recorded, waited):
    """Ending.recorded_anyway: the wait used to go on to its timeout (30 s) after rank 0's node
    was known dead, as its check said "no" with a value a wait takes for "not yet"."""
    p = protocol(store, clock)
    trainer = SimpleNamespace(completed_steps=6)
    ending = Ending(load_config(None, []), p, None, trainer, None)  # type: ignore[arg-type]  # what it uses
    ending.at_barrier = True
    if rank_0 == "dead":
        clock.at(0.5, lambda: p.liveness.mark_dead(1, "killed"))
    elif rank_0 == "records":
        clock.at(0.5, lambda: store.set_json(key("done"), {"steps": 6}))
    plan = SimpleNamespace(members=(WorkerRef(1, 0), WorkerRef(2, 0)), generation=1)
    assert ending.recorded_anyway(plan) is recorded  # type: ignore[arg-type]
    assert (clock.now >= 30.0) is waited, clock.now
