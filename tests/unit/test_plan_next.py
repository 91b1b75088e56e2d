"""planning/recovery.py: the one function that plans every kind of next generation (Note:
[next generation]), and the records that carry it through the store (elastic/records.py)."""

from __future__ import annotations

import dataclasses

import pytest
from runtime_harness import templates_for

from oobleck_elastic.elastic.records import GenerationRecord, Outcome, RecordError, Resumed, StepDecision
from oobleck_elastic.planning import build_instantiation, layer_holders
from oobleck_elastic.planning.recovery import Base, NoCheckpointError, is_replay, plan_next, transfers_between

TEMPLATES = templates_for(6, 6)
BASE = Base(3, build_instantiation([TEMPLATES.get(2), TEMPLATES.get(3)], [(0, 1), (2, 3, 4)], 24, 2))


def no_checkpoint() -> None:
    raise AssertionError("the checkpoint is read only when layers are lost")


def nxt(base=BASE, *, alive, dead=(), checkpoint=no_checkpoint, fresh=False, step=7):
    return plan_next(TEMPLATES, base, alive=alive, dead=dead, step=step, checkpoint=checkpoint, global_batch=24,
                     microbatch=2, fresh=fresh)


def test_a_lost_node_shrinks_its_pipeline_and_the_layers_come_from_the_survivors():
    layout = nxt(alive=[0, 1, 2, 4], dead=[3])
    assert layout.base == 3 and layout.start_step == 7 and layout.lost == (3,) and layout.restored_from is None
    assert layout.instantiation.nodes == (0, 1, 2, 4)
    assert sum(p.microbatches for p in layout.instantiation.pipelines) * 2 == 24, "the global batch is kept"
    transfers = transfers_between(TEMPLATES, BASE.instantiation, layout.instantiation)
    assert transfers and all(t.src.node != 3 for t in transfers)
    before, after = layer_holders(BASE.instantiation, TEMPLATES), layer_holders(layout.instantiation, TEMPLATES)
    assert all(t.layer in after[t.dst] and t.layer in before[t.src] for t in transfers)


def test_joined_nodes_are_absorbed_from_the_base():
    layout = nxt(alive=[0, 1, 2, 3, 4, 5])
    assert layout.joined == (5,) and layout.lost == () and 5 in layout.instantiation.nodes and layout.base == 3


def test_every_node_alive_is_a_replay_on_the_bases_layout():
    layout = nxt(alive=[0, 1, 2, 3, 4])
    assert layout.instantiation == BASE.instantiation and layout.base == 3
    assert layout.actions == ("every node answered the roll call: rebuilt with the same nodes",)
    assert transfers_between(TEMPLATES, BASE.instantiation, layout.instantiation) == []


def test_the_same_nodes_again_are_a_replay_whether_or_not_there_is_a_base():
    """A replay is counted (and gives up after a few); a restored layout whose build failed with
    both its nodes alive is one too (the chaos run looped on one for ever)."""
    assert is_replay(BASE, alive=[0, 1, 2, 3, 4], dead=[])
    assert is_replay(None, alive=[254, 257], dead=[])
    assert not is_replay(BASE, alive=[0, 1, 2, 4], dead=[3])
    assert not is_replay(None, alive=[254], dead=[257])
    assert not is_replay(BASE, alive=[0, 1, 2, 3], dead=[]), "node 4 neither answered nor is known dead"


def test_a_joiner_lost_before_it_was_built_in_goes_back_to_the_bases_layout():
    layout = nxt(alive=[0, 1, 2, 3, 4], dead=[5])
    assert layout.instantiation == BASE.instantiation and layout.lost == (5,)
    assert "lost before they were built in" in layout.actions[0]


def test_layers_lost_fall_back_to_the_newest_checkpoint_on_the_survivors():
    base = Base(2, build_instantiation([TEMPLATES.get(2), TEMPLATES.get(2)], [(0, 1), (2, 3)], 24, 2))
    layout = nxt(base, alive=[0, 2], dead=[1, 3], checkpoint=lambda: 4)
    assert layout.restored_from == 4 and layout.start_step == 4 and layout.base is None
    assert layout.instantiation.nodes == (0, 2) and "restored the checkpoint of step 4" in layout.actions[0]
    initial = nxt(base, alive=[0, 2], dead=[1, 3], checkpoint=lambda: 0)
    assert initial.restored_from == 0 and initial.start_step == 0
    assert initial.actions[0].startswith("no checkpoint yet: started the run again from its initial state")
    with pytest.raises(NoCheckpointError, match="layer"):  # a resumed run whose checkpoint is gone
        nxt(base, alive=[0, 2], dead=[1, 3], checkpoint=lambda: None)


def test_with_no_base_the_first_generation_starts_again_or_a_restored_one_restores_again():
    fresh = nxt(None, alive=[0, 2, 3], dead=[1], fresh=True)
    assert fresh.start_step == 0 and fresh.base is None and fresh.restored_from is None
    assert "started the run again" in fresh.actions[0]
    again = nxt(None, alive=[0, 2, 3], dead=[1], checkpoint=lambda: 5)
    assert again.restored_from == 5 and again.start_step == 5


def test_a_record_round_trips_through_its_json_and_is_checked_against_the_job():
    layout = nxt(alive=[0, 1, 2, 4], dead=[3])
    record = GenerationRecord.next(4, layout, "node 3 lost")
    assert GenerationRecord.from_json(record.to_json()) == record
    assert record.check(TEMPLATES, global_batch=24, microbatch=2, steps=10) is record
    with pytest.raises(RecordError, match="outside the run's 0..5"):
        record.check(TEMPLATES, global_batch=24, microbatch=2, steps=5)
    # a record whose instantiation has no pipeline (only spares) trains nothing: refused
    empty = dataclasses.replace(record, instantiation=dataclasses.replace(
        record.instantiation, pipelines=(), spares=record.instantiation.nodes))
    with pytest.raises(RecordError, match="it has no pipeline"):
        empty.check(TEMPLATES, global_batch=24, microbatch=2, steps=10)
    resumed = GenerationRecord(generation=0, nodes=BASE.instantiation.nodes, instantiation=BASE.instantiation,
                               start_step=4, restored_from=4, resumed=Resumed("a", 4))
    assert GenerationRecord.from_json(resumed.to_json()).resumed == Resumed("a", 4)


@pytest.mark.parametrize("damage, message", [
    ({"version": 2}, "version 2, this build reads version 1"),
    ({"base": 9}, "not an earlier generation"),
    ({"nodes": [0, 1]}, "are not its instantiation's"),
    ({"restored_from": 3}, "restores step 3 but starts at step 7"),
    ({"nodes": "all"}, "not a list of node ids"),
])
def test_a_damaged_record_is_refused_saying_why(damage, message):
    data = {**GenerationRecord.next(4, nxt(alive=[0, 1, 2, 4], dead=[3]), "x").to_json(), **damage}
    with pytest.raises(RecordError, match=message):
        GenerationRecord.from_json(data)


def test_the_bare_record_of_the_rendezvous_is_only_generation_0():
    bare = GenerationRecord(generation=0, nodes=(0, 1))
    assert GenerationRecord.from_json(bare.to_json()) == bare and not bare.planned
    with pytest.raises(RecordError, match="no instantiation"):
        GenerationRecord.from_json({"generation": 3, "nodes": [0], "start_step": 0})
    with pytest.raises(RecordError, match="no instantiation"):
        bare.check(TEMPLATES, global_batch=24, microbatch=2, steps=5)


def test_a_step_decision_round_trips_and_nothing_else_passes_for_one():
    decision = StepDecision(Outcome.COMMIT, (4, 5), stop=False)
    assert StepDecision.from_json(decision.to_json()) == decision
    assert StepDecision.from_json({"outcome": "abort", "join": []}) == StepDecision(Outcome.ABORT)
    with pytest.raises(RecordError):
        StepDecision.from_json({"outcome": "commit", "join": ["x"]})
