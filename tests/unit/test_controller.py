"""The run's state machine (elastic/controller.py) on its own: every transition, driven by
events as the executor reports them, without processes, a store or a clock."""

from __future__ import annotations

import dataclasses

import pytest
from runtime_harness import templates_for

from oobleck_elastic.elastic.controller import (
    MAX_REPLAYS_WITHOUT_LOSS,
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
    GiveUp,
    Grow,
    IllegalTransition,
    Join,
    Proposed,
    Recover,
    RunOver,
    Started,
    State,
    StepDone,
    StepFailed,
    Train,
)
from oobleck_elastic.elastic.records import GenerationRecord
from oobleck_elastic.planning import build_instantiation

TEMPLATES = templates_for(6, 6)


def record(generation: int, start: int, nodes=((0, 1), (2, 3)), **fields) -> GenerationRecord:
    inst = build_instantiation([TEMPLATES.get(len(p)) for p in nodes], nodes, 24, 2)
    return GenerationRecord(generation=generation, nodes=inst.nodes, start_step=start, instantiation=inst,
                            base=generation - 1 if generation else None, **fields)


def started(steps: int = 3, eval_interval: int = 0) -> tuple[Controller, object]:
    c = Controller(steps, eval_interval)
    return c, c.handle(Started(True, record(0, 0)))


def test_a_member_builds_the_first_generation_then_trains_every_step_and_finishes():
    c, action = started(steps=3)
    assert action == Build(record(0, 0)) and c.state is State.BUILDING
    assert c.handle(Built(record(0, 0))) == Train(0) and c.state is State.TRAINING
    assert c.handle(StepDone(0)) == Train(1)
    assert c.handle(StepDone(1)) == Train(2)
    assert c.handle(StepDone(2)) == Finish()
    assert c.handle(Finished()) == Exit("done") and c.state is State.DONE
    assert [h[1] for h in c.history] == ["Started", "Built", "StepDone", "StepDone", "StepDone", "Finished"]


def test_a_joiner_waits_for_admission_or_for_the_end_of_the_run():
    c = Controller(5)
    assert c.handle(Started(False)) == Join() and c.state is State.JOINING
    assert c.handle(Admitted(record(2, 3))) == Build(record(2, 3))
    assert c.handle(Built(record(2, 3))) == Train(3), "a joiner starts at the record's step"
    late = Controller(5)
    late.handle(Started(False))
    assert late.handle(RunOver()) == Exit("run over") and late.state is State.DONE


def test_a_failed_step_is_recovered_and_replayed_from_the_record_that_won():
    c, _ = started(steps=5)
    c.handle(Built(record(0, 0)))
    c.handle(StepDone(0))
    assert c.handle(StepFailed("RuntimeError: peer gone", "Traceback ...")) == Recover("RuntimeError: peer gone")
    assert c.state is State.RECOVERING
    shrunk = record(1, 1, nodes=((0, 1), (2,)), lost=(3,))
    assert c.handle(Proposed(shrunk)) == Build(shrunk, timeout_factor=1), "a node lost: no longer timeout"
    assert c.handle(Built(shrunk)) == Train(1)


def test_a_second_failure_during_recovery_recovers_again():
    """The build of the recovery's generation fails (another node died while layers moved): the
    next recovery starts from there, and the step the survivors completed is kept."""
    c, _ = started(steps=5)
    c.handle(Built(record(0, 0)))
    c.handle(StepDone(0))
    c.handle(StepDone(1))
    c.handle(StepFailed("a"))
    c.handle(Proposed(record(1, 2)))
    assert c.handle(BuildFailed("RuntimeError while building generation 1")) == \
        Recover("RuntimeError while building generation 1") and c.state is State.RECOVERING
    assert c.handle(Proposed(record(2, 2))) == Build(record(2, 2))
    assert c.handle(Built(record(2, 2))) == Train(2)


def test_a_failure_while_the_first_generation_is_built_is_recovered():
    c, _ = started()
    assert c.handle(BuildFailed("gone")) == Recover("gone")
    assert c.handle(Proposed(record(1, 0))) == Build(record(1, 0))


def test_each_replay_with_every_node_alive_doubles_the_timeout_then_the_run_gives_up():
    c, _ = started(steps=5)
    c.handle(Built(record(0, 0)))
    factors = []
    for g in range(1, 4):
        c.handle(StepFailed("RuntimeError: timed out", f"Traceback {g}"))
        factors.append(c.handle(Proposed(record(g, 0), replay=True)).timeout_factor)
        c.handle(Built(record(g, 0)))
    assert factors == [2, 4, 8]
    c.handle(StepFailed("RuntimeError: timed out", "Traceback (most recent call last): the whole of it"))
    with pytest.raises(GiveUp, match=r"(?s)step 0 failed 4 times with every node alive.*RuntimeError: timed out"
                                     r".*the whole of it"):
        c.handle(Proposed(record(4, 0), replay=True))


def test_a_build_that_keeps_failing_with_every_node_alive_gives_up_instead_of_looping():
    """Any error while a generation is built is a failed build (Note: [failed build] in
    elastic/run.py), so a bug there would fail every build: each recovery of it is a replay on
    the same nodes, counted like a step's, and the run gives up after the same few."""
    c, _ = started(steps=5)
    c.handle(Built(record(0, 0)))
    c.handle(StepDone(0))
    c.handle(StepFailed("RuntimeError: peer gone"))
    c.handle(Proposed(record(1, 1, nodes=((0, 1), (2,)), lost=(3,))))  # a node lost: not a replay
    cause = "LookupError while building generation {}: Timeout while waiting for keys in EtcdStore"
    factors = []
    for g in range(1, MAX_REPLAYS_WITHOUT_LOSS + 1):
        assert c.handle(BuildFailed(cause.format(g), f"Traceback {g}")) == Recover(cause.format(g))
        factors.append(c.handle(Proposed(record(g + 1, 1), replay=True)).timeout_factor)
    assert factors == [2, 4, 8]
    last = MAX_REPLAYS_WITHOUT_LOSS + 1
    c.handle(BuildFailed(cause.format(last), "Traceback (most recent call last): the whole of it"))
    with pytest.raises(GiveUp, match=rf"(?s)step 1 failed 4 times with every node alive.*LookupError while "
                                     rf"building generation {last}.*the whole of it"):
        c.handle(Proposed(record(last + 1, 1), replay=True))


def test_joiners_ready_at_a_commit_grow_the_run_at_that_boundary():
    c, _ = started(steps=5)
    c.handle(Built(record(0, 0)))
    assert c.handle(StepDone(0, joiners=(4,))) == Grow((4,)) and c.state is State.BUILDING
    grown = record(1, 1, nodes=((0, 1), (2, 3), (4,)), joined=(4,))
    assert c.handle(Proposed(grown)) == Build(grown)
    assert c.handle(Built(grown)) == Train(1)


def test_a_joiner_admitted_by_a_recovery_builds_like_any_member():
    c = Controller(5)
    c.handle(Started(False))
    grown = record(3, 2, nodes=((0, 1), (4,)), joined=(4,), lost=(2, 3))
    assert c.handle(Admitted(grown)) == Build(grown)
    assert c.handle(BuildFailed("a member died")) == Recover("a member died"), "then it recovers with the others"


def test_a_stop_ends_the_run_after_its_step_and_a_stop_at_the_last_step_is_the_normal_end():
    c, _ = started(steps=3)
    c.handle(Built(record(0, 0)))
    # a stop ends the run like its last step does: the checkpoint and the end are collectives,
    # done again after a failure, and only then does the run exit, as stopped
    assert c.handle(StepDone(0, stop=True)) == Finish(stopped=True) and c.state is State.TRAINING
    c.handle(StepFailed("a node died while the stop's checkpoint was written"))
    assert c.handle(Proposed(record(1, 1))) == Build(record(1, 1))
    assert c.handle(Built(record(1, 1))) == Finish(stopped=True), "not the next step"
    assert c.handle(Finished()) == Exit("stopped") and c.state is State.DONE
    # a joiner admitted while the run stops learns it from the record, as every member does
    joiner = Controller(3)
    joiner.handle(Started(False))
    stopping = dataclasses.replace(record(1, 1), stopping=True)
    assert joiner.handle(Admitted(stopping)) == Build(stopping)
    assert joiner.handle(Built(stopping)) == Finish(stopped=True), "not Train(1): the others finish"
    c, _ = started(steps=1)
    c.handle(Built(record(0, 0)))
    assert c.handle(StepDone(0, stop=True)) == Finish()


def test_evaluations_run_at_their_interval_and_again_after_a_failure_during_one():
    c, _ = started(steps=4, eval_interval=2)
    c.handle(Built(record(0, 0)))
    c.handle(StepDone(0))
    assert c.handle(StepDone(1)) == Evaluate(2)
    c.handle(StepFailed("died while evaluating"))
    c.handle(Proposed(record(1, 2)))
    assert c.handle(Built(record(1, 2))) == Evaluate(2), "cut short on some workers: run again by all"
    assert c.handle(EvalDone(2)) == Train(2)
    # the step after it fails: rank 0 recorded the evaluation, so it is not run again
    # (every failure used to run the last evaluation again)
    c.handle(StepFailed("died in step 2"))
    c.handle(Proposed(record(2, 2)))
    evaluated = dataclasses.replace(record(2, 2), evaluated=True)  # as the proposer found it recorded
    assert c.handle(Built(evaluated)) == Train(2)
    c.handle(StepDone(2))
    assert c.handle(StepDone(3)) == Evaluate(4)
    assert c.handle(EvalDone(4)) == Finish()


def test_a_restore_goes_back_to_the_checkpoints_step():
    c, _ = started(steps=9)
    c.handle(Built(record(0, 0)))
    for step in range(6):
        c.handle(StepDone(step))
    c.handle(StepFailed("three nodes lost"))
    restored = record(1, 4, nodes=((0, 1),), restored_from=4)
    c.handle(Proposed(restored))
    assert c.handle(Built(restored)) == Train(4)


@pytest.mark.parametrize("steps_before", [None, 0, 2])
def test_a_fenced_worker_is_done_from_any_state(steps_before):
    c = Controller(5)
    if steps_before is not None:
        c.handle(Started(True, record(0, 0)))
        c.handle(Built(record(0, 0)))
        for step in range(steps_before):
            c.handle(StepDone(step))
        c.handle(StepFailed("x"))
    assert c.handle(FencedOut("not a member of generation 1")) == Exit("fenced") and c.state is State.DONE


def test_events_that_cannot_happen_in_a_state_are_refused():
    c, _ = started()
    with pytest.raises(IllegalTransition, match="StepDone cannot happen while building"):
        c.handle(StepDone(0))
    c.handle(Built(record(0, 0)))
    with pytest.raises(IllegalTransition, match="step 1 done, but step 0"):
        c.handle(StepDone(1))
    with pytest.raises(IllegalTransition, match="Proposed cannot happen while training"):
        c.handle(Proposed(record(1, 0)))
    c.handle(StepFailed("x"))
    with pytest.raises(IllegalTransition, match="Built cannot happen while recovering"):
        c.handle(Built(record(1, 0)))
